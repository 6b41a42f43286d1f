"""AIS: adaptive importance sampling — mix plain GRPO and truncated IS per batch.

Following Zhou et al., "AIS: Adaptive Importance Sampling for Quantized RL" (arXiv 2605.13907);
the user guide is the "AIS" section of docs/correctors.md. With ρ the ratio at ``level`` and
C = ``clip``, over the batch's valid tokens (population statistics, divide by n):

    w̄      = min(ρ, C)
    α_ess  = (1 + CV²(w̄))^(-1/2),   CV² = var(w̄) / mean(w̄)²       weight reliability
    α_mis  = min(1, d̄ / δ),          d̄ = mean |train − rollout|      divergence severity
    α_var  = max(0, (Δσ − γ) / γ),   Δσ = std(w̄·A) / std(A) − 1      variance amplification
    α      = clip(α_ess − β·α_var, 0, 1) · α_mis
    w̃      = 1 + α·(w̄ − 1)

Saturation points: α_mis = 1 once d̄ ≥ δ; α_var = 0 while Δσ ≤ γ and reaches 1 at Δσ = 2γ;
α_ess = 1 when all w̄ are equal. α = 0 gives exactly 1 everywhere (w̄ is finite, so 0·(w̄ − 1) = 0),
in particular when the policies agree (d̄ = 0 ⇒ α_mis = 0).

Choices the paper leaves open (it publishes no defaults):

* ``clip`` C = 2 — the same truncation as TIS, so AIS at α = 1 *is* token TIS.
* ``delta`` δ = 0.05 nats — the mean per-token gap at which the full correction applies. Gaps
  between a BF16 engine and a BF16 trainer are reported at KL ≈ 4e-4 … 1e-2; for a roughly Gaussian
  log-ratio, mean|Δ| ≈ 0.8·sqrt(2·KL), i.e. 0.02 … 0.11, and δ sits in the middle (KL ≈ 2e-3).
  Below δ the correction is proportionally weaker, keeping part of the exploration effect that
  the paper attributes to a small mismatch.
* ``gamma`` γ = 0.1 — tolerate up to 10% growth of the advantage spread; at 20% α_var = 1.
  Realistic token-level mismatch (log-ratio std σ ≲ 0.1) gives Δσ ≈ σ²/2 ≲ 0.005, far below γ,
  so the gate only acts when weights line up with large |A|.
* ``beta`` β = 1 — one unit of α_var cancels one unit of α_ess: at Δσ ≥ 2γ the batch falls back to
  plain GRPO.

Departures: ``α_ess`` is computed as mean(w̄)/sqrt(mean(w̄²)), algebraically equal to the formula
above and free of 0/0 (it is 0 when every w̄ underflows to 0). ``Δσ`` is 0 when std(A) is 0 (or
below 1e-6 of the RMS of A, i.e. constant up to rounding); tokens with a non-finite advantage are
left out of Δσ only. ``level`` is an extension: ρ is taken at that level and broadcast to the
sequence's tokens, the statistics stay token-weighted, and d̄ is always the token-level gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .base import Corrector
from .inputs import PreparedBatch
from .params import check_number
from .ratios import MAX_LOG_RATIO, Level, check_level, level_log_ratio

__all__ = ["AISCorrector", "AISGates", "ais_gates"]

# std(A) this small relative to RMS(A) is rounding noise around a constant, not spread.
_FLAT_ADVANTAGE_RTOL = 1e-6


class AISGates(NamedTuple):
    """The per-batch gates, each a 0-d tensor."""

    alpha: Tensor
    alpha_ess: Tensor
    alpha_mis: Tensor
    alpha_var: Tensor
    delta_sigma: Tensor


def _masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    n = valid.sum().to(x.dtype).clamp_min(1)
    return torch.where(valid, x, torch.zeros_like(x)).sum() / n


def _masked_std(x: Tensor, valid: Tensor) -> Tensor:
    """Population std over ``valid``, two-pass (no E[x²] − E[x]² cancellation)."""
    centred = x - _masked_mean(x, valid)
    return _masked_mean(centred.square(), valid).sqrt()


def _delta_sigma(w_bar: Tensor, advantages: Tensor, valid: Tensor) -> Tensor:
    """Δσ = std(w̄·A) / std(A) − 1 over valid tokens with finite A; 0 when A is constant."""
    ok = valid & torch.isfinite(advantages)
    adv = torch.where(ok, advantages, torch.zeros_like(advantages))
    std_a = _masked_std(adv, ok)
    rms_a = _masked_mean(adv.square(), ok).sqrt()
    flat = std_a <= _FLAT_ADVANTAGE_RTOL * rms_a
    growth = _masked_std(w_bar * adv, ok) / std_a.clamp_min(torch.finfo(std_a.dtype).tiny) - 1
    return torch.where(flat, torch.zeros_like(growth), growth)


def ais_gates(
    w_bar: Tensor,
    abs_diff_mean: Tensor,
    advantages: Tensor,
    valid: Tensor,
    *,
    delta: float,
    gamma: float,
    beta: float,
) -> AISGates:
    """The AIS gates for truncated weights ``w_bar`` (B, T) over ``valid`` tokens. No host sync.

    ``abs_diff_mean`` is d̄ (0-d); ``advantages`` is (B, T).
    """
    mean_w = _masked_mean(w_bar, valid)
    mean_sq = _masked_mean(w_bar.square(), valid)
    zero = torch.zeros_like(mean_w)
    alpha_ess = torch.where(mean_sq > 0, mean_w / mean_sq.clamp_min(torch.finfo(mean_sq.dtype).tiny).sqrt(), zero)
    alpha_mis = (abs_diff_mean / delta).clamp(max=1.0)
    delta_sigma = _delta_sigma(w_bar, advantages, valid)
    alpha_var = ((delta_sigma - gamma) / gamma).clamp(min=0.0)
    alpha = (alpha_ess - beta * alpha_var).clamp(0.0, 1.0) * alpha_mis
    return AISGates(alpha, alpha_ess, alpha_mis, alpha_var, delta_sigma)


@dataclass(frozen=True)
class AISCorrector(Corrector):
    """Adaptive IS: w̃ = 1 + α·(min(ρ, clip) − 1) with α from the batch's gates (module docs)."""

    name: ClassVar[str] = "ais"
    needs_advantages: ClassVar[bool] = True
    clip: float = 2.0
    delta: float = 0.05
    gamma: float = 0.1
    beta: float = 1.0
    level: Level = "token"

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip", check_number("clip", self.clip, low=1.0, allow_inf=True))
        object.__setattr__(self, "delta", check_number("delta", self.delta, low=0.0, strict=True))
        object.__setattr__(self, "gamma", check_number("gamma", self.gamma, low=0.0, strict=True))
        object.__setattr__(self, "beta", check_number("beta", self.beta, low=0.0))
        check_level(self.level)

    def compute_weights(self, batch: PreparedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        assert batch.advantages is not None  # checked in Corrector.__call__
        log_r = level_log_ratio(batch.log_ratio, batch.valid, self.level)
        log_c = math.log(self.clip)
        w_bar = torch.exp(log_r.clamp(max=min(log_c, MAX_LOG_RATIO))).clamp(max=self.clip)
        abs_diff_mean = _masked_mean(batch.log_ratio.abs(), batch.valid)  # d̄: token level always
        gates = ais_gates(
            w_bar, abs_diff_mean, batch.advantages, batch.valid,
            delta=self.delta, gamma=self.gamma, beta=self.beta,
        )  # fmt: skip
        weights = 1.0 + gates.alpha * (w_bar - 1.0)
        dtype = log_r.dtype
        sums = {
            "clipped_tokens": ((log_r > log_c) & batch.valid).to(dtype).sum(),
            "n_batches": torch.ones((), dtype=dtype, device=log_r.device),
            "alpha_sum": gates.alpha,
            "alpha_ess_sum": gates.alpha_ess,
            "alpha_mis_sum": gates.alpha_mis,
            "alpha_var_sum": gates.alpha_var,
        }
        return weights, sums
