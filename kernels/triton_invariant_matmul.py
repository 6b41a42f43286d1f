"""A batch-invariant matmul for CUDA: each output row's bits depend on that row and (K, N) only.

cuBLAS picks its algorithm (tile shape, split-K) per call shape, batch count included: an FP32 row
of a batched product changes with the number of rows and of batches (measured on an H200). This
kernel has one tile shape for every call and sums K in order (`_triton_invariant_matmul_jit.py`),
so a decode step's row and the same row inside a training forward get the same bits
(`jetrl_trainer.exact`, docs/architecture.md#exact-on-policy). BF16/FP16 operands go through the
tensor cores with an FP32 accumulator and one rounding at the end, as cuBLAS does; FP32 operands
use full FP32 products (no TF32).
"""

from __future__ import annotations

import torch

from jetrl_trainer.kernels._triton_support import cdiv, load_jit
from jetrl_trainer.kernels.settings import InvariantMatmulSettings

__all__ = ["invariant_matmul"]

_DEFAULT = InvariantMatmulSettings()


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, settings: InvariantMatmulSettings = _DEFAULT) -> torch.Tensor:
    """``a @ b`` for ``a`` ``(G, M, K)`` and ``b`` ``(G, K, N)`` on CUDA, one dtype, any strides
    (a stride-0 batch dim reads one matrix for every batch); returns ``(G, M, N)`` in that dtype."""
    g, m, k = a.shape
    n = b.shape[-1]
    out = torch.empty((g, m, n), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    ieee = a.dtype == torch.float32
    block_k = settings.block_k_fp32 if ieee else settings.block_k
    grid = (cdiv(m, settings.block_m), cdiv(n, settings.block_n), g)
    load_jit("_triton_invariant_matmul_jit").invariant_matmul_kernel[grid](
        a, b, out, m, n, k, *a.stride(), *b.stride(), *out.stride(),
        BLOCK_M=settings.block_m, BLOCK_N=settings.block_n, BLOCK_K=block_k, IEEE=ieee,
        num_warps=settings.num_warps, num_stages=settings.num_stages,
    )  # fmt: skip
    return out
