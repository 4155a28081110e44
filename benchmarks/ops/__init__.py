"""One microbenchmark per fused op, each runnable as `python -m benchmarks.ops.<op>`."""
