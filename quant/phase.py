"""The two precision phases of a GRPO step: ``train`` and ``rollout``.

One model object serves both phases. Every ``QuantLinear`` holds a recipe per phase and reads the
active phase from here at call time, so switching costs nothing and no copy of the model is made.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["PHASES", "current_phase", "precision_phase"]

PHASES: tuple[str, ...] = ("train", "rollout")

# Thread-local so that a rollout thread (e.g. an async engine) cannot flip the trainer's phase.
_state = threading.local()


def current_phase() -> str:
    """The active phase; ``"train"`` outside any :func:`precision_phase` block."""
    return getattr(_state, "phase", "train")


def check_phase(phase: str) -> str:
    if phase not in PHASES:
        raise ValueError(f"Unknown precision phase {phase!r}; allowed phases are {', '.join(PHASES)}.")
    return phase


@contextlib.contextmanager
def precision_phase(phase: str) -> Iterator[str]:
    """Run the enclosed code in ``phase`` (``"train"`` or ``"rollout"``); phases nest and restore."""
    check_phase(phase)
    previous = current_phase()
    _state.phase = phase
    try:
        yield phase
    finally:
        _state.phase = previous
