"""Refreshing the quantized weights after every optimizer step, registered on that optimizer.

A ``QuantLinear`` quantizes its weight once per weight version (``quant/linear.py``). An optimizer
step does not always bump the version counter: fused optimizers, and DeepSpeed, which writes the
updated values back through ``.data`` (under ZeRO-3 the cache key holds no version at all). So the
code that owns the optimizer says which models it updates::

    refresh = WeightCacheRefresh(model, optimizer)   # after each optimizer.step(): re-quantize
    ...
    refresh.remove()                                 # optional: stop following the optimizer

Nothing is registered at import and no other optimizer or model is touched. ``JetGRPOTrainer``
builds one for its policy (and for a reference model that TRL syncs into). The refresh bumps a
per-module generation; the next forward re-quantizes into the cached tensors in place, so CUDA
graphs captured on them replay the new weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jetrl_trainer.quant.linear import invalidate_weight_caches

__all__ = ["WeightCacheRefresh", "stepping_optimizer"]


def stepping_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` whose ``step`` updates the parameters, under the wrappers that
    forward ``step`` to an ``.optimizer`` attribute (accelerate's ``AcceleratedOptimizer``,
    DeepSpeed's ZeRO and mixed-precision optimizers)."""
    inner = optimizer
    while getattr(inner, "optimizer", None) is not None and inner.optimizer is not inner:
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"{type(optimizer).__name__} does not lead to a torch.optim.Optimizer (found {type(inner).__name__}); "
            "pass the optimizer whose step updates the parameters, or call "
            "jetrl_trainer.quant.invalidate_weight_caches(model) after each of its steps yourself."
        )
    return inner


class WeightCacheRefresh:
    """After every step of ``optimizer``, the ``QuantLinear``s of ``model`` re-quantize their weights.

    Args:
        model: the model whose weights the optimizer updates (its ``QuantLinear``s are found when a
            step ends, so layers converted later count too).
        optimizer: a ``torch.optim.Optimizer`` or a wrapper of one (see :func:`stepping_optimizer`).
            A step that a wrapper skips (gradient accumulation, the non-finite guard) refreshes nothing.
    """

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        self.model = model
        self.optimizer = stepping_optimizer(optimizer)
        self._handle = self.optimizer.register_step_post_hook(self._after_step)

    def follows(self, optimizer: Any) -> bool:
        """Whether this refresh is registered on ``optimizer`` (or the optimizer it wraps)."""
        return self._handle is not None and stepping_optimizer(optimizer) is self.optimizer

    def remove(self) -> None:
        """Stop refreshing (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        invalidate_weight_caches(self.model)

    def __repr__(self) -> str:
        active = self._handle is not None
        return f"WeightCacheRefresh({type(self.model).__name__}, {type(self.optimizer).__name__}, active={active})"
