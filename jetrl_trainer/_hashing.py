"""Counter-based hashing: random bits that are a pure function of (seed, counters), on any device.

Used where a random stream must not depend on batch composition, chunking or device: LLaDA's
likelihood masks (a row keeps its mask after TRL's shuffle) and the decode engine's per-row
sampling noise (a seed reproduces a sequence whatever else shares its batch). Products are split
into 16-bit halves so no int64 overflows: results are exact and identical on CPU and GPU.
"""

from __future__ import annotations

import torch

__all__ = ["M32", "mix32", "mix_ints"]

M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    lo = (x * (c & 0xFFFF)) & M32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def mix_ints(*values: int) -> int:
    """Chain-hash Python ints (any sign or size up to 64 bits) into one 32-bit value."""
    h = torch.zeros((), dtype=torch.int64)
    for v in values:
        h = mix32(h ^ (int(v) & M32))
        h = mix32(h ^ ((int(v) >> 32) & M32))
    return int(h)
