"""Blockwise-scaled FP8 GEMM front door and its backend registry.

``fp8_gemm_nt(a, b)`` computes ``deq(a) @ deq(b).T`` for FP8 E4M3 operands passed as
``(data, scale)`` pairs (DeepGEMM's grammar: *nt* = A row-major, B given as ``[N, K]``):

* ``a = (a_fp8 [M, K], a_scale fp32 [M, ceil(K/128)])`` — 1×128 groups along K;
* ``b = (b_fp8 [N, K], b_scale)`` with ``b_scale`` fp32 ``[ceil(N/128), ceil(K/128)]``
  (``b_granularity="block"``, 128×128) or ``[N, ceil(K/128)]`` (``"group"``, 1×128 along K).

Backends register with a priority; the highest-priority backend available for the operands'
device runs. Forcing one: the ``backend=`` argument, then :func:`use_gemm_backend`, then the env
variable ``JETRL_GEMM_BACKEND``. A forced backend that is unknown or unavailable is a
``ValueError`` naming the available ones. In automatic mode a backend may raise
``NotImplementedError`` for a shape it does not support; the next one is tried (the emulated
backend supports everything).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Union

import torch

__all__ = [
    "GRANULARITIES",
    "GemmFn",
    "available_gemm_backends",
    "fp8_gemm_nt",
    "forced_gemm_backend",
    "register_gemm_backend",
    "registered_gemm_backends",
    "use_gemm_backend",
]

GRANULARITIES = ("block", "group")
_FP8 = torch.float8_e4m3fn
_GROUP = 128
_ENV = "JETRL_GEMM_BACKEND"

# fn(a_q, a_s, b_q, b_s, b_granularity, out_dtype) -> out [M, N]
GemmFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str, torch.dtype], torch.Tensor]
Availability = Union[bool, Callable[[torch.device], bool]]


@dataclass(frozen=True)
class _Backend:
    name: str
    fn: GemmFn
    is_available: Availability
    priority: int

    def available_on(self, device: torch.device) -> bool:
        if callable(self.is_available):
            return bool(self.is_available(device))
        return bool(self.is_available)


_backends: dict[str, _Backend] = {}
_forced = threading.local()


def register_gemm_backend(name: str, fn: GemmFn, *, is_available: Availability, priority: int) -> None:
    """Register (or replace) a backend. ``is_available`` is a bool or ``device -> bool``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"backend name must be a non-empty string; got {name!r}.")
    if not callable(fn):
        raise ValueError(f"backend {name!r}: fn must be callable.")
    _backends[name] = _Backend(name, fn, is_available, int(priority))
    _availability_cache.clear()


_availability_cache: dict[tuple[str, str], bool] = {}


def _available(backend: _Backend, device: torch.device) -> bool:
    # Availability checks may query the driver; cache them per (backend, device).
    key = (backend.name, str(device))
    if key not in _availability_cache:
        _availability_cache[key] = backend.available_on(device)
    return _availability_cache[key]


def registered_gemm_backends() -> list[str]:
    """All registered names, highest priority first."""
    return [b.name for b in sorted(_backends.values(), key=lambda b: -b.priority)]


def available_gemm_backends(device: Union[torch.device, str, None] = None) -> list[str]:
    """Names of the backends that can run on ``device`` (default CPU), highest priority first."""
    dev = torch.device(device if device is not None else "cpu")
    return [name for name in registered_gemm_backends() if _available(_backends[name], dev)]


@contextlib.contextmanager
def use_gemm_backend(name: str) -> Iterator[str]:
    """Force ``name`` for the GEMMs in this block (this thread). Nests and restores."""
    _check_registered(name)
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield name
    finally:
        _forced.name = previous


def forced_gemm_backend() -> Union[str, None]:
    """The backend forced by :func:`use_gemm_backend` in this thread, if any.

    Autograd runs CUDA backward passes on its own thread, so an autograd Function records this in
    its forward and passes it back explicitly to the GEMMs of its backward.
    """
    return getattr(_forced, "name", None)


def _check_registered(name: str) -> None:
    if name not in _backends:
        raise ValueError(f"Unknown GEMM backend {name!r}; registered: {', '.join(registered_gemm_backends())}.")


def _check_operands(a_q, a_s, b_q, b_s, b_granularity: str) -> None:
    if b_granularity not in GRANULARITIES:
        raise ValueError(f"Unknown b_granularity {b_granularity!r}; allowed: {', '.join(GRANULARITIES)}.")
    for what, q in (("a", a_q), ("b", b_q)):
        if q.dtype != _FP8 or q.dim() != 2:
            raise ValueError(f"{what} data must be 2-D float8_e4m3fn; got {q.dtype} of shape {tuple(q.shape)}.")
    (m, k), (n, kb) = a_q.shape, b_q.shape
    if k != kb:
        raise ValueError(f"a is [M, K] = {tuple(a_q.shape)} but b is [N, K] = {tuple(b_q.shape)}: K differs.")
    groups = math.ceil(k / _GROUP)
    expected_b = (math.ceil(n / _GROUP), groups) if b_granularity == "block" else (n, groups)
    for what, s, expected in (("a", a_s, (m, groups)), ("b", b_s, expected_b)):
        if s.dtype != torch.float32 or tuple(s.shape) != expected:
            raise ValueError(f"{what} scale must be float32 of shape {expected}; got {s.dtype} {tuple(s.shape)}.")


def fp8_gemm_nt(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    *,
    b_granularity: str = "block",
    out_dtype: torch.dtype = torch.bfloat16,
    backend: Union[str, None] = None,
) -> torch.Tensor:
    """``out [M, N] = deq(a) @ deq(b).T`` with FP32 (or better) accumulation, in ``out_dtype``."""
    (a_q, a_s), (b_q, b_s) = a, b
    _check_operands(a_q, a_s, b_q, b_s, b_granularity)
    device = a_q.device
    forced = backend or getattr(_forced, "name", None) or os.environ.get(_ENV) or None
    if forced is not None:
        _check_registered(forced)
        if not _available(_backends[forced], device):
            available = ", ".join(available_gemm_backends(device))
            raise ValueError(f"GEMM backend {forced!r} is not available on {device}; available: {available}.")
        return _backends[forced].fn(a_q, a_s, b_q, b_s, b_granularity, out_dtype)
    for name in available_gemm_backends(device):
        try:
            return _backends[name].fn(a_q, a_s, b_q, b_s, b_granularity, out_dtype)
        except NotImplementedError:
            continue  # this backend does not cover the shape / dtype; try the next one
    raise ValueError(f"No GEMM backend could run on {device}; registered: {', '.join(registered_gemm_backends())}.")
