"""The two precision phases of a GRPO step, ``train`` and ``rollout``, and the one object that switches them.

One model object serves both phases. A phase-aware module (:class:`PhaseAware`: ``QuantLinear``)
holds a recipe per phase and the phase it runs in now. It starts in ``"train"`` (its repr says so)
and only :class:`PrecisionPhases` switches it, for a whole model and for the length of a block::

    phases = PrecisionPhases(model)
    with phases.rollout():
        model.generate(...)          # every QuantLinear of `model` runs its rollout recipe
    loss = model(...).loss           # back in "train"

The phase belongs to the model, not to the process or a thread: a rollout engine's worker thread
sees the phase of the model it runs, and a second model (a KL reference) keeps its own. Modules
that serve a consumer (the fused RMSNorm / SwiGLU quantization, LLaDA's fused SwiGLU, the decode
engine's grouped projections) read the phase of the ``QuantLinear`` they feed.

Switching walks the model's modules (microseconds per module, a few times per GRPO step), so a
module converted after the object was built is switched too. Do not switch one model from two
threads at once: the blocks would restore each other's phases.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from jetrl_trainer._choices import PHASES, check_choice

__all__ = ["PHASES", "PhaseAware", "PrecisionPhases"]


class PhaseAware:
    """Mixin of a module that computes differently per precision phase; it starts in ``"train"``."""

    _precision_phase: str = "train"

    @property
    def phase(self) -> str:
        """The phase this module runs in; switched only by :class:`PrecisionPhases`."""
        return self._precision_phase


class PrecisionPhases:
    """The precision phase of ``model``'s phase-aware modules, switched by named context managers.

    ``rollout()`` and ``train()`` run the enclosed code in that phase and restore each module's
    previous phase on exit (blocks nest); ``use(phase)`` does the same for a phase given by name.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def modules(self) -> list[PhaseAware]:
        """The model's phase-aware modules, now."""
        return [m for m in self.model.modules() if isinstance(m, PhaseAware)]

    @property
    def phase(self) -> str:
        """The phase the model runs in (``"train"`` for a model without phase-aware modules, where
        both phases compute the same)."""
        module = next((m for m in self.model.modules() if isinstance(m, PhaseAware)), None)
        return module.phase if module is not None else "train"

    def rollout(self) -> contextlib.AbstractContextManager[str]:
        """Run the block in the rollout phase (sampling completions)."""
        return self.use("rollout")

    def train(self) -> contextlib.AbstractContextManager[str]:
        """Run the block in the training phase (log-probs and the gradient step)."""
        return self.use("train")

    @contextlib.contextmanager
    def use(self, phase: str) -> Iterator[str]:
        """Run the block in ``phase`` (``"train"`` or ``"rollout"``)."""
        check_choice("precision phase", phase, PHASES)
        modules = self.modules()
        previous = [m._precision_phase for m in modules]
        for m in modules:
            m._precision_phase = phase
        try:
            yield phase
        finally:
            for m, p in zip(modules, previous):
                m._precision_phase = p

    def __repr__(self) -> str:
        return f"PrecisionPhases({type(self.model).__name__}, phase={self.phase!r})"
