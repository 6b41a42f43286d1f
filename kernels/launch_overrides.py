"""Launch-parameter overrides for the decode kernels, by name: what benchmarks and GPU test sessions
use to try a launch option before it becomes a default.

``"BALANCE=1"`` sets ``triton_decode_gemm.LAUNCH["BALANCE"]``; ``"attention.REAL_ROWS=1"`` sets
``triton_decode_attention.LAUNCH["REAL_ROWS"]``. A test session takes them from the environment:
``JETRL_TEST_LAUNCH="BALANCE=1;attention.REAL_ROWS=1" pytest -m gpu tests`` runs the whole suite as
if they were the defaults (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from . import triton_decode_attention, triton_decode_gemm

__all__ = ["apply_launch_overrides", "launch_overrides", "parse_launch_overrides"]

_ATTENTION = "attention."


def parse_launch_overrides(items: Iterable[str]) -> tuple[dict[str, int], dict[str, int]]:
    """``["BALANCE=1", "attention.REAL_ROWS=1"]`` -> ``({"BALANCE": 1}, {"REAL_ROWS": 1})``: the decode
    GEMM's and the decode attention's overrides. Raises ValueError on an unknown key or a value that
    is not an integer."""
    gemm, attention = {}, {}
    for item in filter(None, (i.strip() for i in items)):
        key, _, value = item.partition("=")
        table, launch = (attention, triton_decode_attention.LAUNCH) if key.startswith(_ATTENTION) else (
            gemm, triton_decode_gemm.LAUNCH)  # fmt: skip
        name = key.removeprefix(_ATTENTION)
        if name not in launch or not value.lstrip("-").isdigit():
            raise ValueError(f"launch override {item!r} is not KEY=<int> with KEY one of {', '.join(triton_decode_gemm.LAUNCH)} "
                             f"or attention.KEY with KEY one of {', '.join(triton_decode_attention.LAUNCH)}")  # fmt: skip
        table[name] = int(value)
    return gemm, attention


def apply_launch_overrides(gemm: dict[str, int], attention: dict[str, int]) -> tuple[dict, dict]:
    """Set the overrides in the kernels' LAUNCH tables; returns the tables as they were."""
    before = dict(triton_decode_gemm.LAUNCH), dict(triton_decode_attention.LAUNCH)
    triton_decode_gemm.LAUNCH.update(gemm)
    triton_decode_attention.LAUNCH.update(attention)
    return before


@contextlib.contextmanager
def launch_overrides(gemm: dict[str, int], attention: dict[str, int]) -> Iterator[None]:
    """The overrides inside the block, the tables restored after it."""
    before = apply_launch_overrides(gemm, attention)
    try:
        yield
    finally:
        for table, saved in zip((triton_decode_gemm.LAUNCH, triton_decode_attention.LAUNCH), before):
            table.clear()
            table.update(saved)
