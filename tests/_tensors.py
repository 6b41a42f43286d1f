"""Seeded test tensors drawn on CPU, so a seed gives the same values on every device."""

from __future__ import annotations

import torch


def seeded_randn(*shape, dtype=torch.float32, device="cpu", seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)
