"""Pruned-kernel convolution on torch (sparse_kernel_conv)."""
