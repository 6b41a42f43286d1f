"""The decoder the engine runs: an HF Llama-family model's own modules, read in place (no copy).

The engine never copies a weight. It calls the policy's modules one by one: the norms, the q/k/v/o
and MLP projections (a `QuantLinear` runs the active phase's recipe with the FP8 weight cache the
training forward uses; a peft LoRA layer adds its BF16 adapters on top), HF's rotary embedding
(so every ``rope_scaling`` HF implements, llama3 included, is HF's), and the LM head. Only the
attention and the KV cache are the engine's own (`attention.py`, `kv_cache.py`): that is where a
batched decode differs from a training forward, and the only place the FP32 summation order may.
On the kernel path the engine also launches, with the modules' own weights, what reproduces a
module's bits in fewer launches (grouped projections, fused norms and SwiGLU): `plan.py` says
which, per layer, and `layers.py` runs the layers.

Supported: ``model_type`` llama (Llama 2/3.x), qwen2 (q/k/v biases) and qwen3 (q/k norms), full
attention only, with unsharded parameters (DDP, DeepSpeed ZeRO-1/2; not ZeRO-3). Anything else is
refused with the reason, and the backend falls back to ``hf``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .projections import QKV_MAX_ROWS, GroupedProjection

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderView", "is_gated_mlp", "unsupported_model_reason"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under peft / accelerate wrappers."""
    model = getattr(model, "module", model)  # DDP
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported_model_reason(model: nn.Module) -> str | None:
    """Why the engine cannot run ``model``, or None when it can."""
    base = _base_model(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(config, "layer_types", None) or ())
    ):
        return "sliding-window attention is not supported"
    inner = getattr(base, "model", None)
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(base).__name__} does not have the Llama module layout (model.embed_tokens/layers/norm/rotary_emb)"
    if not hasattr(base, "lm_head"):
        return f"{type(base).__name__} has no lm_head"
    if any(hasattr(p, "ds_id") for p in base.parameters()):
        # ZeRO-3 gathers each weight in a forward hook and frees it after: the engine reads weights in
        # place and captures CUDA graphs, neither of which survives that.
        return "DeepSpeed ZeRO-3 shards the parameters (use ZeRO-2 or DDP for engine rollouts)"
    return None


def _fusable_qk_norms(attn: nn.Module, dtype: torch.dtype, head_dim: int) -> tuple | None:
    """The q/k norms' weights and eps when a fused kernel may apply them with the same bits."""
    from jetrl_trainer.quant.fused import FusedRMSNorm

    norms = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if not all(isinstance(n, FusedRMSNorm) for n in norms):
        return None
    if any(n.weight.dtype != dtype or tuple(n.weight.shape) != (head_dim,) for n in norms):
        return None
    return norms[0].weight, norms[1].weight, norms[0].variance_epsilon, norms[1].variance_epsilon


def is_gated_mlp(mlp: nn.Module) -> bool:
    """An MLP whose forward is ``down(act(gate(x)) * up(x))`` (HF's Llama/Qwen MLPs, FusedSwiGLUMLP)."""
    from jetrl_trainer.quant.fused import FusedSwiGLUMLP

    return isinstance(mlp, FusedSwiGLUMLP) or type(mlp).__name__ in ("LlamaMLP", "Qwen2MLP", "Qwen3MLP")


def _modeling_rope(module_name: str) -> Callable:
    """``module_name``'s ``apply_rotary_pos_emb`` now, not when the view was built: `ExactOps` replaces it
    by its fused wrapper when first entered (`jetrl_trainer.exact.fused_modules`), and the training
    forward's attention modules read it at each call, so a decode must too or the phases compute apart."""
    return sys.modules[module_name].apply_rotary_pos_emb


@dataclass
class DecoderView:
    """The pieces of one model the engine calls, and the shapes it needs to size its cache."""

    model: nn.Module  # the transformers CausalLM (under any peft / DDP wrapper): prefill runs its forward
    embed: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    rotary: nn.Module
    lm_head: nn.Module
    rope_module: str  # the modeling module whose ``apply_rotary_pos_emb`` `apply_rope` calls
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    dtype: torch.dtype
    device: torch.device
    # Per layer: (q weight, k weight, q eps, k eps) when the decode kernels may apply the q/k norms
    # inside RoPE (both are FusedRMSNorm, whose bits that launch reproduces), else None.
    qk_norms: list = field(default_factory=list)
    # Per layer: q/k/v and gate/up as one FP8 decode launch each where they can (projections.py).
    qkv_groups: list = field(default_factory=list)
    mlp_groups: list = field(default_factory=list)
    # Per layer: o_proj, and down_proj of a FusedSwiGLUMLP, as groups of one (their split sums can feed
    # the fused residual add + RMSNorm).
    o_groups: list = field(default_factory=list)
    down_groups: list = field(default_factory=list)

    @classmethod
    def from_model(cls, model: nn.Module) -> DecoderView:
        reason = unsupported_model_reason(model)
        if reason is not None:
            raise ValueError(f"the decode engine cannot run this model: {reason}.")
        base = _base_model(model)
        inner, config = base.model, base.config
        attn = inner.layers[0].self_attn
        embed = inner.embed_tokens
        return cls(
            model=base, embed=embed, layers=list(inner.layers), norm=inner.norm, rotary=inner.rotary_emb,
            lm_head=base.lm_head,
            rope_module=type(attn).__module__,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=attn.head_dim,
            scaling=attn.scaling, dtype=embed.weight.dtype, device=embed.weight.device,
            qk_norms=[_fusable_qk_norms(layer.self_attn, embed.weight.dtype, attn.head_dim) for layer in inner.layers],
            qkv_groups=[GroupedProjection.of([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                                              max_rows=QKV_MAX_ROWS) for layer in inner.layers],
            mlp_groups=[GroupedProjection.of([layer.mlp.gate_proj, layer.mlp.up_proj]) if is_gated_mlp(layer.mlp)
                        else None for layer in inner.layers],
            o_groups=[GroupedProjection.of([layer.self_attn.o_proj]) for layer in inner.layers],
            down_groups=[GroupedProjection.of([layer.mlp.down_proj]) if hasattr(layer.mlp, "activation") else None
                         for layer in inner.layers],
        )  # fmt: skip

    def apply_rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The modeling module's ``apply_rotary_pos_emb``, as the attention modules call it."""
        return _modeling_rope(self.rope_module)(q, k, cos, sin)

    def logits(self, hidden: Tensor) -> Tensor:
        """FP32 logits of ``hidden`` ``(..., hidden)`` (the LM head is never quantized)."""
        return self.lm_head(hidden).float()
