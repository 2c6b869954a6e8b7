"""Benchmarks (run on a GPU): python -m bench.bench_<family>."""
