"""The ordered sum of a split-K launch's chunk partials, in one launch (`_triton_chunk_sum_jit.py`).

A decode step's GEMM spreads its K chunks over programs that store FP32 partials; adding them here
in chunk order, from zero, with one rounding at the end, repeats the additions of a program that
adds its own chunks (a training forward's launch), so both give the same bits.
"""

from __future__ import annotations

import torch

from jetrl_trainer.kernels._triton_support import cdiv, load_jit

__all__ = ["add_chunks"]

_BLOCK = 1024


def add_chunks(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = sum(partials)`` over dim 0 in order, in FP32, rounded once to ``out``'s dtype.
    ``partials``: contiguous FP32 ``(chunks, *out.shape)``; ``out``: contiguous."""
    if partials.dtype != torch.float32 or not partials.is_contiguous() or not out.is_contiguous():
        raise ValueError("add_chunks takes contiguous FP32 partials and a contiguous output.")
    if partials.shape[1:] != out.shape:
        raise ValueError(f"partials {tuple(partials.shape)} do not stack outputs of shape {tuple(out.shape)}.")
    numel = out.numel()
    if numel:
        load_jit("_triton_chunk_sum_jit").chunk_sum_kernel[(cdiv(numel, _BLOCK),)](
            partials, out, numel, CHUNKS=partials.shape[0], BLOCK=_BLOCK)  # fmt: skip
    return out
