"""GEMM backends and (on GPU) Triton kernels. Narrow API: tensors and (data, scale) pairs only."""
