"""Optional-Triton plumbing shared by the GPU kernel modules.

Every public kernel module must import on a CPU machine without Triton (CI has neither), so the
``@triton.jit`` code lives in private ``_*_jit.py`` modules that are imported only on first launch.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from jetrl_trainer._choices import FLOAT_DTYPES, SCALE_FORMATS, check_choice

__all__ = [
    "call_op",
    "cdiv",
    "check_cuda_2d",
    "check_group",
    "check_scale_format",
    "load_jit",
    "triton_available",
    "triton_enabled",
]

_DISABLE_ENV = "JETRL_DISABLE_TRITON"


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (kernels still need a CUDA tensor to launch)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install without a driver/compiler
        return False
    return True


@functools.cache
def triton_enabled() -> bool:
    """Triton works and ``JETRL_DISABLE_TRITON`` is not ``"1"``: the fast quant kernels may run.

    Read once; ``jetrl_trainer.kernels.reset_kernel_caches()`` re-reads the variable. Its readers
    (documented in docs/trainer.md): the quantization kernels, the fused RMSNorm / SwiGLU
    quantization, the decode GEMM and the engine's sampler; the ``triton`` GEMM backend, the
    engine's graphed RoPE / attention kernels and the exact ops' kernels (``jetrl_trainer.exact``,
    whose torch fallbacks give other bits) ask :func:`triton_available` instead.
    """
    return triton_available() and os.environ.get(_DISABLE_ENV) != "1"


def load_jit(module: str) -> ModuleType:
    """Import ``jetrl_trainer.kernels.<module>`` (the ``@triton.jit`` code) on first use."""
    if not triton_available():
        raise RuntimeError(
            "Triton is not installed; install the 'gpu' extra (pip install 'jetrl-trainer[gpu]') "
            "or use the pure-torch reference in jetrl_trainer.quant.fp8."
        )
    return importlib.import_module(f"jetrl_trainer.kernels.{module}")


def check_cuda_2d(x: torch.Tensor, what: str, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    """Validate a kernel operand: CUDA, 2-D, an allowed dtype, unit stride along the last dim."""
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"{what} must be a CUDA tensor (got {where}); on CPU use the reference in "
            "jetrl_trainer.quant.fp8 (jetrl_trainer.quant._dispatch picks it automatically)."
        )
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D; got shape {tuple(x.shape)}. Flatten leading dims first.")
    check_choice(f"{what} dtype", x.dtype, dtypes)


def check_scale_format(scale_format: str) -> None:
    check_choice("scale_format", scale_format, SCALE_FORMATS)


def check_group(group: int, what: str = "group") -> None:
    if group < 16 or group > 1024 or group & (group - 1):
        raise ValueError(f"{what} must be a power of two in [16, 1024] for the Triton kernels; got {group}.")


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (for launch plans that aim to fill the GPU)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count_of(index)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def call_op(op, *args):
    """Run a kernel's ``custom_op``: traced as the op under ``torch.compile``, called directly otherwise.

    Going through the dispatcher costs tens of microseconds of Python per call (autograd and
    backend hops into Python), which made a QuantLinear fwd+bwd CPU-bound at Qwen3-8B shapes.
    Eager calls and CUDA-graph captures need none of it, so they call the implementation itself.
    """
    impl = getattr(op, "_init_fn", None)  # torch.library.CustomOpDef keeps the decorated function
    if impl is None or torch.compiler.is_compiling():
        return op(*args)
    return impl(*args)
