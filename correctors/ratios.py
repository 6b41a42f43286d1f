"""Importance ratios ρ = π_train / π_rollout at the three levels.

``log ρ`` per token is ``train_logps − rollout_logps`` (samples come from the rollout policy).
A level turns the per-token log-ratios of a sequence into the log-ratio that each of its tokens
is weighted with:

* ``token``     — each token keeps its own ``log ρ_t``;
* ``sequence``  — ``Σ_t log ρ_t`` over the sequence's valid tokens (the exact sequence ratio);
* ``geometric`` — ``(1/n) Σ_t log ρ_t`` (geometric mean of the token ratios; length-neutral).

Departure from textbook IS: before exponentiating, ``log ρ`` is capped at :data:`MAX_LOG_RATIO`
(80, i.e. ρ ≤ 5.5e34) so that weights stay finite in float32 (``exp`` overflows float32 past
88.7). Only ratios that are already absurd are touched; the mismatch metrics still show them.
Small ratios are not floored: underflow to 0 is harmless.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = ["Level", "LEVELS", "MAX_LOG_RATIO", "check_level", "level_log_ratio", "ratio_from_log"]

Level = Literal["token", "sequence", "geometric"]
LEVELS: tuple[str, ...] = get_args(Level)

MAX_LOG_RATIO = 80.0


def check_level(level: object) -> Level:
    """Return ``level`` if it names a level, else raise ``ValueError`` listing the allowed ones."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {list(LEVELS)}; got {level!r}")
    return level  # type: ignore[return-value]


def level_log_ratio(log_ratio: Tensor, valid: Tensor, level: Level) -> Tensor:
    """Per-token log-ratio at ``level``, shape ``(B, T)`` (sequence values broadcast to tokens).

    ``log_ratio`` must already be 0 at invalid tokens (as :func:`prepare_batch` leaves it), so a
    plain row sum is the masked sum. A sequence with no valid token gets log-ratio 0 (ρ = 1).
    """
    if level == "token":
        return log_ratio
    total = log_ratio.sum(dim=-1, keepdim=True)  # (B, 1)
    if level == "geometric":
        total = total / valid.sum(dim=-1, keepdim=True).clamp_min(1)
    return total.expand_as(log_ratio)


def ratio_from_log(log_ratio: Tensor) -> Tensor:
    """``exp(min(log ρ, MAX_LOG_RATIO))`` — finite for every finite input."""
    return torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
