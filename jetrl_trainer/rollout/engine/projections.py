"""Projections that share an input, as one FP8 decode GEMM launch: q/k/v, and gate/up.

At decode the FP8 projections are bound by reading their weights, and one alone is too small to
keep every SM streaming (k and v of an 8B model are 4 MB of FP8 each). The engine runs q/k/v in
one launch of the grouped split-K kernel (`kernels/triton_decode_gemm.fp8_decode_gemm_grouped`),
and gate/up in another, on the very FP8 weights each `QuantLinear` caches for the training
forward. Per output the operands and the math are the same as each module's own call; only the K
split (the FP32 summation order) may differ, which the engine's contract allows (architecture.py).

An `Activation` carries the 1×128 FP8 quantization that the launch which wrote it produced (a fused
RMSNorm, the SwiGLU, the attention kernel): a group or a module (`linear`) uses that pair instead of
quantizing again. The engine hands it over as an argument, from the launch it made to the one it
makes next.

A group of one (the o and down projections) can leave its output as split-K partial sums
(`SplitSums`) for the next RMSNorm to reduce, together with the residual add (`residual.py`); the
q/k/v group can leave its outputs so (`GroupedSplitSums`) for the RoPE + KV-append launch.

A group takes the decode kernel up to ``max_rows`` rows (default: the FP8 recipe's
``decode_gemm.max_m``, where a lone projection is faster through the decode kernel than through
``scaled_mm``). q/k/v go further (`QKV_MAX_ROWS`): their narrow N tiles fill the GPU only together.
The launches take their settings from the modules' FP8 recipe (``recipe.decode_gemm``), as each
module's own call does.

Only plain FP8 `QuantLinear`s group (a peft LoRA layer adds adapters the kernel does not, a BF16
recipe has no FP8 weight): anything else, and every call off CUDA or above decode M, returns None
and the modules run one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from jetrl_trainer.quant._dispatch import act_quant_fp8, decode_gemm_module
from jetrl_trainer.quant.fused import _fp8_format as fp8_input_format
from jetrl_trainer.quant.linear import QuantLinear
from jetrl_trainer.quant.recipe import FP8Recipe
from jetrl_trainer.quant.stats import record_gemm

__all__ = ["QKV_MAX_ROWS", "Activation", "GroupedProjection", "GroupedSplitSums", "SplitSums", "linear"]

# Rows up to which the q/k/v group runs as one decode-kernel launch: measured faster there than
# separate scaled_mm calls, while gate/up, o and down were not above the recipe's decode_gemm.max_m
# (docs/performance.md).
QKV_MAX_ROWS = 256

Pair = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class Activation:
    """An activation ``x`` and, where the launch that wrote it also quantized it, that 1×128 FP8
    quantization ``fp8 = (q [M, K], s [M, K / 128])`` in ``scale_format``."""

    x: Tensor
    fp8: Optional[Pair] = None
    scale_format: Optional[str] = None

    def pair_for(self, scale_format: Optional[str]) -> Optional[Pair]:
        """The FP8 pair if a consumer quantizing in ``scale_format`` can use it, else None."""
        return self.fp8 if self.fp8 is not None and scale_format == self.scale_format else None


def linear(module: nn.Module, x: Activation) -> Tensor:
    """``module(x.x)``; a `QuantLinear` gets ``x``'s FP8 pair, where there is one, instead of quantizing."""
    if x.fp8 is not None and isinstance(module, QuantLinear):
        return module.forward_prequantized(x.x, x.fp8, x.scale_format)
    return module(x.x)


class GroupedProjection:
    """``[m(x) for m in modules]`` in one launch, or None where that launch cannot run."""

    def __init__(self, modules: Sequence[QuantLinear], max_rows: int | None = None) -> None:
        self.modules = list(modules)
        self.max_rows = max_rows  # None: the recipe's decode_gemm.max_m

    @classmethod
    def of(cls, modules: Sequence[nn.Module], max_rows: int | None = None) -> GroupedProjection | None:
        """A group when every module is a `QuantLinear` of one input width with biases all or none."""
        if not all(type(m) is QuantLinear for m in modules):
            return None
        if len({m.in_features for m in modules}) != 1 or len({m.bias is None for m in modules}) != 1:
            return None
        return cls(modules, max_rows)

    def __call__(self, act: Activation) -> list[Tensor] | None:
        x = act.x
        operands = self._operands(act)
        if operands is None:
            return None
        module, pair, weights, settings = operands
        biases = [m.bias for m in self.modules] if self.modules[0].bias is not None else []
        outs = module.fp8_decode_gemm_grouped(*pair, weights, biases, out_dtype=x.dtype, settings=settings)
        return [y.view(*x.shape[:-1], y.shape[-1]) for y in outs]

    def split_sums(self, act: Activation) -> SplitSums | GroupedSplitSums | None:
        """The group's output left as its split-K partial sums, for a consumer that reduces them itself:
        one projection's for the fused residual add + RMSNorm (`residual.py`), q/k/v's for the RoPE +
        KV-append launch (`attention.KernelAttention.attend_sums`); None where the launch cannot run, or for a
        group whose launch does not split K (its outputs come in the model dtype with no reduction
        launch to save, and FP32 sums would only be more bytes to read)."""
        x = act.x
        launch = self._launch(x)
        if launch is None:
            return None
        module, recipe = launch
        x2d = x.reshape(-1, x.shape[-1])
        widths = [m.out_features for m in self.modules]
        if len(self.modules) > 1 and module.planned_splits(x2d.shape[0], widths, x2d.shape[1], x.device,
                                                           recipe.decode_gemm) == 1:  # fmt: skip
            return None
        module, pair, weights, settings = self._operands(act, launch)
        if len(self.modules) > 1:
            parts = module.fp8_decode_gemm_grouped_partials(*pair, weights, settings=settings)
            biases = [m.bias for m in self.modules] if self.modules[0].bias is not None else None
            return GroupedSplitSums(parts, biases)
        parts = module.fp8_decode_gemm_partials(*pair, *weights[0], settings=settings)
        return SplitSums(parts, self.modules[0].bias, (*x.shape[:-1], parts.shape[-1]), x.dtype)

    def _launch(self, x: Tensor) -> tuple | None:
        """(decode-GEMM module, the modules' FP8 recipe) where the group's launch can run on ``x``, else
        None: every module must run one FP8 recipe (scale format and decode-GEMM settings)."""
        recipes = {m.recipes[m.phase] for m in self.modules}
        recipe = recipes.pop() if len(recipes) == 1 else None
        if not isinstance(recipe, FP8Recipe):
            return None
        max_rows = self.max_rows if self.max_rows is not None else recipe.decode_gemm.max_m
        module = decode_gemm_module(x.reshape(-1, x.shape[-1]), max_rows)
        if module is None:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in self.modules)):
            return None  # a rollout runs without autograd; a training forward keeps its own path
        return module, recipe

    def _operands(self, act: Activation, launch: tuple | None = None) -> tuple | None:
        """(decode-GEMM module, the activation's FP8 pair, the FP8 weights, the launch settings), or
        None; ``launch``: what `_launch` already returned for ``act.x``. The pair is the one its
        producer wrote, where it wrote one in the group's scale format, else the act-quant kernel's."""
        x = act.x
        launch = launch if launch is not None else self._launch(x)
        if launch is None:
            return None
        module, recipe = launch
        pair = act.pair_for(recipe.scale_format)
        if pair is None:
            pair = act_quant_fp8(x.reshape(-1, x.shape[-1]), recipe.scale_format, settings=recipe.kernels)
        weights = [m.quantized_weight(recipe) for m in self.modules]
        for m in self.modules:
            record_gemm(m.phase, recipe.name)
        return module, pair, weights, recipe.decode_gemm

    def input_scale_format(self) -> str | None:
        """The FP8 scale format the group quantizes its input with in its phase, or None."""
        return fp8_input_format(self.modules[0])


@dataclass
class SplitSums:
    """A decode GEMM's output as FP32 partial sums ``[S, M, N]`` not yet reduced (plus its bias)."""

    parts: Tensor
    bias: Tensor | None
    shape: tuple[int, ...]  # the output's shape (..., N)
    dtype: torch.dtype  # the output's dtype

    def materialize(self) -> Tensor:
        """The output itself: the splits added in split order in FP32 (+ bias) and rounded once, as the
        GEMM's reduction."""
        acc = self.parts[0].clone()
        for part in self.parts[1:]:
            acc += part
        if self.bias is not None:
            acc += self.bias.float()
        return acc.to(self.dtype).view(self.shape)


@dataclass
class GroupedSplitSums:
    """A grouped decode GEMM's outputs as FP32 partial sums ``[S, M, N_q + N_k + N_v]``, the projections'
    columns side by side, not yet reduced (plus their biases), for the RoPE + KV-append launch."""

    parts: Tensor
    biases: list[Tensor] | None
