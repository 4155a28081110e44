"""Benchmarks for sloth: op microbenchmarks (`ops/`) and end-to-end training steps (`e2e.py`)."""
