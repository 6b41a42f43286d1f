"""The engine's KV cache: one preallocated block per layer, a slot per running sequence.

Slot ``s`` holds one sequence's keys and values from position 0 (prompts are stored without their
left padding), ``lengths[s]`` of them live. Finished sequences free their slot and a waiting one
takes it, so the cache is sized by the number of sequences decoded at once, not the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    """``k``, ``v``: ``(layers, slots, kv_heads, max_len, head_dim)``; freed with the engine call."""

    def __init__(
        self, *, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def store_prompt(self, layer: int, slot: int, k: Tensor, v: Tensor) -> None:
        """Place a prompt's ``(kv_heads, n, head_dim)`` keys/values at the start of ``slot``."""
        n = k.shape[1]
        self.k[layer, slot, :, :n] = k
        self.v[layer, slot, :, :n] = v

    def append(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write one new token per row (``k``, ``v``: ``(B, kv_heads, head_dim)``) at ``lengths[slots]``."""
        positions = self.lengths[slots]
        self.k[layer, slots, :, positions] = k
        self.v[layer, slots, :, positions] = v
