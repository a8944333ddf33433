"""Benchmarks: each bench_*.py runs as `python -m bench.bench_x` from the repository root and prints
ratios against a peer measured in the same run (docs/benchmarks.md holds the latest tables)."""
