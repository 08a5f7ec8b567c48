"""The public gateway: Generate / GenerateStream, the accept/reject/correct loop, KV sync. No torch here."""
