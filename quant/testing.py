"""Test helpers for code that must reproduce our numerics, shipped with the package (as DeepGEMM's).

* :func:`assert_bits_equal` — the check behind every "bit for bit" claim: compares bit patterns,
  so NaN payloads and the sign of zero count (``torch.equal`` calls NaN unequal to itself and
  ``-0.0`` equal to ``+0.0``), and reports the first mismatching coordinate.
* :func:`relative_error` — ``‖actual − expected‖₂ / ‖expected‖₂`` in FP64, for the checks that
  are close by design (a GEMM's summation order, CPU vs GPU).
"""

from __future__ import annotations

import torch

__all__ = ["assert_bits_equal", "relative_error"]

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    as_int = _SAME_SIZE_INT.get(t.element_size())
    if as_int is None:
        raise ValueError(f"assert_bits_equal supports 1-, 2-, 4- and 8-byte dtypes; got {t.dtype}.")
    return t.detach().contiguous().view(as_int)


def _show(t: torch.Tensor, bits: torch.Tensor, idx: tuple[int, ...]) -> str:
    value = t[idx].double().item() if t.is_floating_point() else t[idx].item()
    width = 2 * t.element_size()
    raw = int(bits[idx].item()) & ((1 << (8 * t.element_size())) - 1)
    return f"{value!r} (0x{raw:0{width}x})"


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Assert that ``actual`` and ``expected`` hold the same bits, element by element.

    Shapes and dtypes must match; ``expected`` is moved to ``actual``'s device. The error says how
    many elements differ and shows the first one (row-major order): its coordinate, both values
    and both bit patterns.
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    actual, expected = actual.detach(), expected.detach().to(actual.device)
    a, e = _bits(actual), _bits(expected)
    differ = a != e
    if not bool(differ.any()):
        return
    first = tuple(differ.nonzero()[0].tolist())
    raise AssertionError(
        f"{what}: {int(differ.sum())} of {differ.numel()} elements differ; first at {first}: "
        f"got {_show(actual, a, first)}, expected {_show(expected, e, first)}"
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖₂ / ‖expected‖₂`` in FP64 (0 when both are zero, inf when only
    ``expected`` is). NaN anywhere gives NaN, so a ``< tol`` check fails."""
    a = actual.detach().double()
    e = expected.detach().to(a.device).double()
    if a.shape != e.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}")
    num, den = (a - e).norm().item(), e.norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den
