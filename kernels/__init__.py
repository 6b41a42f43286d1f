"""GEMM backends and (on GPU) Triton kernels. Narrow API: tensors and (data, scale) pairs only.

The emulated backend is always registered. The GPU modules are optional, under one policy: each
is imported here once, registers itself on import, and may fail (no Triton, a broken build, a bad
``deep_gemm``); a failure is logged and the module is left out, and the CPU path never notices.
Package code reaches a GPU module only through :func:`optional_module`, which returns ``None`` for
one that did not import; nothing imports from a GPU module at module level.

For scripts and tests, whatever an imported GPU module lists in ``__all__`` is also re-exported
here (e.g. ``act_quant_fp8``); a name from a module that failed is absent.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import ModuleType

import torch

from jetrl_trainer.kernels import _triton_support
from jetrl_trainer.kernels import emulated as _emulated  # noqa: F401  (registers "emulated")
from jetrl_trainer.kernels._triton_support import triton_available, triton_enabled
from jetrl_trainer.kernels.gemm import (
    auto_gemm_backends,
    available_gemm_backends,
    fp8_gemm_nt,
    forced_gemm_backend,
    gemm_backend_forced,
    register_gemm_backend,
    registered_gemm_backends,
    reset_gemm_caches,
    use_gemm_backend,
)
from jetrl_trainer.kernels.settings import (
    DecodeAttentionSettings,
    DecodeGemmSettings,
    QuantKernelSettings,
    TritonGemmSettings,
)

__all__ = [
    "DecodeAttentionSettings",
    "DecodeGemmSettings",
    "QuantKernelSettings",
    "TritonGemmSettings",
    "resolve_dispatch",
    "auto_gemm_backends",
    "available_gemm_backends",
    "fp8_gemm_nt",
    "forced_gemm_backend",
    "gemm_backend_forced",
    "optional_module",
    "register_gemm_backend",
    "registered_gemm_backends",
    "reset_kernel_caches",
    "triton_available",
    "triton_enabled",
    "use_gemm_backend",
]

_OPTIONAL = (
    "scaled_mm", "triton_gemm", "deepgemm", "triton_quant", "triton_norm", "triton_swiglu", "triton_decode_gemm",
    "triton_rope_append", "triton_sampling", "triton_invariant_matmul", "triton_exact_attention", "triton_row_sum",
    "triton_exact_rmsnorm", "triton_exact_rope",
)
_log = logging.getLogger(__name__)
_loaded: dict[str, ModuleType] = {}


def resolve_dispatch(device: torch.device | str | None = None) -> None:
    """Fill, now, every dispatch cache a quantized forward/backward reads on ``device``: the GEMM
    order, availability and automatic chain, ``JETRL_GEMM_BACKEND``, and whether Triton is enabled.

    Call it right before ``torch.compile`` first traces a quantized model (a captured actor update).
    Those caches fill on first use, and a first use inside the trace of an autograd Function is a
    side effect dynamo refuses. Registering a GEMM backend empties them again.
    """
    available_gemm_backends(device)
    auto_gemm_backends(device)
    gemm_backend_forced()
    triton_enabled()


def optional_module(name: str) -> ModuleType | None:
    """The GPU module ``jetrl_trainer.kernels.<name>`` if it imported, else ``None`` (reason logged)."""
    return _loaded.get(name)


def reset_kernel_caches() -> None:
    """Forget everything resolved once per process: the GEMM backend order and availability, and
    the values of ``JETRL_GEMM_BACKEND`` and ``JETRL_DISABLE_TRITON``. Call it after changing those
    variables in a running process (tests do); registering a backend resets the GEMM part itself."""
    reset_gemm_caches()
    _triton_support.triton_enabled.cache_clear()


def _import_optional(name: str) -> None:
    # Always under the package's own name, never ``__name__``'s: with the checkout's root on sys.path
    # (``python -m pytest`` from it) this folder is also the top-level ``kernels``, which transformers
    # imports while probing for the Hub's ``kernels`` package. Importing the GPU modules again as
    # ``kernels.<name>`` would define every ``jetrl::`` custom op a second time; torch.library then destroys
    # the first definition, and the ops these modules call under torch.compile point at a freed operator.
    fqn = f"jetrl_trainer.kernels.{name}"
    if importlib.util.find_spec(fqn) is None:
        return
    try:
        module = importlib.import_module(fqn)
    except Exception as exc:  # an optional GPU path must never break the CPU import
        _log.warning("jetrl_trainer.kernels: skipping %s (%s: %s)", fqn, type(exc).__name__, exc)
        return
    _loaded[name] = module
    for public in getattr(module, "__all__", ()):
        globals()[public] = getattr(module, public)


for _name in _OPTIONAL:
    _import_optional(_name)
