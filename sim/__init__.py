"""A kvatlas worker process: simulated model over the tiered cache (docs/end-to-end.md)."""
