"""The rollout-backend interface: completions and the log-prob of each token under its sampler.

A backend is one small object the trainer holds (docs/architecture.md); it knows how to sample, not
how to train. The trainer makes every call inside its ``precision_phases.rollout()`` block
(`jetrl_trainer.quant.PrecisionPhases`) and hands the backend the unwrapped policy, so a backend
never sees DeepSpeed, accelerate or the trainer.

``Rollout.logprobs`` is ``None`` when a backend cannot record what its sampler drew from (beam
search; a ``generate`` wrapper that dropped our recorder; a diffusion sampler, whose tokens come
from many denoising steps). The trainer then scores the completions with a rollout-phase forward
(the policy scorer), which is the rollout policy's own log-prob of what was generated, and says
once which path it took (``Rollout.logprob_source``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from jetrl_trainer._choices import ROLLOUT_BACKENDS

__all__ = ["ROLLOUT_BACKENDS", "Rollout", "RolloutBackend"]


@dataclass
class Rollout:
    """One completion per prompt and, where the sampler recorded them, their per-token log-probs."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    # Why `logprobs` is what it is, for the trainer's one-time log line.
    logprob_source: str = "recorded by the sampler"


class RolloutBackend(ABC):
    """``generate(model, prompt_ids, sampling) -> Rollout``; one per trainer, chosen at init."""

    name: ClassVar[str]

    @abstractmethod
    def generate(self, model: nn.Module, prompt_ids: Sequence[Sequence[int]], sampling: Any) -> Rollout:
        """Sample one completion per prompt with ``model`` in the model's precision phase.

        ``sampling`` is the backend's settings object: a ``GenerationConfig`` for the autoregressive
        backends, a `DiffusionSampling` for the diffusion sampler.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
