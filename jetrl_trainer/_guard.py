"""Non-finite guard: an optimizer step whose loss or gradients are NaN/Inf is skipped.

Low-precision training can overflow; one NaN step would poison the BF16 master weights and the Adam
moments for good. The guard wraps ``optimizer.step``: when a micro-batch loss seen since the last
step, or any gradient, is non-finite, the step is not taken (parameters and optimizer state stay
untouched), a warning is logged and ``skipped_steps`` grows. The Trainer zeroes the gradients
afterwards as usual, and the LR schedule keeps following ``global_step``.

Unlike fp16 loss scaling (which also skips overflowing steps), nothing is rescaled: the step is
simply dropped. Across processes the decision is all-reduced, so every rank skips together even when
only one rank's shard of the gradients is bad (FSDP). Not active under DeepSpeed, which builds its
own optimizer.
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

__all__ = ["NonFiniteGuard"]

logger = logging.getLogger(__name__)


class NonFiniteGuard:
    """Skips optimizer steps with a non-finite loss or gradient.

    Args:
        any_across_processes: ``flag -> flag`` OR-reduced over processes (identity on one process).
    """

    def __init__(self, any_across_processes: Callable[[bool], bool] | None = None) -> None:
        self._any = any_across_processes or (lambda flag: flag)
        self._bad_loss = False
        self.skipped_steps = 0

    def observe_loss(self, loss: Tensor | float) -> None:
        """Record a micro-batch loss; a non-finite one makes the next step be skipped."""
        value = loss.detach().float() if isinstance(loss, Tensor) else torch.tensor(float(loss))
        if not bool(torch.isfinite(value).all()):
            self._bad_loss = True

    @staticmethod
    def gradients_finite(params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether every existing gradient is finite (one norm, so one host sync)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return True
        return math.isfinite(float(torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False)))

    def should_skip(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Decide (on every process alike) whether this step must be skipped; resets the loss flag."""
        local = self._bad_loss or not self.gradients_finite(params)
        self._bad_loss = False
        return self._any(local)

    def install(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Wrap ``optimizer.step`` in place (idempotent) and return the optimizer."""
        if getattr(optimizer, "_jetrl_guard", None) is self:
            return optimizer
        original_step = optimizer.step
        guard = self

        def guarded_step(opt, *args, **kwargs):
            params = (p for group in opt.param_groups for p in group["params"])
            if guard.should_skip(params):
                guard.skipped_steps += 1
                logger.warning(
                    "Non-finite loss or gradient: optimizer step skipped, weights left unchanged "
                    "(%d step(s) skipped so far).",
                    guard.skipped_steps,
                )
                return None
            return original_step(*args, **kwargs)

        # A bound method, not a plain function: torch LR schedulers re-wrap ``step.__func__``.
        optimizer.step = types.MethodType(guarded_step, optimizer)
        optimizer._jetrl_guard = self
        return optimizer
