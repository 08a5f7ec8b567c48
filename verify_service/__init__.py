"""VerifyService: the target model scores k drafted tokens plus one in a single forward pass."""
