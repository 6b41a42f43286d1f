"""Validation of corrector hyper-parameters (bad values -> ``ValueError`` saying what is allowed)."""

from __future__ import annotations

import math

__all__ = ["check_number"]


def check_number(name: str, value: object, *, low: float, allow_inf: bool = False, strict: bool = False) -> float:
    """``value`` as a float ≥ ``low`` (> ``low`` if ``strict``); bools, NaN and, unless allowed, inf are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number; got {value!r}")
    value = float(value)
    too_low = value <= low if strict else value < low
    if math.isnan(value) or (math.isinf(value) and not allow_inf) or too_low:
        bound = f"{'>' if strict else '>='} {low}" + ("" if allow_inf else " and finite")
        raise ValueError(f"{name} must be {bound}; got {value!r}")
    return value
