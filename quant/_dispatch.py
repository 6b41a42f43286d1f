"""The one place that picks a fast Triton kernel or the pure-torch reference for FP8 quantization.

The kernel runs when the tensor is on CUDA, ``kernels/triton_quant.py`` imported
(``kernels.optional_module``), Triton works and ``JETRL_DISABLE_TRITON`` is not ``"1"``
(``kernels.triton_enabled()``, read once); otherwise the reference in
:mod:`jetrl_trainer.quant.fp8` runs. Both produce the same bits (kernel tests check). ``settings``
(an FP8 recipe's ``kernels``) is the kernels' launch; the reference ignores it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Optional

import torch

from jetrl_trainer import kernels
from jetrl_trainer.exact.mode import ExactOps
from jetrl_trainer.kernels.settings import QuantKernelSettings
from jetrl_trainer.quant._handoff import take_prequantized
from jetrl_trainer.quant.fp8 import dequantize_fp8_groups, quantize_fp8_blocks, quantize_fp8_groups
from jetrl_trainer.quant.recipe import FP8Recipe

__all__ = ["act_quant_fp8", "decode_gemm_module", "decode_linear_fp8", "requant_transpose_fp8", "transpose_fp8_blocks", "weight_quant_fp8"]

Pair = tuple[torch.Tensor, torch.Tensor]
_requant_memo = threading.local()  # per thread: the autograd engine runs a device's backward on one thread
_REQUANT_MEMO_ENTRIES = 2


def _kernel(name: str, x: torch.Tensor) -> Optional[Callable[..., Pair]]:
    if not x.is_cuda or not kernels.triton_enabled():
        return None
    module = kernels.optional_module("triton_quant")
    return getattr(module, name) if module is not None else None


def act_quant_fp8(
    x2d: torch.Tensor, scale_format: str = "fp32", *, settings: QuantKernelSettings = QuantKernelSettings()
) -> Pair:
    """``x [M, K]`` -> ``(q [M, K] fp8, s [M, ceil(K/128)] fp32)``, 1×128 groups along K.

    A pair already offered by a fused producer (RMSNorm/SwiGLU + quant) is served as is. The Triton
    kernel reads any strides (e.g. ``dY.t()`` for WGrad), so no transposed copy is made for it.
    """
    prequantized = take_prequantized(x2d, scale_format)
    if prequantized is not None:
        return prequantized
    fast = _kernel("act_quant_fp8", x2d)
    if fast is not None:
        return fast(x2d, scale_format=scale_format, settings=settings)
    return quantize_fp8_groups(x2d.contiguous(), 128, scale_format=scale_format)


def decode_gemm_module(x2d: torch.Tensor, max_m: int) -> Optional[ModuleType]:
    """``kernels/triton_decode_gemm`` when it should run on the activation ``x2d [M, K]``: on CUDA
    with the kernel, 1 <= M <= ``max_m`` (a recipe's ``decode_gemm.max_m``), and outside a
    ``use_gemm_backend`` block, nor under `ExactOps`; else None. ``JETRL_GEMM_BACKEND`` picks the general path's backend
    only: it does not turn this kernel off (a rollout's summation order stays that of the kernel)."""
    if not x2d.is_cuda or not kernels.triton_enabled() or kernels.forced_gemm_backend() is not None:
        return None
    if ExactOps.active():  # its split-K order depends on M; linear.py picks a row-invariant product instead
        return None
    module = kernels.optional_module("triton_decode_gemm")
    if module is None or not 0 < x2d.shape[0] <= max_m:
        return None
    return module


def decode_linear_fp8(
    x2d: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: Optional[torch.Tensor], recipe: FP8Recipe,
    out_dtype: torch.dtype, *, prequantized: Optional[Pair] = None,
) -> Optional[torch.Tensor]:  # fmt: skip
    """A decode-sized FP8 linear (M <= ``recipe.decode_gemm.max_m`` rows) through the split-K decode
    kernel, launched with ``recipe.decode_gemm``, or None where the general path (act quant +
    ``fp8_gemm_nt``) must run: off CUDA, without the kernel, for larger M, or inside a
    ``use_gemm_backend`` block. The activation's quantization is ``prequantized`` (the caller's, in
    the recipe's scale format), else the one a fused producer offered, else the act-quant kernel's
    (the same bits)."""
    module = decode_gemm_module(x2d, recipe.decode_gemm.max_m)
    if module is None:
        return None
    if prequantized is None:
        prequantized = act_quant_fp8(x2d, recipe.scale_format, settings=recipe.kernels)  # serves a fused producer's pair
    x_q, x_s = prequantized
    return module.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, bias, out_dtype=out_dtype, settings=recipe.decode_gemm)


def weight_quant_fp8(
    w: torch.Tensor, scale_format: str = "fp32", *, out: Optional[Pair] = None,
    settings: QuantKernelSettings = QuantKernelSettings(),
) -> Pair:  # fmt: skip
    """``w [N, K]`` -> ``(q [N, K] fp8, s_inv [ceil(N/128), ceil(K/128)] fp32)``, 128×128 blocks.

    ``out``: tensors of that layout to write into (and return); where the kernel cannot write them
    (off CUDA, or ``out`` of another layout) the result is fresh and the caller keeps ``out`` as is.
    """
    w = w.contiguous()
    fast = _kernel("weight_quant_fp8", w)
    if fast is not None:
        n, k = w.shape
        out = _fitting(out, w, ((n, k), (-(-n // 128), -(-k // 128))))
        return fast(w, scale_format=scale_format, out=out, settings=settings)
    return quantize_fp8_blocks(w, 128, scale_format=scale_format)


def requant_transpose_fp8(
    q: torch.Tensor, s: torch.Tensor, scale_format: str = "fp32", *,
    settings: QuantKernelSettings = QuantKernelSettings(),
) -> Pair:  # fmt: skip
    """The WGrad operand: ``(q [M, K], s [M, ceil(K/128)])`` -> ``(qt [K, M], st [K, ceil(M/128)])``,
    i.e. the dequantized tensor transposed and re-quantized in 1×128 groups along M.

    Layers that share an input (q/k/v, gate/up) save the same ``(q, s)`` pair, handed over by the fused
    norm, so the result is kept while ``q`` lives and served again: one launch instead of three (or
    two) per layer in backward. Keyed by storage, layout and version, as the hand-off is (not by
    ``settings``: they change no bit)."""
    memo = _requant_table()
    key = (q.data_ptr(), s.data_ptr(), scale_format)
    entry = memo.get(key) if memo is not None else None
    if entry is not None:
        ref, version, layout, pair = entry
        if ref() is not None and q._version == version and layout == _layout(q, s):
            return pair
    fast = _kernel("requant_transpose_fp8", q)
    if fast is not None:
        pair = fast(q, s, scale_format=scale_format, settings=settings)
    else:
        pair = quantize_fp8_groups(dequantize_fp8_groups(q, s).t().contiguous(), 128, scale_format=scale_format)
    if memo is not None:
        # The entry dies with q (autograd frees it after the last layer that saved it), so q's storage is
        # never reused while the entry exists. The siblings' backwards run one after another, so the few
        # newest entries are enough; the bound keeps a retained graph (backward(retain_graph=True), where
        # q outlives the backward) from holding every layer's operand.
        ref = weakref.ref(q, lambda _r, key=key, memo=memo: memo.pop(key, None))
        memo[key] = (ref, q._version, _layout(q, s), pair)
        while len(memo) > _REQUANT_MEMO_ENTRIES:
            memo.pop(next(iter(memo)), None)  # the oldest
    return pair


def _requant_table() -> Optional[dict]:
    if torch.compiler.is_compiling():  # a side table of data pointers: not traceable, and not needed in a graph
        return None
    if not hasattr(_requant_memo, "table"):
        _requant_memo.table = {}
    return _requant_memo.table


def _layout(q: torch.Tensor, s: torch.Tensor) -> tuple:
    return q.shape, q.stride(), q.dtype, s.shape, s.stride(), s._version


def transpose_fp8_blocks(
    q: torch.Tensor, s_inv: torch.Tensor, *, out: Optional[Pair] = None,
    settings: QuantKernelSettings = QuantKernelSettings(),
) -> Pair:  # fmt: skip
    """The DGrad operand: the same FP8 weight transposed with its block-scale grid, no re-quantization
    (``out`` as in `weight_quant_fp8`)."""
    fast = _kernel("transpose_fp8_blocks", q)
    if fast is not None:
        shapes = ((q.shape[1], q.shape[0]), (s_inv.shape[1], s_inv.shape[0]))
        return fast(q, s_inv, out=_fitting(out, q, shapes), settings=settings)
    return q.t().contiguous(), s_inv.t().contiguous()


def _fitting(out: Optional[Pair], like: torch.Tensor, shapes) -> Optional[Pair]:
    """``out`` if the kernel can write the pair of ``shapes`` into it (its own check), else None."""
    if out is None:
        return None
    return out if _kernel("out_layout_error", like)(out, like, shapes) is None else None
