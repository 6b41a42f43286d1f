"""Decode attention for the engine over each row's live KV only (prefill is the model's own forward).

This is the pure-torch reference (CPU, and any device without the engine's GPU kernels).
It is GQA-aware: query head ``h`` reads KV head ``h // (H / H_kv)``, as HF's ``repeat_kv``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["decode_attention"]


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
