"""Benchmarks run by ``python scripts/bench.py <name>``; one module per benchmark."""
