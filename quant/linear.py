"""``QuantLinear``: an ``nn.Linear`` whose GEMMs run in the recipe of its precision phase.

One module serves both phases of a GRPO step (docs/architecture.md): ``forward`` runs the recipe
of the module's own ``.phase``, ``"train"`` until a
:class:`~jetrl_trainer.quant.phase.PrecisionPhases` block switches it. Equal recipes give the
unified precision flow (rollout = a subgraph of the training forward); ``train=bf16, rollout=fp8``
gives the common baseline. No weights are copied: ``.weight`` / ``.bias`` are the original
Parameters, ``state_dict()`` is unchanged.

One ``torch.autograd.Function`` per quantized op:

* :class:`_FP8LinearFunction` — fwd ``Y = X_q ⊗ W_q``; dgrad with the same FP8 weight transposed
  (cached beside ``W_q``, see below); wgrad with the saved FP8 activation re-quantized along tokens.
  Saves FP8 + FP32 scales only.
* :class:`_NVFP4LinearFunction` — emulated NVFP4 forward (dequantize to FP32, matmul), backward
  ``dequantized`` or ``high_precision``.

Weight quantization is cached per parameter version: the rollout and the training forward of one
optimizer step use bit-identical quantized weights, recomputed once after the weights change. The
cache key combines ``param._version``, ``data_ptr`` and the module's own generation, which only
:func:`invalidate_weight_caches` bumps. An optimizer step does not always bump ``_version`` (fused
optimizers; DeepSpeed writes back through ``.data``), so whoever steps the optimizer registers
:class:`~jetrl_trainer.quant.refresh.WeightCacheRefresh` on it (``JetGRPOTrainer`` does), and code
that mutates ``param.data`` directly (e.g. merging LoRA weights) calls
:func:`invalidate_weight_caches` after. A refresh writes into the cached tensors in place (same
shapes), so a CUDA graph captured on them (the decode engine's) replays the updated weights; on
CUDA the quant kernels write there directly (the CPU reference computes fresh tensors, copied over
them).

DGrad's operand, the FP8 weight transposed with its block-scale grid (exact: no re-quantization),
is cached the same way (``cache_transposed_weight``, on by default): one transpose per optimizer
step instead of one per backward, for about as many bytes again as the FP8 weight (a quarter of the
BF16 weight), held only once a training forward ran. It is off under ZeRO-3 (below), where it would
double the unsharded copies, and inside ``torch.compile`` (transposed in the graph instead).

Under DeepSpeed ZeRO-3 (a weight with ``ds_id``) the key is the generation and ``ds_id`` only:
every forward sees a freshly all-gathered ``.data`` (new storage, no ``_version`` bump) and the
partitions change only in the optimizer step, after which ``WeightCacheRefresh`` bumps the
generation (without one, the cache is never refreshed under ZeRO-3). So a gathered weight is
quantized once per optimizer step, at the price of keeping every layer's quantized weight (FP8:
about half the BF16 bytes, unsharded) on each rank between forwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from jetrl_trainer._choices import FLOAT_DTYPES, check_choice
from jetrl_trainer.exact.mode import ExactOps
from jetrl_trainer.kernels import available_gemm_backends, fp8_gemm_nt, forced_gemm_backend
from jetrl_trainer.quant._dispatch import (
    act_quant_fp8,
    decode_linear_fp8,
    requant_transpose_fp8,
    transpose_fp8_blocks,
    weight_quant_fp8,
)
from jetrl_trainer.quant.nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from jetrl_trainer.quant.phase import PHASES, PhaseAware
from jetrl_trainer.quant.recipe import FP8Recipe, NVFP4Recipe, Recipe, RecipeLike, get_recipe
from jetrl_trainer.quant.stats import record_gemm

__all__ = ["QuantLinear", "invalidate_weight_caches"]



def invalidate_weight_caches(model: nn.Module) -> None:
    """Mark the quantized weights of every ``QuantLinear`` in ``model`` out of date: each re-quantizes
    (into its cached tensors, in place) on its next forward. Call it after changing weights in a way
    that bumps no ``_version`` (``param.data`` edits, a LoRA merge); for optimizer steps register
    :class:`~jetrl_trainer.quant.refresh.WeightCacheRefresh` instead."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module._weight_generation += 1


def _needs_autograd(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _add_bias(y32: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    # The bias is added to the FP32 GEMM result, then rounded once to the output dtype.
    return (y32 + bias.float()).to(out_dtype) if bias is not None else y32.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------------


def _exact_backend(x2d: torch.Tensor) -> str:
    """The FP8 product under ExactOps, whose rows do not depend on M (the backward keeps the fast one):
    on CUDA the Triton GEMM (one 128-wide K group per tile step whatever its tiles, the same
    instructions for every row; tests/exact/ checks its rows), elsewhere the emulated one (exact group
    sums). Never the decode GEMM, whose split-K plan depends on M."""
    if x2d.is_cuda and "triton" in available_gemm_backends(x2d.device):
        return "triton"
    return "emulated"


def _fp8_forward(x2d, w_q, w_s, bias, recipe: FP8Recipe, out_dtype: torch.dtype, x_fp8=None):
    # Y [M, N] = X_q [M, K] (1x128 groups along K) ⊗ W_q [N, K] (128x128 blocks), FP32 accumulation
    x_q, x_s = x_fp8 if x_fp8 is not None else act_quant_fp8(x2d, recipe.scale_format, settings=recipe.kernels)
    gemm_dtype = torch.float32 if bias is not None else out_dtype
    backend = _exact_backend(x2d) if ExactOps.active() else None
    y = fp8_gemm_nt((x_q, x_s), (w_q, w_s), b_granularity="block", out_dtype=gemm_dtype, backend=backend)
    return _add_bias(y, bias, out_dtype), x_q, x_s


class _FP8LinearFunction(torch.autograd.Function):
    """FP8 linear with FP8 dgrad/wgrad; saves ``(X_q, X_s)`` and dgrad's weight, ``(W_qᵀ, W_sinvᵀ)``
    when the transposed cache gave it, else ``(W_q, W_sinv)``; never X. Every quant kernel of both
    passes launches with the recipe's ``kernels``."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, w_q, w_s, wt_q, wt_s, recipe, out_dtype):
        # (wt_q, wt_s): the cached transposed weight for dgrad, or None (transposed in backward).
        y, x_q, x_s = _fp8_forward(x2d, w_q, w_s, bias, recipe, out_dtype)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.transposed = wt_q is not None
        dgrad_w = (wt_q, wt_s) if ctx.transposed else (w_q, w_s)
        ctx.save_for_backward(
            x_q if need_dw else None, x_s if need_dw else None, *(dgrad_w if need_dx else (None, None))
        )
        ctx.recipe = recipe
        ctx.gemm_backend = forced_gemm_backend()  # autograd may run backward on another thread
        ctx.x_dtype, ctx.w_dtype = x2d.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_q, x_s, w_q, w_s = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy = dy.contiguous()  # [M, N], the output dtype (BF16 between operators)
        fmt, settings = ctx.recipe.scale_format, ctx.recipe.kernels
        dx = dw = db = None
        if need_dx:
            # grad_input: dX [M, K] = dY_q [M, N] (1x128 along N) ⊗ W_qᵀ [K, N] (128x128 blocks)
            dy_q, dy_s = act_quant_fp8(dy, fmt, settings=settings)
            wt_q, wt_s = (w_q, w_s) if ctx.transposed else transpose_fp8_blocks(w_q, w_s, settings=settings)
            dx = fp8_gemm_nt(
                (dy_q, dy_s), (wt_q, wt_s), b_granularity="block", out_dtype=ctx.x_dtype, backend=ctx.gemm_backend
            )
        if need_dw:
            # grad_weight: dW [N, K] = dYᵀ_q [N, M] (1x128 along M) ⊗ X_q'ᵀ [K, M] (1x128 along M)
            dyt_q, dyt_s = act_quant_fp8(dy.t(), fmt, settings=settings)
            xt_q, xt_s = requant_transpose_fp8(x_q, x_s, fmt, settings=settings)
            dw = fp8_gemm_nt(
                (dyt_q, dyt_s), (xt_q, xt_s), b_granularity="group", out_dtype=ctx.w_dtype, backend=ctx.gemm_backend
            )
        if need_db:
            db = dy.sum(dim=0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# NVFP4 (emulated)
# ---------------------------------------------------------------------------------------------


def _nvfp4_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32 ``a @ b`` with autocast off (it would turn the emulation into a BF16 GEMM)."""
    with torch.autocast(device_type=a.device.type, enabled=False):
        return a.float() @ b.float()


def _nvfp4_forward(x2d, w_t: NVFP4Tensor, bias, four_over_six: bool, out_dtype: torch.dtype):
    # Y [M, N] = deq(X_q) [M, K] (1x16 blocks, per-token outer) @ deq(W_q)ᵀ [K, N] (per-tensor outer)
    x_t = quantize_nvfp4(x2d, outer="token", four_over_six=four_over_six)
    y = _nvfp4_matmul(dequantize_nvfp4(x_t), dequantize_nvfp4(w_t).t())
    return _add_bias(y, bias, out_dtype), x_t


class _NVFP4LinearFunction(torch.autograd.Function):
    """Emulated NVFP4 linear. ``dequantized`` backward saves the NVFP4 operands (4-bit codes + scales);
    ``high_precision`` saves X and W as given."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, w_data, w_bscale, w_outer, four_over_six, backward, out_dtype):
        w_t = NVFP4Tensor(w_data, w_bscale, w_outer, tuple(weight.shape))
        y, x_t = _nvfp4_forward(x2d, w_t, bias, four_over_six, out_dtype)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if backward == "dequantized":
            x_saved = x_t.tensors() if need_dw else (None, None, None)
            w_saved = w_t.tensors() if need_dx else (None, None, None)
        else:
            x_saved = (x2d if need_dw else None, None, None)
            w_saved = (weight if need_dx else None, None, None)
        ctx.save_for_backward(*x_saved, *w_saved)
        ctx.backward_mode = backward
        ctx.x_shape, ctx.w_shape = tuple(x2d.shape), tuple(weight.shape)
        ctx.x_dtype, ctx.w_dtype = x2d.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        xd, xb, xo, wd, wb, wo = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if ctx.backward_mode == "dequantized":
            x_op = dequantize_nvfp4(NVFP4Tensor(xd, xb, xo, ctx.x_shape)) if need_dw else None
            w_op = dequantize_nvfp4(NVFP4Tensor(wd, wb, wo, ctx.w_shape)) if need_dx else None
        else:  # high precision: the operands as they came in (BF16 normally)
            x_op, w_op = xd, wd
        if need_dx:
            # grad_input: dX [M, K] = dY [M, N] @ W_op [N, K]
            dx = _nvfp4_matmul(dy, w_op).to(ctx.x_dtype)
        if need_dw:
            # grad_weight: dW [N, K] = dYᵀ [N, M] @ X_op [M, K]
            dw = _nvfp4_matmul(dy.t(), x_op).to(ctx.w_dtype)
        if need_db:
            db = dy.sum(dim=0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------


def _weight_quant_key(recipe: Recipe) -> tuple:
    # Recipes that differ only in their backward share one quantized weight.
    if isinstance(recipe, FP8Recipe):
        return ("fp8", recipe.scale_format)
    return ("nvfp4", recipe.four_over_six)


def _same_layout(old: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...]) -> bool:
    return len(old) == len(new) and all(
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()
        for a, b in zip(old, new)
    )


def _cached(cache: dict, key: tuple, state: Optional[tuple], compute) -> tuple[tuple[torch.Tensor, ...], int]:
    """``cache[key]`` if it was computed for ``state``, else ``compute(stale)`` stored there; and 1 on a miss.

    ``compute`` gets the stale tensors (or None) and may write the new values straight into them.
    """
    hit = cache.get(key)
    if state is not None and hit is not None and hit[0] == state:
        return hit[1], 0
    # Normal tensors even inside inference_mode, so a cache filled during a rollout can be
    # saved for backward by the next training step; no autograd graph either way.
    with torch.inference_mode(False), torch.no_grad():
        stale = hit[1] if hit is not None else None
        tensors = tuple(compute(stale))
        if stale is not None and any(a is not b for a, b in zip(tensors, stale)) and _same_layout(stale, tensors):
            # Refresh in place: a CUDA graph captured on these tensors replays the new weights.
            for old, new in zip(stale, tensors):
                old.copy_(new)
            tensors = stale
    if state is not None:
        cache[key] = (state, tensors)
    return tensors, 1


class QuantLinear(PhaseAware, nn.Linear):
    """``nn.Linear`` with one recipe per precision phase (``.recipes = {"train": …, "rollout": …}``).

    Build it with :meth:`from_linear` (shares the Parameters) or through ``quantize_model``. It runs
    the recipe of its ``.phase``, ``"train"`` until a ``PrecisionPhases`` block switches it. Under a
    ``bf16`` recipe ``forward`` is exactly ``F.linear(x, weight, bias)``. Otherwise: input
    ``[*, K]`` in FP32/BF16/FP16, output in the input's dtype (the autocast dtype under autocast),
    bias added in FP32 after the GEMM, gradients in the dtype of what they belong to.

    Training it outside ``JetGRPOTrainer``: register ``WeightCacheRefresh(model, optimizer)``
    (``jetrl_trainer.quant``) once. Without it, after an optimizer step that bumps no ``_version``
    (fused optimizers, DeepSpeed), forwards keep using the weight quantized before the step.

    ``weight_quantizations`` counts how many times this layer quantized its weight (cache misses);
    ``weight_transposes`` how many times it refreshed the cached transposed FP8 weight of dgrad.
    ``cache_transposed_weight = False`` (per module or on the class) transposes in every backward
    instead, saving that cache's memory.
    """

    recipes: dict[str, Recipe]
    weight_quantizations: int
    weight_transposes: int
    cache_transposed_weight: bool = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipes: Mapping[str, RecipeLike]) -> QuantLinear:
        """Wrap ``linear``'s own ``weight`` / ``bias`` Parameters (no copy, no re-initialisation)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"expected an nn.Linear; got {type(linear).__name__}.")
        shape = tuple(getattr(linear.weight, "ds_shape", linear.weight.shape))  # a ZeRO-3 shard is 0-size
        if len(shape) != 2:
            raise ValueError(f"Linear weight must be 2-D [out_features, in_features]; got shape {shape}.")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)  # None stays a registered empty slot, as in nn.Linear
        self.train(linear.training)
        self._reset_counters()
        self.set_recipes(**dict(recipes))
        return self

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 *, train: RecipeLike = "fp8", rollout: RecipeLike = "fp8") -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._reset_counters()
        self.set_recipes(train=train, rollout=rollout)

    def _reset_counters(self) -> None:
        self._weight_cache, self._transposed_cache = {}, {}
        self.weight_quantizations = self.weight_transposes = 0
        self._weight_generation = 0  # bumped by invalidate_weight_caches

    def set_recipes(self, train: Optional[RecipeLike] = None, rollout: Optional[RecipeLike] = None) -> None:
        """Replace the recipe of one or both phases (names or Recipe instances); clears the weight cache."""
        recipes = dict(getattr(self, "recipes", {}))
        for phase, spec in zip(PHASES, (train, rollout)):
            if spec is not None:
                recipes[phase] = get_recipe(spec)
        missing = [p for p in PHASES if p not in recipes]
        if missing:
            raise ValueError(f"QuantLinear needs a recipe for every phase; missing: {', '.join(missing)}.")
        if any(r.quantized for r in recipes.values()):
            check_choice("the dtype of a quantized weight", self.weight.dtype, FLOAT_DTYPES)
        self.recipes = recipes
        self._weight_cache, self._transposed_cache = {}, {}

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding the same Parameters (the inverse of :meth:`from_linear`)."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight = self.weight
        linear.register_parameter("bias", self.bias)
        linear.train(self.training)
        return linear

    def __getstate__(self) -> dict:
        # deepcopy / pickle (e.g. a reference-model copy) must not carry quantized weights along.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "_weight_cache": {}, "_transposed_cache": {}}

    def extra_repr(self) -> str:
        recipes = f"train={self.recipes['train']}, rollout={self.recipes['rollout']}"
        return f"{super().extra_repr()}, {recipes}, phase={self.phase}"

    # -- weight cache ---------------------------------------------------------------------------

    def _state_key(self) -> Optional[tuple]:
        w = self.weight
        ds_id = getattr(w, "ds_id", None)
        if ds_id is not None:  # ZeRO-3: storage and data_ptr change at every gather; values only per step
            return (self._weight_generation, "zero3", ds_id, w.dtype, w.device, tuple(getattr(w, "ds_shape", w.shape)))
        try:
            version = w._version
        except RuntimeError:  # an inference tensor has no version counter: never cache it
            return None
        return (self._weight_generation, version, w.data_ptr(), w.dtype, w.device, tuple(w.shape))

    def _quantize_weight(self, recipe: Recipe, out: Optional[tuple[torch.Tensor, ...]] = None) -> tuple[torch.Tensor, ...]:
        w = self.weight.detach()
        if isinstance(recipe, FP8Recipe):
            # Into ``out`` (the stale cache) where the kernel can: no fresh copy to copy over it.
            return weight_quant_fp8(w, recipe.scale_format, out=out, settings=recipe.kernels)
        return quantize_nvfp4(w, outer="tensor", four_over_six=recipe.four_over_six).tensors()

    def quantized_weight(self, recipe: Recipe) -> tuple[torch.Tensor, ...]:
        """The quantized weight for ``recipe`` (FP8: ``(q, s_inv)``; NVFP4: ``(data, block_scale, outer)``)."""
        shape = tuple(self.weight.shape)
        if shape != (self.out_features, self.in_features):
            # A ZeRO-3 shard outside its gather is a 0-size tensor: never quantize (or serve) that.
            raise ValueError(
                f"QuantLinear weight has shape {shape}, expected {(self.out_features, self.in_features)}. Under "
                "DeepSpeed ZeRO-3 run the forward inside the parameter gather (the engine's hooks or "
                "deepspeed.zero.GatheredParameters), never on the local shard."
            )
        if torch.compiler.is_compiling():
            # Traced (a captured actor update): quantize inside the graph, once per call. The cache's
            # key compares data pointers, which dynamo cannot trace; the bits are the same.
            return self._quantize_weight(recipe)
        tensors, missed = _cached(self._weight_cache, _weight_quant_key(recipe), self._state_key(),
                                  lambda stale: self._quantize_weight(recipe, stale))  # fmt: skip
        self.weight_quantizations += missed
        return tensors

    def cached_weight_tensors(self) -> list[torch.Tensor]:
        """Every quantized-weight tensor cached for the forward (what a captured CUDA graph reads)."""
        return [t for _, tensors in self._weight_cache.values() for t in tensors]

    def transposed_fp8_weight(
        self, recipe: FP8Recipe, weight: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """DGrad's ``(W_qᵀ [K, N], s_invᵀ)``, cached per weight version like :meth:`quantized_weight`
        (``weight``: that method's result, when the caller has it); None where it is not cached
        (``cache_transposed_weight`` off, ZeRO-3, inside ``torch.compile``)."""
        if not self.cache_transposed_weight or torch.compiler.is_compiling():
            return None
        if getattr(self.weight, "ds_id", None) is not None:  # ZeRO-3: see the module docstring
            return None
        state = self._state_key()
        if state is None:
            return None
        w_q, w_s = weight if weight is not None else self.quantized_weight(recipe)
        tensors, missed = _cached(self._transposed_cache, _weight_quant_key(recipe), state,
                                  lambda stale: transpose_fp8_blocks(w_q, w_s, out=stale,
                                                                     settings=recipe.kernels))  # fmt: skip
        self.weight_transposes += missed
        return tensors

    # -- forward --------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_prequantized(x, None, None)

    def forward_prequantized(self, x: torch.Tensor, x_fp8: Optional[tuple[torch.Tensor, torch.Tensor]],
                             scale_format: Optional[str]) -> torch.Tensor:  # fmt: skip
        """``self(x)`` given ``x_fp8``, the 1×128 FP8 quantization ``(q, s)`` of ``x`` in ``scale_format``
        that the launch which wrote ``x`` produced (the decode engine's fused norms, SwiGLU and
        attention): an FP8 recipe in that format without autograd uses it instead of quantizing ``x``
        again (the same bits); anything else ignores it."""
        recipe = self.recipes[self.phase]
        record_gemm(self.phase, recipe.name)
        if not recipe.quantized:
            return F.linear(x, self.weight, self.bias)
        check_choice("QuantLinear input dtype", x.dtype, FLOAT_DTYPES)
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear expects input [*, {self.in_features}]; got shape {tuple(x.shape)}.")
        if torch.is_autocast_enabled(x.device.type):  # match nn.Linear under autocast
            x_fp8 = x_fp8 if x.dtype == torch.get_autocast_dtype(x.device.type) else None
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if not isinstance(recipe, FP8Recipe) or recipe.scale_format != scale_format:
            x_fp8 = None
        x2d = x.reshape(-1, self.in_features)
        y2d = self._forward_2d(x2d, recipe, x_fp8)
        return y2d.reshape(*x.shape[:-1], self.out_features)

    def _forward_2d(self, x2d: torch.Tensor, recipe: Recipe, x_fp8: Optional[tuple] = None) -> torch.Tensor:
        w, b, out_dtype = self.weight, self.bias, x2d.dtype
        tensors = self.quantized_weight(recipe)
        grad = _needs_autograd(x2d, w, b)
        if isinstance(recipe, FP8Recipe):
            w_q, w_s = tensors
            if grad:
                wt = self.transposed_fp8_weight(recipe, tensors) if x2d.requires_grad else None
                wt_q, wt_s = wt if wt is not None else (None, None)
                return _FP8LinearFunction.apply(x2d, w, b, w_q, w_s, wt_q, wt_s, recipe, out_dtype)
            # Decode-sized M (rollouts): the split-K decode GEMM (kernels/triton_decode_gemm.py).
            y = decode_linear_fp8(x2d, w_q, w_s, b, recipe, out_dtype, prequantized=x_fp8)
            if y is not None:
                return y
            return _fp8_forward(x2d, w_q, w_s, b, recipe, out_dtype, x_fp8)[0]
        if not isinstance(recipe, NVFP4Recipe):
            raise ValueError(f"QuantLinear does not know how to run recipe {recipe!r}.")
        if grad:
            return _NVFP4LinearFunction.apply(x2d, w, b, *tensors, recipe.four_over_six, recipe.backward, out_dtype)
        w_t = NVFP4Tensor(*tensors, tuple(w.shape))
        return _nvfp4_forward(x2d, w_t, b, recipe.four_over_six, out_dtype)[0]
