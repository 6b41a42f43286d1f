"""The decode step's layers: a straight loop over the layer plans, one function per stage.

```
h = embed(tokens)
for each layer and its plan:
    x = norm(h)                       (+ the pending residual add, in one launch where the plan fuses it)
    h += attention_block(x)           (q/k/v, RoPE + KV append, attention, o projection)
    x = norm(h)
    h += mlp_block(x)                 (gate/up, activation, down projection)
final_norm(h)
```

Each stage hands the next one what it wrote: an `Activation` with the FP8 pair its launch produced
(the norm's for q/k/v and gate/up, the attention's for o, the SwiGLU's for down), and an o / down
projection's output as split-K sums where the next norm's launch reduces them (`residual.py`). The
plan (`plan.py`) says which launch runs each stage; a launch that cannot run on this step (rows
above decode M, a recipe that is not FP8) falls back to the modules, one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from torch import Tensor, nn

from jetrl_trainer import kernels

from jetrl_trainer.quant.fused import _fp8_format as fp8_format  # the format a QuantLinear quantizes its input in

from .projections import Activation, SplitSums, linear
from .residual import ResidualStream

if TYPE_CHECKING:
    from .architecture import DecoderView
    from .attention import KernelAttention, TorchAttention
    from .plan import DecodePlan, LayerPlan

__all__ = ["decode_hidden_states"]

Attention = Union["TorchAttention", "KernelAttention"]


def decode_hidden_states(view: DecoderView, plan: DecodePlan, input_ids: Tensor, position_ids: Tensor,
                         attention: Attention) -> Tensor:  # fmt: skip
    """The final-norm hidden states ``(B, 1, hidden)`` of one decode step; the layers in HF's order of
    module calls, each as its plan says."""
    residual = ResidualStream(view.embed(input_ids))
    cos, sin = view.rotary(residual.h, position_ids)
    for i, (layer, layer_plan) in enumerate(zip(view.layers, plan.layers)):
        x = residual.norm(layer.input_layernorm, layer_plan.input_norm, fp8_format(layer.self_attn.q_proj))
        residual.add(attention_block(view, i, layer_plan, x, attention, cos, sin))
        x = residual.norm(layer.post_attention_layernorm, layer_plan.post_attention_norm,
                          fp8_format(getattr(layer.mlp, "gate_proj", None)))  # fmt: skip
        residual.add(mlp_block(view, i, layer_plan, x))
    return residual.norm(view.norm, plan.final_norm).x


def attention_block(view: DecoderView, i: int, plan: LayerPlan, x: Activation, attention: Attention, cos: Tensor,
                    sin: Tensor) -> Tensor | SplitSums:  # fmt: skip
    """Layer ``i``'s attention output projected by o (``(B, 1, hidden)``, or its split sums for the next norm)."""
    out = None
    if plan.qkv_sums_to_rope:
        sums = view.qkv_groups[i].split_sums(x)
        if sums is not None:
            out = attention.attend_sums(i, plan, sums, cos, sin)
    if out is None:
        out = attention.attend(i, plan, *qkv_projections(view, i, plan, x), cos, sin)
    if plan.o_sums_to_norm:
        sums = view.o_groups[i].split_sums(out)
        if sums is not None:
            return sums
    return linear(view.layers[i].self_attn.o_proj, out)


def qkv_projections(view: DecoderView, i: int, plan: LayerPlan, x: Activation) -> tuple[Tensor, Tensor, Tensor]:
    """q ``(B, 1, H, D)`` and k / v ``(B, 1, H_kv, D)`` before RoPE: one grouped launch where the plan
    and the step allow, else the modules; Qwen3's q/k norms applied unless the RoPE launch applies them."""
    attn = view.layers[i].self_attn
    outs = view.qkv_groups[i](x) if plan.grouped_qkv else None
    if outs is None:
        outs = [linear(attn.q_proj, x), linear(attn.k_proj, x), linear(attn.v_proj, x)]
    q, k, v = (t.view(*t.shape[:-1], -1, view.head_dim) for t in outs)
    if plan.qk_norms == "modules":
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def mlp_block(view: DecoderView, i: int, plan: LayerPlan, x: Activation) -> Tensor | SplitSums:
    """Layer ``i``'s MLP output (``(B, 1, hidden)``, or down's split sums for the next norm)."""
    mlp = view.layers[i].mlp
    if plan.mlp == "module":
        return mlp(x.x)
    gate_up = view.mlp_groups[i](x) if plan.grouped_gate_up else None
    act = gated_activation(mlp, plan, x, gate_up)
    if plan.down_sums_to_norm:
        sums = view.down_groups[i].split_sums(act)
        if sums is not None:
            return sums
    return linear(mlp.down_proj, act)


def gated_activation(mlp: nn.Module, plan: LayerPlan, x: Activation, gate_up: list[Tensor] | None) -> Activation:
    """The down projection's input from the gate/up outputs (``gate_up``; None: the modules compute
    them, in the order of the MLP's own forward): the SwiGLU + FP8-quant launch, or the MLP's activation."""
    if hasattr(mlp, "activation"):  # FusedSwiGLUMLP: gate, up, then the SwiGLU
        gate, up = gate_up if gate_up is not None else (linear(mlp.gate_proj, x), linear(mlp.up_proj, x))
        if plan.mlp == "swiglu_kernel":
            return swiglu(gate, up, fp8_format(mlp.down_proj))
        return Activation(mlp.activation(gate, up))  # without its kernel: the reference
    if gate_up is not None:
        return Activation(mlp.act_fn(gate_up[0]) * gate_up[1])
    return Activation(mlp.act_fn(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x))  # LlamaMLP.forward's order


def swiglu(gate: Tensor, up: Tensor, scale_format: str | None) -> Activation:
    """``silu(gate) * up`` and its 1x128 FP8 quantization in ``scale_format`` (None: down is not FP8, the
    pair is not kept) in one launch (`FusedSwiGLUMLP`'s kernel)."""
    h, q, s = kernels.optional_module("triton_swiglu").swiglu_quant_fp8(
        gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]), scale_format=scale_format or "fp32"
    )  # fmt: skip
    h = h.view(*gate.shape)
    return Activation(h, (q, s), scale_format) if scale_format is not None else Activation(h)
