"""The corrector interface: ``Corrector(...)(train, rollout, mask, advantages) -> Correction``.

A corrector turns the per-token log-probs of the sampled tokens under the training policy
(TRL's ``old_per_token_logps``) and under the rollout policy into weights ``[B, T]`` that multiply
the per-token GRPO surrogate. It is pure tensor math: no trainer state, no distributed calls.

To write your own, subclass :class:`Corrector` (a frozen dataclass is the house style), implement
:meth:`Corrector.compute_weights`, and optionally :func:`register_corrector` it under a name. The
base class does the rest: validation, weight 1 at padded and non-finite tokens, float32 output,
the mismatch block and the ``corrector/weight_*`` metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from .inputs import PreparedBatch, prepare_batch
from .metrics import _masked_max, batch_mismatch_sums, metric_tensors_from_sums, to_floats

__all__ = ["Correction", "Corrector"]


@dataclass
class Correction:
    """What a corrector returns.

    Attributes:
        weights: ``(B, T)`` float32, detached, on the input device; 1 at padded/non-finite tokens.
        metrics: flat ``{name: float}`` (one host sync to build).
        metric_tensors: the same metrics as 0-d tensors on the device, for logging without a sync.
        sums: additive sufficient statistics; reduce each key across processes with
            :func:`~jetrl_trainer.correctors.reduce_op`, then :func:`metrics_from_sums` gives the
            metrics over all processes' tokens (the AIS gates become their mean over processes).
    """

    weights: Tensor
    metrics: dict[str, float]
    metric_tensors: dict[str, Tensor] = field(default_factory=dict)
    sums: dict[str, Tensor] = field(default_factory=dict)


def _weight_sums(weights: Tensor, valid: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """``corrector/weight_*`` sums over valid tokens (of the float32 weights actually returned)."""
    w = weights.to(dtype)
    return {
        "weight_sum": torch.where(valid, w, torch.zeros_like(w)).sum(),
        "weight_min": -_masked_max(-w, valid, -float("inf")),  # +inf when empty: min's identity
        "weight_max": _masked_max(w, valid, 0.0),  # weights are ≥ 0, so 0 is max's identity
    }


class Corrector(ABC):
    """Base class. Subclasses implement :meth:`compute_weights`; ``__call__`` does the rest.

    ``__call__`` returns a :class:`Correction` (metrics as floats, one host sync).
    :meth:`weights_and_sums` returns only the weights and the sums and never syncs; follow it with
    :func:`metrics_from_sums` (after an all-reduce, if any) when you want the figures.
    """

    name: ClassVar[str] = "custom"
    needs_advantages: ClassVar[bool] = False

    @abstractmethod
    def compute_weights(self, batch: PreparedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Return raw weights ``(B, T)`` and the corrector's own additive sums.

        Values at invalid tokens (``~batch.valid``) are ignored (replaced by 1). Own sums must follow
        the :func:`reduce_op` naming rule (``*_max``/``*_min`` or summed) to gather correctly.
        """

    def weights_and_sums(
        self,
        train_logps: Tensor,
        rollout_logps: Tensor,
        mask: Tensor,
        advantages: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Weights ``(B, T)`` float32 and the additive sums, with no host sync (see ``__call__``)."""
        if advantages is None and self.needs_advantages:
            raise ValueError(f"corrector {self.name!r} needs advantages ([B] or [B, T]); got None")
        with torch.no_grad():
            batch = prepare_batch(train_logps, rollout_logps, mask, advantages)
            raw, own_sums = self.compute_weights(batch)
            one = torch.ones((), dtype=raw.dtype, device=raw.device)
            weights = torch.where(batch.valid, raw, one).to(torch.float32)
            sums = {
                **batch_mismatch_sums(batch),
                **_weight_sums(weights, batch.valid, batch.log_ratio.dtype),
                **own_sums,
            }
        return weights, sums

    def __call__(
        self,
        train_logps: Tensor,
        rollout_logps: Tensor,
        mask: Tensor,
        advantages: Tensor | None = None,
    ) -> Correction:
        """Weights and metrics for one batch (one host sync, to turn the metrics into floats).

        Args:
            train_logps: ``(B, T)`` log-probs of the sampled tokens under the training policy.
            rollout_logps: ``(B, T)`` the same under the policy that sampled them.
            mask: ``(B, T)`` completion mask, bool or 0/1 (non-zero = valid).
            advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)``; needed by AIS only.
        """
        weights, sums = self.weights_and_sums(train_logps, rollout_logps, mask, advantages)
        tensors = metric_tensors_from_sums(sums)
        return Correction(weights=weights, metrics=to_floats(tensors), metric_tensors=tensors, sums=sums)
