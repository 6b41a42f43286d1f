"""The two precision phases of a GRPO step: ``train`` and ``rollout``.

One model object serves both phases. Every ``QuantLinear`` holds a recipe per phase and reads the
active phase from here at call time, so switching costs nothing and no copy of the model is made.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from jetrl_trainer._choices import PHASES, check_choice

__all__ = ["PHASES", "current_phase", "precision_phase"]

# Thread-local so that a rollout thread (e.g. an async engine) cannot flip the trainer's phase.
_state = threading.local()


def current_phase() -> str:
    """The active phase; ``"train"`` outside any :func:`precision_phase` block."""
    return getattr(_state, "phase", "train")


@contextlib.contextmanager
def precision_phase(phase: str) -> Iterator[str]:
    """Run the enclosed code in ``phase`` (``"train"`` or ``"rollout"``); phases nest and restore."""
    check_choice("precision phase", phase, PHASES)
    previous = current_phase()
    _state.phase = phase
    try:
        yield phase
    finally:
        _state.phase = previous
