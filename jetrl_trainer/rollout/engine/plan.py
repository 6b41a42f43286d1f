"""The decode step's per-layer plan: which launches run each layer, decided once when the engine is built.

A `LayerPlan` fixes the structure of one decoder layer's step from the engine's decode path, the
model's modules and the kernels this process has; the step (`layers.py`) is a straight loop over
the plans. What depends on the step itself stays a check at call time: a grouped or split-K launch
runs only at decode M, under an FP8 recipe in the active phase and without autograd (else the
modules run one by one), and q/k/v leave their partial sums only where their launch splits K.

Off the kernels (``decode_path="torch"``) every layer runs the model's modules and SDPA: the
reference the kernel path reproduces.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from jetrl_trainer import kernels

from .architecture import is_gated_mlp

if TYPE_CHECKING:
    from .architecture import DecoderView

__all__ = ["DecodePlan", "LayerPlan", "plan_decode"]


@dataclass(frozen=True)
class LayerPlan:
    """How the decode step runs one decoder layer.

    Parameters:
        input_norm: ``"module"`` (the norm module after a separate residual add), ``"kernel"`` (the
            RMSNorm + FP8-quant launch, its pair handed to q/k/v) or ``"kernel+add"`` (that launch also
            takes the pending residual add, a tensor or the previous projection's split sums).
        grouped_qkv: q/k/v as one grouped FP8 decode launch; False: the modules one by one.
        qkv_sums_to_rope: the grouped q/k/v launch leaves its split-K sums to the RoPE + KV-append
            launch (where it splits K), which reduces them.
        qk_norms: Qwen3's q/k norms: ``"none"`` (the model has none), ``"modules"`` or ``"rope"``
            (inside the RoPE + KV-append launch).
        attention: ``"torch"`` (the model's RoPE, an indexed KV append, SDPA), ``"kernel"`` (the RoPE +
            KV-append and split-KV attention launches) or ``"kernel+fp8"`` (the attention kernel also
            writes the o projection's FP8 activation).
        o_sums_to_norm: the o projection leaves its split-K sums to the post-attention norm's launch.
        post_attention_norm: as ``input_norm``, its pair handed to gate/up.
        grouped_gate_up: gate/up as one grouped FP8 decode launch.
        mlp: ``"module"`` (the MLP's forward), ``"gated"`` (gate/up, then the MLP's own activation,
            then down: the norm's pair or the grouped launch reaches gate/up) or ``"swiglu_kernel"``
            (gate/up, then the SwiGLU + FP8-quant launch, its pair handed to down).
        down_sums_to_norm: the down projection leaves its split-K sums to the next layer's input-norm launch.
    """

    input_norm: str
    grouped_qkv: bool
    qkv_sums_to_rope: bool
    qk_norms: str
    attention: str
    o_sums_to_norm: bool
    post_attention_norm: str
    grouped_gate_up: bool
    mlp: str
    down_sums_to_norm: bool

    def __str__(self) -> str:
        qkv = "grouped+sums_to_rope" if self.qkv_sums_to_rope else "grouped" if self.grouped_qkv else "modules"
        o, down = ("sums_to_norm" if s else "module" for s in (self.o_sums_to_norm, self.down_sums_to_norm))
        gate_up = "grouped" if self.grouped_gate_up else "modules"
        return (f"input_norm={self.input_norm} qkv={qkv} qk_norms={self.qk_norms} attention={self.attention} o={o} "
                f"post_attention_norm={self.post_attention_norm} gate_up={gate_up} mlp={self.mlp} down={down}")


@dataclass(frozen=True)
class DecodePlan:
    """The plan of every layer, and how the final norm runs (``"module"``, ``"kernel"``, ``"kernel+add"``)."""

    layers: tuple[LayerPlan, ...]
    final_norm: str

    def summary(self) -> dict[str, int]:
        """How many layers run each distinct plan (``str(plan)`` -> count), in layer order."""
        return dict(Counter(str(p) for p in self.layers))

    def __str__(self) -> str:
        lines, start = [], 0
        for i, plan in enumerate(self.layers):
            if i + 1 == len(self.layers) or self.layers[i + 1] != plan:
                span = f"layer {start}" if start == i else f"layers {start}-{i}"
                lines.append(f"{span}: {plan}")
                start = i + 1
        return "\n".join([*lines, f"final norm: {self.final_norm}"])


def _kernel_loaded(name: str) -> bool:
    return kernels.triton_enabled() and kernels.optional_module(name) is not None


def _norm_mode(norm: nn.Module | None, on_kernels: bool, takes_add: bool = True) -> str:
    """A `FusedRMSNorm` (``rmsnorm_reference``, the norm kernel's bits) runs as the engine's launch."""
    from jetrl_trainer.quant.fused import FusedRMSNorm

    if not (on_kernels and isinstance(norm, FusedRMSNorm) and _kernel_loaded("triton_norm")):
        return "module"
    return "kernel+add" if takes_add else "kernel"


def _mlp_mode(mlp: nn.Module, on_kernels: bool, norm: str, grouped: bool) -> str:
    """On the kernels a gated MLP runs piece by piece where a launch of the engine's feeds it (the norm
    kernel's FP8 pair, the grouped gate/up launch) or follows gate/up (the SwiGLU kernel)."""
    from jetrl_trainer.quant.fused import FusedSwiGLUMLP

    if not (on_kernels and is_gated_mlp(mlp)):
        return "module"
    if isinstance(mlp, FusedSwiGLUMLP) and _kernel_loaded("triton_swiglu"):
        return "swiglu_kernel"
    return "gated" if grouped or norm != "module" else "module"


def plan_decode(view: DecoderView, on_kernels: bool) -> DecodePlan:
    """Each layer's plan for ``view``'s model; ``on_kernels``: the step runs the Triton kernels
    (``decode_path`` ``"graphs"`` or ``"kernels"``)."""
    # The first norm has no residual add before it to take.
    input_norms = [_norm_mode(layer.input_layernorm, on_kernels, i > 0) for i, layer in enumerate(view.layers)]
    plans = []
    for i, layer in enumerate(view.layers):
        attn = layer.self_attn
        grouped_qkv = on_kernels and view.qkv_groups[i] is not None
        if not hasattr(attn, "q_norm"):
            qk_norms = "none"
        else:
            qk_norms = "rope" if on_kernels and view.qk_norms[i] is not None else "modules"
        post_norm = _norm_mode(layer.post_attention_layernorm, on_kernels)
        o_sums = post_norm == "kernel+add" and view.o_groups[i] is not None
        attention = "torch" if not on_kernels else "kernel+fp8" if o_sums and view.head_dim == 128 else "kernel"
        grouped_gate_up = on_kernels and view.mlp_groups[i] is not None
        next_norm = input_norms[i + 1] if i + 1 < len(view.layers) else "module"
        plans.append(LayerPlan(
            input_norm=input_norms[i], grouped_qkv=grouped_qkv,
            qkv_sums_to_rope=grouped_qkv and qk_norms != "modules",
            qk_norms=qk_norms, attention=attention, o_sums_to_norm=o_sums, post_attention_norm=post_norm,
            grouped_gate_up=grouped_gate_up, mlp=_mlp_mode(layer.mlp, on_kernels, post_norm, grouped_gate_up),
            # after the grouped gate/up launch only: the modules' order otherwise
            down_sums_to_norm=grouped_gate_up and next_norm == "kernel+add" and view.down_groups[i] is not None,
        ))  # fmt: skip
    return DecodePlan(tuple(plans), _norm_mode(view.norm, on_kernels))
