"""GEMM backends and (on GPU) Triton kernels. Narrow API: tensors and (data, scale) pairs only.

The emulated backend is always registered. The GPU modules are optional: each is imported only
if its file exists, registers itself on import, and must import cleanly without Triton or CUDA.
Whatever an optional module lists in ``__all__`` is re-exported here (e.g. ``act_quant_fp8``),
which is how ``jetrl_trainer.quant._dispatch`` finds the fast kernels.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

from jetrl_trainer.kernels import emulated as _emulated  # noqa: F401  (registers "emulated")
from jetrl_trainer.kernels.gemm import (
    available_gemm_backends,
    fp8_gemm_nt,
    forced_gemm_backend,
    register_gemm_backend,
    registered_gemm_backends,
    use_gemm_backend,
)

__all__ = [
    "available_gemm_backends",
    "fp8_gemm_nt",
    "forced_gemm_backend",
    "register_gemm_backend",
    "registered_gemm_backends",
    "use_gemm_backend",
]

_OPTIONAL = ("scaled_mm", "triton_gemm", "deepgemm", "triton_quant", "triton_norm", "triton_swiglu")
_log = logging.getLogger(__name__)


def _import_optional(name: str) -> None:
    fqn = f"{__name__}.{name}"
    if importlib.util.find_spec(fqn) is None:
        return
    try:
        module = importlib.import_module(fqn)
    except Exception as exc:  # an optional GPU path must never break the CPU import
        _log.warning("jetrl_trainer.kernels: skipping %s (%s: %s)", fqn, type(exc).__name__, exc)
        return
    for public in getattr(module, "__all__", ()):
        globals()[public] = getattr(module, public)
        if public not in __all__:
            __all__.append(public)


for _name in _OPTIONAL:
    _import_optional(_name)
