"""Tiny LLaDA models for tests and CPU quickstarts (built locally, nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch

from .configuration_llada import LLaDAConfig
from .modeling_llada import LLaDAModelLM

__all__ = ["tiny_llada_config", "build_tiny_llada"]

_TINY_DEFAULTS: dict[str, Any] = dict(
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    mlp_hidden_size=128,
    max_sequence_length=512,
    rope_theta=10000.0,
    init_device=None,
    precision=None,
)


def tiny_llada_config(
    *,
    vocab_size: int,
    mask_token_id: int,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    **overrides: Any,
) -> LLaDAConfig:
    """A 2-layer, 64-wide LLaDA config; every published field can be overridden by keyword.

    ``embedding_size`` defaults to ``vocab_size`` (the 8B default of 126464 would dwarf a tiny model).
    """
    fields = {**_TINY_DEFAULTS, "embedding_size": vocab_size, **overrides}
    return LLaDAConfig(
        vocab_size=vocab_size,
        mask_token_id=mask_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **fields,
    )


def build_tiny_llada(
    *,
    vocab_size: int,
    mask_token_id: int,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> LLaDAModelLM:
    """A randomly initialised tiny :class:`LLaDAModelLM`, reproducible from ``seed``.

    The global RNG state is left untouched (initialisation runs under ``torch.random.fork_rng``).
    """
    config = tiny_llada_config(
        vocab_size=vocab_size,
        mask_token_id=mask_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LLaDAModelLM(config)
    return model.to(dtype)
