"""HTTP service and command-line entry points around the indexer."""
