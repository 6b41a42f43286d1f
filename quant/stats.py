"""Counting which precision ran in which phase: proof for tests and run logs.

Every ``QuantLinear.forward`` call records ``(phase, recipe_name)`` once (``"bf16"`` included), the
phase being the module's own, so a test can assert, e.g., that a baseline run did its rollout in FP8
and its training in BF16. Counting is switched on only by the :func:`count_quant_gemms` block;
counters are process-wide (a rollout thread is counted too) and cost one list check when unused.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

__all__ = ["count_quant_gemms", "record_gemm"]

_active: list[Counter] = []
_lock = threading.Lock()


@contextlib.contextmanager
def count_quant_gemms() -> Iterator[Counter]:
    """Yield a ``Counter`` keyed by ``(phase, recipe_name)``, filled while the block runs."""
    counter: Counter = Counter()
    with _lock:
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            # By identity: two empty Counters compare equal, so list.remove could drop the wrong one.
            for i, c in enumerate(_active):
                if c is counter:
                    del _active[i]
                    break


def record_gemm(phase: str, recipe_name: str) -> None:
    """Called by ``QuantLinear.forward``; a no-op unless a :func:`count_quant_gemms` block is open."""
    if _active:
        with _lock:
            for counter in _active:
                counter[(phase, recipe_name)] += 1
