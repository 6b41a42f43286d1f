"""Fused RMSNorm+FP8-quant and SwiGLU+FP8-quant for Qwen3 / Llama / LLaDA decoder layers.

``fuse_norm_and_swiglu(model)`` (call it after ``quantize_model``) swaps, in place:

* each decoder RMSNorm whose outputs feed ``QuantLinear``s (Qwen3/Llama ``input_layernorm`` →
  q/k/v, ``post_attention_layernorm`` → gate/up; LLaDA ``attn_norm``, ``ff_norm``) for a
  :class:`FusedRMSNorm` sharing its weight Parameter, and Qwen3's per-head ``q_norm`` / ``k_norm``
  too (no hand-over; the decode engine fuses them into its RoPE launch with the same bits);
* each Qwen3/Llama-style MLP (``gate_proj``/``up_proj``/``down_proj`` with a SiLU ``act_fn``) for a
  :class:`FusedSwiGLUMLP` holding the same three sub-modules (``state_dict`` keys unchanged).

On CUDA the fused kernels (``kernels/triton_norm.py``, ``kernels/triton_swiglu.py``) write the
activation *and* its 1×128 FP8 quantization in one pass; the output carries the pair to the next
``QuantLinear`` (``quant/_handoff.py``: stored on the output tensor, checked against its version,
gone with it). The hand-off is bit-exact by construction — the kernels' ``(q, s)`` equal
``quantize_fp8_groups`` of their output — so it changes speed, not values. Whether and in which
scale format to quantize follows the consumer's recipe in the consumer's own precision phase.

Departures from the modules they replace:
* RMSNorm is ``quant.reference.rmsnorm_reference`` (pairwise-tree mean of squares and
  ``x / sqrt(var + eps)`` instead of ``x * rsqrt(...)``): ≤ 2 BF16 ulps from transformers' module,
  identical on CPU and GPU, identical in rollout and training (both phases use this module);
* SwiGLU is exactly ``F.silu(gate) * up`` (no departure);
* the RMSNorm backward is one FP32 kernel from the saved input (not autograd through the casts);
  the SwiGLU backward is exactly autograd's (``silu_backward`` and two products, input dtype).
Falls back cleanly: layers of other shapes (LayerNorm, GELU MLPs, norms with a bias, LLaDA's
inline SwiGLU) are left untouched, and off CUDA, without Triton, or when a GPU kernel module
failed to import (``kernels.optional_module``) the pure-torch references run.

The consumer side is ``quant/_dispatch.act_quant_fp8``: it serves a carried pair before
quantizing anything itself.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from jetrl_trainer import kernels
from jetrl_trainer.quant._handoff import offer_prequantized
from jetrl_trainer.quant.linear import QuantLinear
from jetrl_trainer.quant.recipe import FP8Recipe
from jetrl_trainer.quant.reference import rmsnorm_reference, swiglu_reference

__all__ = [
    "FusedRMSNorm",
    "FusedSwiGLUMLP",
    "fuse_norm_and_swiglu",
    "should_fuse",
    "unfuse_norm_and_swiglu",
]

Pair = tuple[torch.Tensor, torch.Tensor]


def _use_kernels(x: torch.Tensor, module: str) -> bool:
    """Whether the GPU kernels of ``module`` run on ``x`` (else the pure-torch reference)."""
    return x.is_cuda and kernels.triton_enabled() and kernels.optional_module(module) is not None


def _gpu(module: str) -> ModuleType:
    loaded = kernels.optional_module(module)
    assert loaded is not None, "only called after _use_kernels() said yes"
    return loaded


def _fp8_format(consumer: Optional[nn.Module]) -> Optional[str]:
    """The scale format the consuming QuantLinear uses in its phase (None: not FP8)."""
    if isinstance(consumer, QuantLinear):
        recipe = consumer.recipes[consumer.phase]
        if isinstance(recipe, FP8Recipe):
            return recipe.scale_format
    return None


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


class _RMSNormQuantFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps, scale_format):
        # scale_format None: no FP8 consumer (Qwen3's q/k norms, a BF16 phase), so only y is written
        y, q, s = _gpu("triton_norm").rmsnorm_quant_fp8(x2d, weight, eps, scale_format=scale_format or "fp32",
                                                        quantize=scale_format is not None)  # fmt: skip
        ctx.save_for_backward(x2d, weight)
        ctx.eps = eps
        ctx.mark_non_differentiable(q, s)
        return y, q, s

    @staticmethod
    def backward(ctx, dy, _dq, _ds):
        x, w = ctx.saved_tensors
        # y = w * h, h = x * r, r = (mean(x²) + eps)^-1/2  →  dx = r * (dh - h * mean(dh * h)), one kernel
        dx, dw = _gpu("triton_norm").rmsnorm_backward(x, w, dy, ctx.eps)
        return dx, dw, None, None


class FusedRMSNorm(nn.Module):
    """RMSNorm (see module docstring) that also hands its FP8 quantization to ``consumer``."""

    def __init__(self, weight: nn.Parameter, eps: float, consumer: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self._unfused: Optional[nn.Module] = None  # the module replaced (set by the swap; not a sub-module)
        # Not a sub-module (it belongs to the attention/MLP); a weak link avoids a reference cycle.
        self._consumer = weakref.ref(consumer) if consumer is not None else (lambda: None)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused_fp8_quant=True"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _use_kernels(x, "triton_norm"):
            return rmsnorm_reference(x, self.weight, self.variance_epsilon)
        fmt = _fp8_format(self._consumer())
        x2d = x.reshape(-1, x.shape[-1])
        y, q, s = _RMSNormQuantFunction.apply(x2d, self.weight, self.variance_epsilon, fmt)
        y = y.view(*x.shape[:-1], y.shape[-1])
        if fmt is not None:
            offer_prequantized(y, q, s, fmt)
        return y


# ---------------------------------------------------------------------------------------------
# SwiGLU MLP
# ---------------------------------------------------------------------------------------------


class _SwiGLUQuantFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, scale_format):
        h, q, s = _gpu("triton_swiglu").swiglu_quant_fp8(gate, up, scale_format=scale_format)
        ctx.save_for_backward(gate, up)
        ctx.mark_non_differentiable(q, s)
        return h, q, s

    @staticmethod
    def backward(ctx, dh, _dq, _ds):
        gate, up = ctx.saved_tensors
        # Exactly what autograd runs for F.silu(gate) * up (same ops, same dtype, same bits).
        d_up = dh * F.silu(gate)
        d_gate = torch.ops.aten.silu_backward(dh * up, gate)
        return d_gate, d_up, None


class FusedSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the SwiGLU and its FP8 quant fused."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self._unfused: Optional[nn.Module] = None  # the module replaced (set by the swap; not a sub-module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up``, with its FP8 quantization offered to ``down_proj`` on CUDA."""
        if not _use_kernels(gate, "triton_swiglu") or gate.dtype != up.dtype:
            return swiglu_reference(gate, up)
        fmt = _fp8_format(self.down_proj)
        g2d, u2d = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
        h, q, s = _SwiGLUQuantFunction.apply(g2d, u2d, fmt or "fp32")
        h = h.view(*gate.shape)
        if fmt is not None:
            offer_prequantized(h, q, s, fmt)
        return h


# ---------------------------------------------------------------------------------------------
# The swap
# ---------------------------------------------------------------------------------------------

# (norm attribute, attribute path of its first consumer) per supported layer layout.
_NORMS = (
    ("input_layernorm", "self_attn.q_proj"),  # Qwen3, Llama, Mistral
    ("post_attention_layernorm", "mlp.gate_proj"),
    ("attn_norm", "q_proj"),  # LLaDA
    ("ff_norm", "ff_proj"),
)
# Qwen3's per-head q/k norms feed RoPE, not a GEMM: nothing to hand over, but the decode engine
# computes them inside its RoPE + KV-append launch (kernels/triton_rope_append.py), which can
# reproduce rmsnorm_reference and not transformers' CUDA reduction order. So both phases run them
# as FusedRMSNorm, and the engine's fused launch gives the training forward's bits.
_HEAD_NORMS = ("q_norm", "k_norm")


def _get(module: nn.Module, path: str) -> Optional[nn.Module]:
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _is_plain_rmsnorm(norm: nn.Module) -> Optional[float]:
    """eps if ``norm`` is a weight-only RMSNorm of the Qwen3/Llama/LLaDA kind, else None."""
    if not type(norm).__name__.endswith("RMSNorm") or getattr(norm, "bias", None) is not None:
        return None
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
        return None
    return float(eps)


def _is_swiglu_mlp(mlp: nn.Module) -> bool:
    parts = all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
    act = getattr(mlp, "act_fn", None)
    return parts and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")


def fuse_norm_and_swiglu(model: nn.Module) -> nn.Module:
    """Swap supported RMSNorms and SwiGLU MLPs for their fused versions, in place; returns ``model``.

    Idempotent. Call after ``quantize_model`` (the fused modules look at the consuming
    ``QuantLinear``'s recipe in its phase to decide whether to quantize and in which format).
    """
    for parent in list(model.modules()):
        head_norms = tuple((name, None) for name in _HEAD_NORMS) if hasattr(parent, "q_proj") else ()
        for norm_name, consumer_path in _NORMS + head_norms:
            norm = getattr(parent, norm_name, None)
            eps = _is_plain_rmsnorm(norm) if norm is not None and not isinstance(norm, FusedRMSNorm) else None
            if eps is not None:
                fused = FusedRMSNorm(norm.weight, eps, _get(parent, consumer_path) if consumer_path else None)
                object.__setattr__(fused, "_unfused", norm)
                setattr(parent, norm_name, fused)
        mlp = getattr(parent, "mlp", None)
        if mlp is not None and not isinstance(mlp, FusedSwiGLUMLP) and _is_swiglu_mlp(mlp):
            fused = FusedSwiGLUMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            object.__setattr__(fused, "_unfused", mlp)
            parent.mlp = fused
    return model


def unfuse_norm_and_swiglu(model: nn.Module) -> nn.Module:
    """Undo :func:`fuse_norm_and_swiglu` in place: put back the original modules (same Parameters)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (FusedRMSNorm, FusedSwiGLUMLP)) and child._unfused is not None:
                original = child._unfused
                if isinstance(child, FusedSwiGLUMLP):  # the projections may have been swapped since
                    original.gate_proj, original.up_proj, original.down_proj = child.gate_proj, child.up_proj, child.down_proj
                setattr(parent, name, original)
    return model


def should_fuse(recipes: dict) -> bool:
    """Fuse by default only where it pays and is exact: CUDA with Triton, and an FP8 phase."""
    return (
        torch.cuda.is_available()
        and kernels.triton_available()
        and all(kernels.optional_module(m) is not None for m in ("triton_norm", "triton_swiglu"))
        and any(isinstance(r, FP8Recipe) for r in recipes.values())
    )
