"""Decode attention for the engine over each row's live KV only (prefill is the model's own forward).

`decode_attention` is the pure-torch reference (CPU, and any device without the engine's GPU
kernels). It is GQA-aware: query head ``h`` reads KV head ``h // (H / H_kv)``, as HF's ``repeat_kv``.

`matched_arithmetic` picks how the Triton decode kernel sums (tile size, tile order) so that it
reproduces the attention kernel torch runs in the training forward (transformers' SDPA call: causal,
no mask, GQA). Measured on the H200 with torch 2.11 (`benchmarks/probe_attention_bits.py`, 8B head
layout, positions up to 383): torch picks cuDNN there, and oldest-first 128-position tiles give its
output on all but 0.06% of elements (64-position tiles in flash attention's order: 23%; ``generate``'s
one-query cuDNN call: 2.1%); under flash attention, newest-first 64-position tiles in its exp2 form
give all but 0.002%. Over 36 random layers the difference decides the unified-flow mismatch.

A padded training batch (transformers passes a 4D mask; torch still picks cuDNN there on the H200)
lays its tiles from the padded row's position 0, while the engine's cache holds a row's live
positions from slot position 0. The engine passes each row's pad count (`KVCache.pads`) so that the
kernel's tiles fall on the same boundaries. H200, pads 0-300 (`probe_attention_bits.py --pad 300`):
0.03% of elements differ with the pad counts, 10.9% without; on the 8B-shaped model with prompts of
40-256 tokens the unified-flow mismatch was 0.248 with them, 0.298 without, `generate` 0.245
(`probe_engine_mismatch.py --ragged`). With several KV splits (small batches over long caches, where
`plan_splits` splits for speed) the partial sums combine in another order than one pass does.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

__all__ = ["arithmetic_note", "decode_attention", "matched_arithmetic", "training_attention_backend"]

# Decode-kernel options (kernels/triton_decode_attention.decode_attention) per SDPA backend of the
# training forward; any other backend keeps the kernel's defaults.
_ARITHMETIC = {
    SDPBackend.CUDNN_ATTENTION: dict(block_n=128, flash_order=False),
    SDPBackend.FLASH_ATTENTION: dict(block_n=64, flash_order=True),
}


def training_attention_backend(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                               device: torch.device) -> SDPBackend | None:  # fmt: skip
    """The SDPA backend torch picks for a training forward's attention on ``device`` (causal, no mask,
    GQA as transformers passes it), under the backend settings in force now; None where this torch
    does not say (``torch._fused_sdp_choice`` is private API)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    q = torch.empty(1, num_heads, 256, head_dim, dtype=dtype, device=device)
    kv = torch.empty(1, num_kv_heads, 256, head_dim, dtype=dtype, device=device)
    choice = choose(q, kv, kv, is_causal=True, enable_gqa=num_heads != num_kv_heads)
    return next(b for b in SDPBackend.__members__.values() if b.value == choice)


def matched_arithmetic(backend: SDPBackend | None) -> dict:
    """Keyword arguments of the Triton decode kernel that reproduce ``backend``'s sums ({} if unknown)."""
    return dict(_ARITHMETIC.get(backend, {}))


def arithmetic_note(backend: SDPBackend | None) -> tuple[int, str] | None:
    """(logging level, message) telling the user how the decode attention relates to the training
    forward's, or None where there is nothing to say (no CUDA backend, e.g. the CPU path)."""
    if backend is None:
        return None
    if backend in _ARITHMETIC:
        return logging.INFO, (f"jetrl: the engine's decode attention sums in the order of {backend.name}, the attention "
                              "torch runs in the training forward.")  # fmt: skip
    return logging.WARNING, (
        f"jetrl: torch runs {backend.name} for the training forward's attention here, whose order the engine's "
        "decode attention does not reproduce: the unified-flow mismatch will be larger than with a matched "
        "backend (cuDNN or flash attention; torch.backends.cuda.enable_cudnn_sdp / enable_flash_sdp)."
    )


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scaling: float) -> Tensor:
    """One query per row over its first ``lengths[b]`` cached positions.

    q ``(B, H, D)``; k_cache / v_cache ``(B, H_kv, T, D)`` (the rows' slots); returns ``(B, H, D)``.
    Only the live prefix ``T = max(lengths)`` is read. SDPA, as HF's default attention, so the
    reference sums in the order a ``generate`` over the same cache would.
    """
    live = int(lengths.max())
    groups = q.shape[1] // k_cache.shape[1]
    k = k_cache[:, :, :live].repeat_interleave(groups, dim=1)
    v = v_cache[:, :, :live].repeat_interleave(groups, dim=1)
    alive = torch.arange(live, device=q.device)[None, :] < lengths[:, None]  # (B, T)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=alive[:, None, None, :], scale=scaling)
    return out[:, :, 0]
