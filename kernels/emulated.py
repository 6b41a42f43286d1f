"""The emulated FP8 GEMM backend: any device, the CPU default.

Departure from "dequantize to FP32, then one matmul": CPU BLAS picks its summation order by
shape, so a row's output would change with the number of rows. Instead we use the structure of
blockwise scaling: per 128-wide K group the FP8 dot products are summed **exactly** in FP64 (each
product of two E4M3 values is a multiple of 2^-18 below 2^18, and 128 of them fit in 43 bits < 53),
then each group's partial sum is multiplied by its scales and accumulated over groups in a fixed
order, elementwise. The result is batch invariant and identical on every device; it equals the
FP32 dequant-matmul up to FP32 rounding (more accurate, if anything).
"""

from __future__ import annotations

import math

import torch

from jetrl_trainer.kernels.gemm import register_gemm_backend

__all__ = ["emulated_fp8_gemm_nt"]

_GROUP = 128


def emulated_fp8_gemm_nt(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    b_granularity: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``deq(a) @ deq(b).T``: a ``[M, K]`` 1×128 groups, b ``[N, K]`` 128×128 blocks or 1×128 groups."""
    m, k = a_q.shape
    n = b_q.shape[0]
    b_rows = b_s if b_granularity == "group" else b_s.repeat_interleave(_GROUP, dim=0)[:n]  # (N, G)
    a64, b64 = a_q.to(torch.float64), b_q.to(torch.float64)
    sa, sb = a_s.to(torch.float64), b_rows.to(torch.float64)
    acc = torch.zeros(m, n, dtype=torch.float64, device=a_q.device)
    # Autocast must not touch these matmuls (they would become BF16).
    with torch.autocast(device_type=a_q.device.type, enabled=False):
        for g in range(math.ceil(k / _GROUP)):
            ks = slice(g * _GROUP, min(k, (g + 1) * _GROUP))
            partial = a64[:, ks] @ b64[:, ks].T  # (M, N), exact
            acc = acc + partial * torch.outer(sa[:, g], sb[:, g])  # outer product exact in FP64
    return acc.to(out_dtype)


register_gemm_backend("emulated", emulated_fp8_gemm_nt, is_available=True, priority=0)
