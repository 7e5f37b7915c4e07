"""Benchmarks of sbnet_cupy on the GPU (python -m bench.ops)."""
