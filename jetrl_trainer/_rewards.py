"""Reward outputs, checked where the trainer sees them (TRL's ``_calculate_rewards``).

TRL turns each reward function's list into a tensor with ``torch.tensor``: a function that returns
``None`` or strings fails there with a bare ``TypeError``, and a NaN or ±inf reward flows into the
group's advantages (one inf makes the group mean inf and zeroes every advantage of the group,
silently). The policy here:

* each callable reward function is wrapped once, at init; a wrong return type raises a
  ``TypeError`` that names the function and shows what it returned;
* a non-finite reward (NaN, ±inf) is treated as missing, exactly like a ``None`` in TRL: left out of
  that function's mean and of the group baseline; a completion with no reward left gets advantage
  0. Reward models (``nn.Module``) get the same treatment on their outputs;
* the first non-finite reward of each reward function logs one warning naming the function and the
  value (TRL itself only warns when *every* function returned None for a completion, which never
  names the culprit); later ones are only counted. Once per function rather than once per trainer,
  so a second broken function is not hidden behind the first;
* ``rewards/nonfinite`` logs how many there were per generation batch (all processes, all functions);
* after ``max_nonfinite_reward_batches`` consecutive training generation batches that each held one,
  training stops with a ``RuntimeError`` naming the last offender.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
import reprlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from jetrl_trainer._dist import all_reduce_sums

__all__ = ["RewardChecks"]

logger = logging.getLogger("jetrl_trainer")


class RewardChecks:
    """Validates reward outputs, turns non-finite rewards into missing ones and counts them.

    Args:
        max_bad_batches: raise after this many consecutive training batches with a non-finite reward
            (``None``: never).
    """

    def __init__(self, max_bad_batches: int | None) -> None:
        self.max_bad_batches = max_bad_batches
        self.bad_streak = 0
        self._count = 0  # non-finite values returned by the wrapped functions in this batch, this process
        self._last = ""  # the last one, for the error message
        self._warned: set[str] = set()  # reward functions / models whose first non-finite reward was logged

    def wrap_all(self, funcs: Sequence[Any], names: Sequence[str]) -> list[Any]:
        """``funcs`` with every callable (not a reward model) wrapped by `wrap`."""
        return [f if isinstance(f, nn.Module) else self.wrap(f, name) for f, name in zip(funcs, names)]

    def wrap(self, func: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``func`` with its output checked; async functions stay async (TRL runs them on its event loop)."""
        if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None)):

            async def checked_async(*args: Any, **kwargs: Any) -> list[float | None]:
                return self.check(name, await func(*args, **kwargs))

            checked: Callable[..., Any] = checked_async
        else:

            def checked(*args: Any, **kwargs: Any) -> list[float | None]:
                return self.check(name, func(*args, **kwargs))

        return functools.wraps(func)(checked)

    def check(self, name: str, output: Any) -> list[float | None]:
        """``output`` as a list of floats or None (non-finite -> None, counted); TypeError if it is not rewards."""
        if isinstance(output, Tensor) or type(output).__module__ == "numpy":
            output = output.tolist()
        if not isinstance(output, (list, tuple)):
            raise TypeError(
                f"reward function {name!r} returned {_show(output)}; it must return a list with one float (or None "
                "to skip that completion) per completion."
            )
        values: list[float | None] = []
        for i, value in enumerate(output):
            if isinstance(value, Tensor) and value.numel() == 1:
                value = value.item()
            if value is None:
                values.append(None)
                continue
            if isinstance(value, str) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"reward function {name!r} returned {_show(value)} at position {i}; each reward must be a number, "
                    "or None to skip that completion."
                )
            if not math.isfinite(value):
                self._count += 1
                self._drop(f"reward function {name!r}", value)
                value = None
            values.append(None if value is None else float(value))
        return values

    def end_batch(self, rewards_per_func: Tensor, funcs: Sequence[Any], *, training: bool) -> float:
        """After TRL's ``_calculate_rewards``: reward-model outputs made missing where non-finite (in place),
        the batch's non-finite count over all processes returned, and the streak checked (training only)."""
        local, self._count = self._count, 0
        count = all_reduce_sums({"nonfinite": torch.tensor(float(local), device=rewards_per_func.device)})["nonfinite"]
        count = float(count)
        for i, func in enumerate(funcs):  # rewards_per_func is gathered: these counts are global already
            if isinstance(func, nn.Module):
                bad = ~torch.isfinite(rewards_per_func[:, i])
                if bad.any():
                    count += float(bad.sum())
                    self._drop(f"reward model {i}", rewards_per_func[:, i][bad][0].item())
                    rewards_per_func[bad, i] = torch.nan
        if training:
            self.bad_streak = self.bad_streak + 1 if count else 0
            if self.max_bad_batches is not None and self.bad_streak >= self.max_bad_batches:
                raise RuntimeError(
                    f"non-finite rewards (NaN or inf) in {self.bad_streak} consecutive generation batches, the last "
                    f"from: {self._last or 'another process'}. Fix the reward function (return None to skip a "
                    "completion), or raise max_nonfinite_reward_batches (None never stops)."
                )
        return count

    def _drop(self, source: str, value: float) -> None:
        """Remember a dropped non-finite reward; warn at the first one from ``source``."""
        self._last = f"{source} returned {float(value)!r}"
        if source in self._warned:
            return
        self._warned.add(source)
        logger.warning(
            "jetrl: %s; a non-finite reward is dropped like None (left out of the mean and the group baseline). "
            "Later ones from it are only counted in rewards/nonfinite, and training stops after "
            "max_nonfinite_reward_batches consecutive batches with one. Return None to skip a completion.",
            self._last,
        )


def _show(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__} ({reprlib.repr(value)})"
