"""DraftService: drafter backends (a Hugging Face draft model, n-gram prompt lookup) behind one interface."""
