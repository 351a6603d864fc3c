"""transformers internals: its import-time scans, read from roll's cache."""
