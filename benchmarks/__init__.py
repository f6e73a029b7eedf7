"""Benchmarks: each bench_*.py runs as a script (BENCHMARKS.md); shared helpers beside them."""
