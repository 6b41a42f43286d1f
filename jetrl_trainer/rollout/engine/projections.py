"""Projections that share an input, as one FP8 decode GEMM launch: q/k/v, and gate/up.

At decode the FP8 projections are bound by reading their weights, and one alone is too small to
keep every SM streaming (k and v of an 8B model are 4 MB of FP8 each). The engine runs q/k/v in
one launch of the grouped split-K kernel (`kernels/triton_decode_gemm.fp8_decode_gemm_grouped`),
and gate/up in another, on the very FP8 weights each `QuantLinear` caches for the training
forward, with the activation's 1×128 quantization the fused RMSNorm handed over. Per output the
operands and the math are the same as each module's own call; only the K split (the FP32
summation order) may differ, which the engine's contract allows (architecture.py).

Only plain FP8 `QuantLinear`s group (a peft LoRA layer adds adapters the kernel does not, a BF16
recipe has no FP8 weight): anything else, and every call off CUDA or above decode M, returns None
and the modules run one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from jetrl_trainer.quant._dispatch import act_quant_fp8, decode_gemm_module
from jetrl_trainer.quant.linear import QuantLinear
from jetrl_trainer.quant.phase import current_phase
from jetrl_trainer.quant.recipe import FP8Recipe
from jetrl_trainer.quant.stats import record_gemm

__all__ = ["GroupedProjection"]


class GroupedProjection:
    """``[m(x) for m in modules]`` in one launch, or None where that launch cannot run."""

    def __init__(self, modules: Sequence[QuantLinear]) -> None:
        self.modules = list(modules)

    @classmethod
    def of(cls, modules: Sequence[nn.Module]) -> GroupedProjection | None:
        """A group when every module is a `QuantLinear` of one input width with biases all or none."""
        if not all(type(m) is QuantLinear for m in modules):
            return None
        if len({m.in_features for m in modules}) != 1 or len({m.bias is None for m in modules}) != 1:
            return None
        return cls(modules)

    def __call__(self, x: Tensor) -> list[Tensor] | None:
        phase = current_phase()
        recipes = [m.recipes[phase] for m in self.modules]
        if not all(isinstance(r, FP8Recipe) for r in recipes) or len({r.scale_format for r in recipes}) != 1:
            return None
        x2d = x.reshape(-1, x.shape[-1])
        module = decode_gemm_module(x2d)
        if module is None:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in self.modules)):
            return None  # a rollout runs without autograd; a training forward keeps its own path
        pair = act_quant_fp8(x2d, recipes[0].scale_format)  # serves the fused RMSNorm's pair when offered
        weights = [m.quantized_weight(r) for m, r in zip(self.modules, recipes)]
        for r in recipes:
            record_gemm(phase, r.name)
        biases = [m.bias for m in self.modules] if self.modules[0].bias is not None else []
        outs = module.fp8_decode_gemm_grouped(*pair, weights, biases, out_dtype=x.dtype)
        return [y.view(*x.shape[:-1], y.shape[-1]) for y in outs]
