"""A batch-invariant RMSNorm for CUDA: the Llama / Qwen2 / Qwen3 module's output, one launch per call.

Under the exact contract the module's own forward is nine launches on CUDA (a cast, the squares, the
row sum, the mean, ``+ eps``, ``rsqrt``, two products and a cast), each a kernel of its own in a
decode step's graph; a Qwen3 layer runs four norms. `jetrl_trainer.exact` calls this kernel in both
phases instead (`_triton_exact_rmsnorm_jit.py`): one program per row, so a row's bits never depend on
the batch.
"""

from __future__ import annotations

import torch

from jetrl_trainer.kernels._triton_support import load_jit
from jetrl_trainer.kernels.settings import RowSumSettings

__all__ = ["exact_rmsnorm"]

_DEFAULT = RowSumSettings()


def exact_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, settings: RowSumSettings = _DEFAULT
) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x²) + eps)).to(x.dtype)`` over the last dim, in ``promote_types(weight.dtype,
    x.dtype)``; ``settings.block_k`` fixes the order of each row's sum of squares."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0] and k:
        block_k = min(settings.block_k, max(16, 1 << (k - 1).bit_length()))  # a function of K alone
        load_jit("_triton_exact_rmsnorm_jit").exact_rmsnorm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), out, rows.shape[0], k, rows.stride(0), out.stride(0), float(eps),
            BLOCK_K=block_k, num_warps=settings.num_warps,
        )  # fmt: skip
    return out.view(*x.shape[:-1], k)
