"""The fixed correctors: none, IS, TIS and MIS.

With ρ the ratio at the chosen level (see :mod:`~jetrl_trainer.correctors.ratios`):

* ``none`` — weights 1 (plain GRPO); still reports the mismatch block.
* ``is``   — ρ, untruncated (capped only at e^80 to stay finite in float32).
* ``tis``  — min(ρ, C), truncated IS (Yao et al., "Your efficient RL framework secretly brings you
  off-policy RL training"). Default C = 2 (fixed by the issue; thresholds of 2–5 are the usual
  range, and 2 is the most conservative of them). ``corrector/clipped_frac`` counts tokens with
  ρ > C.
* ``mis``  — ρ inside [low, high] and 0 outside (IcePop-style masking). Defaults [0.5, 2]: the
  symmetric band around 1 in log space, the same range as TIS's C = 2. The bounds are applied to
  ``log ρ`` against ``log low`` / ``log high`` (inclusive), so the test cannot overflow;
  ``corrector/masked_frac`` counts masked tokens.

Departures from TRL's ``vllm_importance_sampling_mode``: TIS has no lower clip (TRL's optional
``clip_min``), and at the sequence/geometric levels the clipped/masked fractions count tokens of
the affected sequences, not sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .base import Corrector
from .inputs import PreparedBatch
from .params import check_number
from .ratios import MAX_LOG_RATIO, Level, check_level, level_log_ratio, ratio_from_log

__all__ = ["NoCorrector", "ISCorrector", "TISCorrector", "MISCorrector"]


@dataclass(frozen=True)
class NoCorrector(Corrector):
    """Weights of ones: plain GRPO. The mismatch block is still reported."""

    name: ClassVar[str] = "none"

    def compute_weights(self, batch: PreparedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return torch.ones_like(batch.log_ratio), {}


@dataclass(frozen=True)
class ISCorrector(Corrector):
    """Untruncated importance sampling: w = ρ at ``level`` (token | sequence | geometric)."""

    name: ClassVar[str] = "is"
    level: Level = "token"

    def __post_init__(self) -> None:
        check_level(self.level)

    def compute_weights(self, batch: PreparedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return ratio_from_log(level_log_ratio(batch.log_ratio, batch.valid, self.level)), {}


@dataclass(frozen=True)
class TISCorrector(Corrector):
    """Truncated IS: w = min(ρ, clip). ``clip`` ≥ 1 (C < 1 would down-weight on-policy tokens)."""

    name: ClassVar[str] = "tis"
    clip: float = 2.0
    level: Level = "token"

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip", check_number("clip", self.clip, low=1.0, allow_inf=True))
        check_level(self.level)

    def compute_weights(self, batch: PreparedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        log_r = level_log_ratio(batch.log_ratio, batch.valid, self.level)
        log_c = math.log(self.clip)
        # Clamp in log space (no overflow), then once more in linear space so that w ≤ C holds
        # even where exp(log C) rounds a hair above C.
        weights = torch.exp(log_r.clamp(max=min(log_c, MAX_LOG_RATIO))).clamp(max=self.clip)
        clipped = (log_r > log_c) & batch.valid
        return weights, {"clipped_tokens": clipped.to(log_r.dtype).sum()}


@dataclass(frozen=True)
class MISCorrector(Corrector):
    """Masked IS (IcePop-style): w = ρ if low ≤ ρ ≤ high else 0. Needs 0 ≤ low ≤ 1 ≤ high."""

    name: ClassVar[str] = "mis"
    low: float = 0.5
    high: float = 2.0
    level: Level = "token"

    def __post_init__(self) -> None:
        low = check_number("low", self.low, low=0.0)
        high = check_number("high", self.high, low=0.0, allow_inf=True)
        if not low <= 1.0 <= high or low == high:
            raise ValueError(
                f"MIS needs 0 <= low <= 1 <= high with low < high, so that on-policy tokens "
                f"(ratio 1) are kept; got low={low}, high={high}"
            )
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)
        check_level(self.level)

    def compute_weights(self, batch: PreparedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        log_r = level_log_ratio(batch.log_ratio, batch.valid, self.level)
        log_low = math.log(self.low) if self.low > 0 else -math.inf
        keep = (log_r >= log_low) & (log_r <= math.log(self.high))
        weights = torch.where(keep, ratio_from_log(log_r), torch.zeros_like(log_r))
        masked = ~keep & batch.valid
        return weights, {"masked_tokens": masked.to(log_r.dtype).sum()}
