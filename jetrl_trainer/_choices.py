"""Every set of allowed option values, defined once, and the one helper that validates them.

A leaf module (it imports only torch), so ``kernels/``, ``quant/``, ``config.py`` and the diffusion
sampler can all read it without breaking the ``kernels ← quant ← jetrl_trainer`` direction. The
modules that own a concept re-export its set (``quant.fp8.SCALE_FORMATS``,
``config.PRECISIONS``, ``diffusion.sampler.REMASKING``, …); none defines its own copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "COMPILE_MODES",
    "DECODE_PATHS",
    "FLOAT_DTYPES",
    "GPU_STUDY_STRATEGIES",
    "GRANULARITIES",
    "KV_CACHE_DTYPES",
    "NVFP4_BACKWARDS",
    "NVFP4_OUTERS",
    "PHASES",
    "PRECISIONS",
    "REMASKINGS",
    "ROLLOUT_BACKENDS",
    "UNRELEASED_ROLLOUT_BACKENDS",
    "VLLM_ROLLOUT_PRECISIONS",
    "SCALE_FORMATS",
    "STUDY_STRATEGIES",
    "STUDY_STRATEGIES_NVFP4",
    "TINY_ARCHS",
    "check_choice",
]

PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "nvfp4")  # recipe names, per phase
PHASES: tuple[str, ...] = ("train", "rollout")
# torch.compile modes for compile_policy_forward (None: torch's default)
COMPILE_MODES: tuple = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
SCALE_FORMATS: tuple[str, ...] = ("fp32", "ue8m0")  # FP8 scales: any FP32, or powers of two
NVFP4_BACKWARDS: tuple[str, ...] = ("dequantized", "high_precision")
NVFP4_OUTERS: tuple[str, ...] = ("token", "tensor")  # NVFP4 outer scale: per row, or one per tensor
REMASKINGS: tuple[str, ...] = ("low_confidence", "random")  # LLaDA sampler
# JetGRPOConfig.rollout_backend.
ROLLOUT_BACKENDS: tuple[str, ...] = ("auto", "hf", "continuous", "engine", "vllm", "diffusion")
# The decode engine's KV cache: "auto" = the model dtype; "fp8" = E4M3 with one FP32 scale per
# (token, KV head), a departure from the training forward (allowed only with a corrector).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")
# How the decode engine runs its step: Triton kernels in CUDA graphs, the same kernels eager, or the
# model's modules with SDPA (rollout/engine/settings.py).
DECODE_PATHS: tuple[str, ...] = ("graphs", "kernels", "torch", "torch_graphs")
UNRELEASED_ROLLOUT_BACKENDS: tuple[str, ...] = ()  # announced backends refused until they ship (none now)
# rollout_precision values a vLLM rollout can run: its BF16 (checkpoint-dtype) model. FP8 in vLLM would
# quantize the synced weights in vLLM's own kernels (not our quant modules): not built, so refused.
VLLM_ROLLOUT_PRECISIONS: tuple[str, ...] = ("bf16",)
GRANULARITIES: tuple[str, ...] = ("block", "group")  # GEMM B scales: 128x128 blocks, or 1x128 groups
# jetrl_trainer.study: "train_precision/rollout_precision[+corrector]". The papers' comparison, then
# the optional NVFP4 pair (emulated on CPU and Hopper, so slow).
STUDY_STRATEGIES: tuple[str, ...] = (
    "bf16/bf16", "bf16/fp8", "bf16/fp8+is", "bf16/fp8+tis", "bf16/fp8+mis", "bf16/fp8+ais", "fp8/fp8", "fp8/fp8+ais",
)  # fmt: skip
STUDY_STRATEGIES_NVFP4: tuple[str, ...] = ("nvfp4/nvfp4", "bf16/nvfp4+ais")
# The GPU study (`compare_strategies.py --gpu`): exactness pinned, since the trainer's auto leaves it off on CUDA.
GPU_STUDY_STRATEGIES: tuple[str, ...] = (
    "bf16/bf16@exact", "bf16/fp8", "bf16/fp8+tis", "bf16/fp8+ais", "fp8/fp8@exact", "fp8/fp8@plain",
)  # fmt: skip
TINY_ARCHS: tuple[str, ...] = ("qwen3", "llama", "qwen2", "llada")  # the model builders of jetrl_trainer.tiny
# Inputs the quantizers accept and outputs the GEMMs write.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

T = TypeVar("T")


def _show(value: Any) -> str:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)


def check_choice(what: str, value: Any, allowed: Sequence[T], *, normalize: bool = False) -> T:
    """``value`` if it is one of ``allowed``; else a ``ValueError`` that lists the choices.

    ``normalize=True`` (user-facing configs) also accepts a string that matches after
    ``strip().lower()`` and returns the normalized form. Callers use the returned value.
    """
    if value in allowed:
        return value
    if normalize and isinstance(value, str) and value.strip().lower() in allowed:
        return value.strip().lower()
    got = repr(value) if not isinstance(value, torch.dtype) else _show(value)
    raise ValueError(f"{what} must be one of {', '.join(_show(a) for a in allowed)}; got {got}.")
