"""Validate corrector inputs and bring them to one working form.

Every corrector and every mismatch statistic starts from the same :class:`PreparedBatch`, so the
rules below hold everywhere:

* a token is *valid* when ``mask`` is non-zero **and** both log-probs are finite;
* a masked-in token with a NaN/±Inf log-prob is *non-finite*: it is left out of every statistic,
  counted in ``mismatch/nonfinite_tokens``, and gets weight exactly 1 (no correction — the same
  choice TRL makes when vLLM returns a NaN sampling log-prob);
* padded tokens (``mask == 0``) may hold anything, including NaN: they are never read.

Statistics are computed in float64 (float32 on MPS, which has no float64) so that sums over long
batches and the hand-worked test values do not depend on accumulation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PreparedBatch", "prepare_batch", "stat_dtype"]


@dataclass(frozen=True)
class PreparedBatch:
    """Inputs after validation. All tensors are detached, on the input device, ``stat_dtype``.

    Attributes:
        log_ratio: ``(B, T)`` ``train − rollout`` at valid tokens, 0 elsewhere.
        valid: ``(B, T)`` bool, mask and finite.
        nonfinite: ``(B, T)`` bool, mask and not finite.
        advantages: ``(B, T)`` advantages broadcast to tokens, or ``None`` when not given.
    """

    log_ratio: Tensor
    valid: Tensor
    nonfinite: Tensor
    advantages: Tensor | None


def stat_dtype(device: torch.device) -> torch.dtype:
    """float64 for statistics, except on MPS (no float64 there)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _check_shapes(train: Tensor, rollout: Tensor, mask: Tensor, adv: Tensor | None) -> None:
    if train.dim() != 2:
        raise ValueError(f"train_logps must have shape [B, T]; got {tuple(train.shape)}")
    if rollout.shape != train.shape or mask.shape != train.shape:
        raise ValueError(
            "train_logps, rollout_logps and mask must share one [B, T] shape; got "
            f"train_logps {tuple(train.shape)}, rollout_logps {tuple(rollout.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    if adv is not None:
        b, t = train.shape
        if tuple(adv.shape) not in {(b,), (b, 1), (b, t)}:
            raise ValueError(
                f"advantages must have shape [B]={[b]}, [B, 1] or [B, T]={[b, t]}; "
                f"got {tuple(adv.shape)}"
            )


def _check_dtypes_and_devices(tensors: dict[str, Tensor]) -> None:
    for name in ("train_logps", "rollout_logps"):
        if not tensors[name].is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor; got {tensors[name].dtype}")
    if tensors["mask"].is_complex():
        raise ValueError("mask must be bool or real 0/1 values")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all inputs must be on one device; got {devices}")


def prepare_batch(
    train_logps: Tensor,
    rollout_logps: Tensor,
    mask: Tensor,
    advantages: Tensor | None = None,
) -> PreparedBatch:
    """Validate shapes/dtypes/devices and build the :class:`PreparedBatch` (no host sync)."""
    tensors = {
        "train_logps": _check_tensor("train_logps", train_logps),
        "rollout_logps": _check_tensor("rollout_logps", rollout_logps),
        "mask": _check_tensor("mask", mask),
    }
    if advantages is not None:
        tensors["advantages"] = _check_tensor("advantages", advantages)
    _check_shapes(train_logps, rollout_logps, mask, advantages)
    _check_dtypes_and_devices(tensors)

    dtype = stat_dtype(train_logps.device)
    train = train_logps.detach().to(dtype)
    rollout = rollout_logps.detach().to(dtype)
    in_mask = mask.detach() != 0
    finite = torch.isfinite(train) & torch.isfinite(rollout)
    valid = in_mask & finite
    # torch.where, not multiplication: 0 * NaN would leak padding garbage into the sums.
    log_ratio = torch.where(valid, train - rollout, torch.zeros((), dtype=dtype, device=train.device))
    adv = None
    if advantages is not None:
        adv = advantages.detach().to(dtype)
        adv = (adv[:, None] if adv.dim() == 1 else adv).expand_as(train)  # (B, T)
    return PreparedBatch(log_ratio=log_ratio, valid=valid, nonfinite=in_mask & ~finite, advantages=adv)
