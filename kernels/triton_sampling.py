"""FP64 block sums of the sampler's probabilities, the first level of its inverse-CDF draw.

``block_sums_fp64(probs [B, V] fp32, block) -> [B, ceil(V / block)] fp64``. torch computes the same
sums only by first materializing an FP64 (and, for a ragged last block, padded) copy of the table,
a visible share of a decode step at Qwen3's vocabulary (docs/history.md §7); this kernel reads the
FP32 table once. Sums are in FP64, added in
another order than torch's reduction: the draw's contract (``rollout/engine/sampling.py``) allows it.
"""

from __future__ import annotations

import torch

from ._triton_support import call_op, cdiv, check_cuda_2d, load_jit

__all__ = ["block_sums_fp64"]


@torch.library.custom_op("jetrl::block_sums_fp64", mutates_args=(), device_types="cuda")
def _block_sums_op(probs: torch.Tensor, block: int) -> torch.Tensor:
    jit = load_jit("_triton_sampling_jit")
    rows, vocab = probs.shape
    n_blocks = cdiv(vocab, block)
    out = torch.empty((rows, n_blocks), dtype=torch.float64, device=probs.device)
    if rows == 0 or n_blocks == 0:
        return out
    jit.block_sums_fp64_kernel[(rows, n_blocks)](
        probs, out, vocab, probs.stride(0), n_blocks, BLOCK=block, num_warps=4
    )
    return out


@_block_sums_op.register_fake
def _(probs, block):
    return probs.new_empty((probs.shape[0], cdiv(probs.shape[1], block)), dtype=torch.float64)


def block_sums_fp64(probs: torch.Tensor, block: int) -> torch.Tensor:
    """Per row, the FP64 sum of each ``block`` consecutive entries of ``probs`` (the last block may be short)."""
    check_cuda_2d(probs, "probs", (torch.float32,))
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two (a Triton tile width); got {block}.")
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    return call_op(_block_sums_op, probs, block)
