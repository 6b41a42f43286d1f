"""Blockwise-scaled FP8 GEMM front door and its backend registry.

``fp8_gemm_nt(a, b)`` computes ``deq(a) @ deq(b).T`` for FP8 E4M3 operands passed as
``(data, scale)`` pairs (DeepGEMM's grammar: *nt* = A row-major, B given as ``[N, K]``):

* ``a = (a_fp8 [M, K], a_scale fp32 [M, ceil(K/128)])`` — 1×128 groups along K;
* ``b = (b_fp8 [N, K], b_scale)`` with ``b_scale`` fp32 ``[ceil(N/128), ceil(K/128)]``
  (``b_granularity="block"``, 128×128) or ``[N, ceil(K/128)]`` (``"group"``, 1×128 along K).

Backends register with a priority. The automatic choice tries, highest priority first, the
backends available on the operands' device that are not *opt-in*; a backend may raise
``NotImplementedError`` for a shape it does not support, and the next one is tried (the emulated
backend supports everything). An opt-in backend (``deepgemm``, until a GPU test has run it
against a real DeepGEMM) runs only when forced. Forcing one: the ``backend=`` argument, then
:func:`use_gemm_backend`, then the env variable ``JETRL_GEMM_BACKEND`` (e.g.
``JETRL_GEMM_BACKEND=deepgemm``). A forced backend that is unknown or unavailable is a
``ValueError`` naming the available ones; a forced backend's ``NotImplementedError`` propagates.

What each way of forcing reaches. ``JETRL_GEMM_BACKEND`` is read once per process, at the first
GEMM, and picks the backend of this front door only: the training forward and backward, and
rollout GEMMs above decode size. The split-K decode GEMM of rollouts (``quant/_dispatch.py``) is
not a backend here and keeps running, so the variable never changes a rollout's summation order.
:func:`use_gemm_backend` is the scoped switch for tests and benchmarks: inside its block every FP8
linear of this thread goes through the forced backend, the decode GEMM stepping aside.

Per-call cost: the priority order, each backend's availability per device, the automatic chain
per device and ``JETRL_GEMM_BACKEND`` are resolved once, not per GEMM. Registering a backend
resets them; so does ``jetrl_trainer.kernels.reset_kernel_caches()`` (after changing the env
variable in a running process).
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

from jetrl_trainer._choices import GRANULARITIES, check_choice

__all__ = [
    "GRANULARITIES",
    "GemmFn",
    "auto_gemm_backends",
    "available_gemm_backends",
    "column_major",
    "fp8_gemm_nt",
    "forced_gemm_backend",
    "gemm_backend_forced",
    "register_gemm_backend",
    "registered_gemm_backends",
    "reset_gemm_caches",
    "use_gemm_backend",
]

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
    opt_in: bool

    def available_on(self, device: torch.device) -> bool:
        if callable(self.is_available):
            return bool(self.is_available(device))
        return bool(self.is_available)


_backends: dict[str, _Backend] = {}
_forced = threading.local()

# Resolved once (see the module docstring); reset_gemm_caches() empties them.
_order: list[_Backend] = []  # registered, highest priority first; empty = not built yet
_availability: dict[tuple[str, torch.device], bool] = {}  # availability checks may query the driver
_auto: dict[torch.device, tuple[_Backend, ...]] = {}
_env: list[Union[str, None]] = []  # [JETRL_GEMM_BACKEND or None]; empty = not read yet


def register_gemm_backend(
    name: str, fn: GemmFn, *, is_available: Availability, priority: int, opt_in: bool = False
) -> None:
    """Register (or replace) a backend. ``is_available`` is a bool or ``device -> bool``.

    ``opt_in=True`` keeps it out of the automatic choice: it runs only when forced by name.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"backend name must be a non-empty string; got {name!r}.")
    if not callable(fn):
        raise ValueError(f"backend {name!r}: fn must be callable.")
    _backends[name] = _Backend(name, fn, is_available, int(priority), bool(opt_in))
    reset_gemm_caches()


def reset_gemm_caches() -> None:
    """Drop the resolved order, availability, automatic chains and ``JETRL_GEMM_BACKEND`` value."""
    for cache in (_order, _availability, _auto, _env):
        cache.clear()


def _sorted() -> list[_Backend]:
    if not _order:
        _order[:] = sorted(_backends.values(), key=lambda b: -b.priority)  # one atomic store
    return _order


def _available(backend: _Backend, device: torch.device) -> bool:
    key = (backend.name, device)
    hit = _availability.get(key)
    if hit is None:
        hit = _availability[key] = backend.available_on(device)
    return hit


def _auto_chain(device: torch.device) -> tuple[_Backend, ...]:
    chain = _auto.get(device)
    if chain is None:
        chain = _auto[device] = tuple(b for b in _sorted() if not b.opt_in and _available(b, device))
    return chain


def _env_forced() -> Union[str, None]:
    if not _env:
        _env[:] = [os.environ.get(_ENV) or None]
    return _env[0]


def _as_device(device: Union[torch.device, str, None]) -> torch.device:
    return torch.device(device if device is not None else "cpu")


def registered_gemm_backends() -> list[str]:
    """All registered names, highest priority first (opt-in ones included)."""
    return [b.name for b in _sorted()]


def available_gemm_backends(device: Union[torch.device, str, None] = None) -> list[str]:
    """Names of the backends that can run on ``device`` (default CPU), highest priority first.

    Opt-in backends are included (they can be forced); :func:`auto_gemm_backends` leaves them out.
    """
    dev = _as_device(device)
    return [b.name for b in _sorted() if _available(b, dev)]


def auto_gemm_backends(device: Union[torch.device, str, None] = None) -> list[str]:
    """The backends the automatic choice tries on ``device`` (default CPU), in order."""
    return [b.name for b in _auto_chain(_as_device(device))]


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
    """The backend forced by :func:`use_gemm_backend` in this thread, if any (the env variable aside).

    Autograd runs CUDA backward passes on its own thread, so an autograd Function records this in
    its forward and passes it back explicitly to the GEMMs of its backward.
    """
    return getattr(_forced, "name", None)


def gemm_backend_forced() -> Union[str, None]:
    """The backend :func:`fp8_gemm_nt` is forced to in this thread (by :func:`use_gemm_backend` or
    ``JETRL_GEMM_BACKEND``), if any; reading it also reads the env variable now (once)."""
    return getattr(_forced, "name", None) or _env_forced()


def _check_registered(name: str) -> None:
    if name not in _backends:
        raise ValueError(f"Unknown GEMM backend {name!r}; registered: {', '.join(registered_gemm_backends())}.")


def _check_operands(a_q, a_s, b_q, b_s, b_granularity: str) -> None:
    check_choice("b_granularity", b_granularity, GRANULARITIES)
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


def column_major(s: torch.Tensor) -> torch.Tensor:
    """``s [R, C]`` with strides ``(1, R)``, the layout of ``_scaled_mm``'s 1×128 scales (``s`` itself if it has it)."""
    # Explicit strides: `.t().contiguous().t()` keeps odd strides when a dim has size 1.
    if s.stride() == (1, s.shape[0]):
        return s
    return torch.empty_strided(s.shape, (1, s.shape[0]), dtype=s.dtype, device=s.device).copy_(s)


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
    forced = backend or getattr(_forced, "name", None) or _env_forced()
    if forced is not None:
        _check_registered(forced)
        if not _available(_backends[forced], device):
            available = ", ".join(available_gemm_backends(device))
            raise ValueError(f"GEMM backend {forced!r} is not available on {device}; available: {available}.")
        return _backends[forced].fn(a_q, a_s, b_q, b_s, b_granularity, out_dtype)
    for chosen in _auto_chain(device):
        try:
            return chosen.fn(a_q, a_s, b_q, b_s, b_granularity, out_dtype)
        except NotImplementedError:
            continue  # this backend does not cover the shape / dtype; try the next one
    raise ValueError(f"No GEMM backend could run on {device}; registered: {', '.join(registered_gemm_backends())}.")
