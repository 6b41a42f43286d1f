"""A batch-invariant row sum for CUDA: each row's FP32 sum depends on that row and K only.

`jetrl_trainer.exact` reduces the RMSNorm's mean of squares with it in the decode and the training
forward alike. A torch reduction picks its thread layout by the number of rows, so a row's sum would
change with the batch; the invariant matmul against a ones column would keep the order but runs one
program per 64 rows in FP32 FMA, a serial walk over K that a decode step's few rows cannot spread
over the GPU. Here every row is a program of its own (`_triton_row_sum_jit.py`).
"""

from __future__ import annotations

import torch

from jetrl_trainer.kernels._triton_support import load_jit
from jetrl_trainer.kernels.settings import RowSumSettings

__all__ = ["row_sum"]

_DEFAULT = RowSumSettings()


def row_sum(x: torch.Tensor, settings: RowSumSettings = _DEFAULT) -> torch.Tensor:
    """The FP32 sum of each row of ``x`` ``(M, K)`` (any float dtype, unit stride along K), ``(M,)``."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.zeros(m, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return out
    block_k = min(settings.block_k, max(16, 1 << (k - 1).bit_length()))  # a function of K alone
    load_jit("_triton_row_sum_jit").row_sum_kernel[(m,)](
        x, out, m, k, x.stride(0), BLOCK_K=block_k, num_warps=settings.num_warps,
    )  # fmt: skip
    return out
