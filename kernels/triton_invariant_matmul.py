"""A batch-invariant matmul for CUDA: each output row's bits depend on that row and (K, N) only.

cuBLAS picks its algorithm (tile shape, split-K) per call shape, batch count included: an FP32 row
of a batched product changes with the number of rows and of batches (measured on an H200). This
kernel sums K in order with one K step for every call (`_triton_invariant_matmul_jit.py`), so a
decode step's row and the same row inside a training forward get the same bits
(`jetrl_trainer.exact`, docs/architecture.md#exact-on-policy). Launches of many rows take a wider
tile (`InvariantMatmulSettings.wide_from_rows`): each output is still the same sum in the same
order, and the GPU test checks that the tensor cores round it alike at both tiles. K is split in
chunks fixed by K, so a decode step's few rows can spread the chunks over idle SMs with the bits of
a training forward that adds them inside each program. BF16/FP16 operands go through the
tensor cores with an FP32 accumulator and one rounding at the end, as cuBLAS does; FP32 operands
use full FP32 products (no TF32).
"""

from __future__ import annotations

import torch

from jetrl_trainer.kernels._triton_support import cdiv, load_jit, sm_count
from jetrl_trainer.kernels.settings import InvariantMatmulSettings
from jetrl_trainer.kernels.triton_chunk_sum import add_chunks

__all__ = ["invariant_matmul"]

_DEFAULT = InvariantMatmulSettings()


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, settings: InvariantMatmulSettings = _DEFAULT, *,
                     spread: bool | None = None, tile: tuple[int, int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """``a @ b`` for ``a`` ``(G, M, K)`` and ``b`` ``(G, K, N)`` on CUDA, one dtype, any strides
    (a stride-0 batch dim reads one matrix for every batch); returns ``(G, M, N)`` in that dtype.

    K is summed in chunks of ``settings.split_k`` (its plan fixed by K alone). ``spread``: each chunk
    in its own programs, then added here in order, for launches whose tiles alone would leave SMs idle
    (a decode step's few rows); otherwise each program adds its chunks itself. The same bits either
    way; None picks by the tile count against this GPU's SM count. ``tile``: (block_m, block_n,
    num_warps) instead of the settings' pick by row count and dtype (`_tile`), for tests."""
    g, m, k = a.shape
    n = b.shape[-1]
    out = torch.empty((g, m, n), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    ieee = a.dtype == torch.float32
    block_k = settings.block_k_fp32 if ieee else settings.block_k
    block_m, block_n, num_warps = tile or _tile(settings, m, ieee)
    chunks = cdiv(k, settings.split_k)
    tiles = cdiv(m, block_m) * cdiv(n, block_n) * g
    if spread is None:
        spread = chunks > 1 and a.is_cuda and tiles < sm_count(a.device)
    partials = torch.empty((chunks, g, m, n), dtype=torch.float32, device=a.device) if spread else out
    stride_c = partials.stride() if spread else (0, *out.stride())
    grid = (cdiv(m, block_m), cdiv(n, block_n), g * chunks if spread else g)
    load_jit("_triton_invariant_matmul_jit").invariant_matmul_kernel[grid](
        a, b, partials, m, n, k, chunks, *a.stride(), *b.stride(), *stride_c,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, CHUNK=settings.split_k, IEEE=ieee,
        SPREAD=spread, num_warps=num_warps, num_stages=settings.num_stages,
    )  # fmt: skip
    if spread:  # the chunks added to a zero total in order, as a program adds its own; one rounding at the end
        add_chunks(partials, out)
    return out


def _tile(settings: InvariantMatmulSettings, rows: int, ieee: bool = False) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) for a launch of ``rows`` rows: the wide tile from
    ``settings.wide_from_rows`` on for tensor-core operands (BF16 at the 8B shapes: slower at 64 rows,
    its tiles half empty, faster at 12,288). FP32 operands keep the narrow tile: their FMA products
    were not measured wide."""
    if settings.wide_from_rows and rows >= settings.wide_from_rows and not ieee:
        return settings.wide_block_m, settings.wide_block_n, settings.wide_num_warps
    return settings.block_m, settings.block_n, settings.num_warps
