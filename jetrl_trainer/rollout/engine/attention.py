"""Decode attention for the engine over each row's live KV only (prefill is the model's own forward).

`decode_attention` is the pure-torch reference (CPU, and any device without the engine's GPU
kernels). It is GQA-aware: query head ``h`` reads KV head ``h // (H / H_kv)``, as HF's ``repeat_kv``.
The decode step attends through `TorchAttention` (the model's RoPE, an indexed KV append, that
reference) or `KernelAttention` (the RoPE + KV-append launch, then the split-KV kernel); both take
one layer's q/k/v before RoPE and return its output as the o projection's input.

`matched_arithmetic` picks how the Triton decode kernel sums (tile size, tile order) so that it
reproduces the attention kernel torch runs in the training forward (transformers' SDPA call: causal,
no mask, GQA): oldest-first 128-position tiles for cuDNN, newest-first 64-position tiles in flash
attention's exp2 form for flash attention. Each gives that kernel's output on all but a small
fraction of elements, where another order misses far more (`benchmarks/probe_attention_bits.py`;
docs/trainer.md): over 36 random layers the difference decides the unified-flow mismatch.

A padded training batch (transformers passes a 4D mask) lays its tiles from the padded row's
position 0, while the engine's cache holds a row's live positions from slot position 0. The engine
passes each row's pad count (`KVCache.pads`) so that the kernel's tiles fall on the same boundaries
(`probe_engine_mismatch.py --ragged` measures the mismatch with and without them). With several KV
splits (small batches over long caches, where `plan_splits` splits for speed) the partial sums
combine in another order than one pass does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

from jetrl_trainer import kernels
from jetrl_trainer.exact import exact_attention
from jetrl_trainer.exact.ops import exact_attention_over_runs

from .projections import Activation, GroupedSplitSums

if TYPE_CHECKING:
    from jetrl_trainer.kernels.settings import DecodeAttentionSettings

    from .architecture import DecoderView
    from .kv_cache import KVCache
    from .plan import LayerPlan

__all__ = [
    "MATCHED_BACKENDS",
    "DecodeRows",
    "KernelAttention",
    "TorchAttention",
    "arithmetic_note",
    "decode_attention",
    "exact_decode_attention",
    "matched_arithmetic",
    "training_attention_backend",
]

# Decode-kernel options (kernels/triton_decode_attention.decode_attention) per SDPA backend of the
# training forward; any other backend keeps the kernel's defaults. Read-only: a constant, not a setting.
_ARITHMETIC = MappingProxyType({
    SDPBackend.CUDNN_ATTENTION: MappingProxyType(dict(block_n=128, flash_order=False)),
    SDPBackend.FLASH_ATTENTION: MappingProxyType(dict(block_n=64, flash_order=True)),
})
MATCHED_BACKENDS = tuple(_ARITHMETIC)  # the SDPA backends whose order the decode kernel can reproduce


def training_attention_backend(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                               device: torch.device) -> SDPBackend | None:  # fmt: skip
    """The SDPA backend torch picks for a training forward's attention on ``device`` (causal, no mask,
    GQA as transformers passes it), under the backend settings in force now; None where this torch
    does not say (``torch._fused_sdp_choice`` is private API)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    q = torch.empty(1, num_heads, 256, head_dim, dtype=dtype, device=device)
    kv = torch.empty(1, num_kv_heads, 256, head_dim, dtype=dtype, device=device)
    choice = choose(q, kv, kv, is_causal=True, enable_gqa=num_heads != num_kv_heads)
    return next(b for b in SDPBackend.__members__.values() if b.value == choice)


def matched_arithmetic(backend: SDPBackend | None) -> dict:
    """Keyword arguments of the Triton decode kernel that reproduce ``backend``'s sums ({} if unknown)."""
    return dict(_ARITHMETIC.get(backend, {}))


def arithmetic_note(backend: SDPBackend | None) -> tuple[int, str] | None:
    """(logging level, message) telling the user how the decode attention relates to the training
    forward's, or None where there is nothing to say (no CUDA backend, e.g. the CPU path)."""
    if backend is None:
        return None
    if backend in _ARITHMETIC:
        return logging.INFO, (f"jetrl: the engine's decode attention sums in the order of {backend.name}, the attention "
                              "torch runs in the training forward.")  # fmt: skip
    return logging.WARNING, (
        f"jetrl: torch runs {backend.name} for the training forward's attention here, whose order the engine's "
        "decode attention does not reproduce: the unified-flow mismatch will be larger than with a matched "
        "backend (cuDNN or flash attention; torch.backends.cuda.enable_cudnn_sdp / enable_flash_sdp)."
    )


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scaling: float) -> Tensor:
    """One query per row over its first ``lengths[b]`` cached positions.

    q ``(B, H, D)``; k_cache / v_cache ``(B, H_kv, T, D)`` (the rows' slots); returns ``(B, H, D)``.
    Only the live prefix ``T = max(lengths)`` is read. SDPA, as HF's default attention, so the
    reference sums in the order a ``generate`` over the same cache would.
    """
    live = int(lengths.max())
    groups = q.shape[1] // k_cache.shape[1]
    k = k_cache[:, :, :live].repeat_interleave(groups, dim=1)
    v = v_cache[:, :, :live].repeat_interleave(groups, dim=1)
    alive = torch.arange(live, device=q.device)[None, :] < lengths[:, None]  # (B, T)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=alive[:, None, None, :], scale=scaling)
    return out[:, :, 0]


@dataclass(frozen=True)
class DecodeRows:
    """One decode step's rows: their cache slots ``(B,)``, the position each new token takes ``(B, 1)``,
    the live lengths once it is appended ``(B,)``, and (kernel path) the rows' left padding in the
    training forward's batch ``(B,)``."""

    cache: KVCache
    slots: Tensor
    positions: Tensor
    lengths: Tensor
    pads: Optional[Tensor] = None


def exact_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scaling: float) -> Tensor:
    """`decode_attention` computed by `jetrl_trainer.exact.exact_attention`: for each row, the bits the
    training forward's attention gives the same query (its tiles start at the row's first real key,
    which the cache holds at position 0). An FP8 cache's keys and values come dequantized to FP32, as
    the training forward's attention reads them under the exact contract (`kv_cache.fp8_kv_roundtrip`)."""
    live = int(lengths.max())
    valid = torch.arange(live, device=q.device)[None, None, :] < lengths[:, None, None]  # (B, 1, T)
    return exact_attention(q[:, :, None], k_cache[:, :, :live], v_cache[:, :, :live], valid, scaling)[:, :, 0]


class TorchAttention:
    """The reference: the model's RoPE, an indexed KV append and SDPA over each row's live KV
    (``exact``: the exact attention instead: on CUDA its kernel over the cache in place, elsewhere
    `exact_decode_attention` over the rows' live KV read out)."""

    def __init__(self, view: DecoderView, rows: DecodeRows, exact: bool = False) -> None:
        self.view, self.rows, self.exact = view, rows, exact
        self.decode_attention = exact_decode_attention if exact else decode_attention
        # The exact kernel's key runs over the cache (from slot position 0 to the live end), the same for every layer
        self._runs = (torch.zeros_like(rows.lengths), (rows.lengths - 1)[:, None]) if exact else None

    def attend(self, i: int, plan: LayerPlan, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Activation:
        """Layer ``i``'s output ``(B, 1, H * D)`` for q ``(B, 1, H, D)``, k / v ``(B, 1, H_kv, D)`` before
        RoPE and HF's ``cos`` / ``sin`` ``(B, 1, D)``."""
        rows = self.rows
        q, k = self.view.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, H, 1, D)
        rows.cache.append(i, rows.slots, k[:, :, 0], v[:, 0])
        out = self._exact_in_place(i, q) if self.exact else None
        if out is None:
            live = int(rows.lengths.max())
            kv = rows.cache.read(i, rows.slots, live, dtype=torch.float32 if self.exact else None)
            out = self.decode_attention(q[:, :, 0], *kv, rows.lengths, self.view.scaling)
        return Activation(out.reshape(out.shape[0], 1, -1))

    def _exact_in_place(self, i: int, q: Tensor) -> Tensor | None:
        """The exact attention kernel over layer ``i``'s cache in place (CUDA), ``(B, H, D)``; None elsewhere."""
        rows, cache = self.rows, self.rows.cache
        scales = dict(k_scale=cache.k_scale[i], v_scale=cache.v_scale[i]) if cache.fp8 else {}
        out = exact_attention_over_runs(q, cache.k[i], cache.v[i], *self._runs, self.view.scaling, kv_rows=rows.slots,
                                        **scales)  # fmt: skip
        return None if out is None else out[:, :, 0]


class KernelAttention:
    """The RoPE + KV-append launch (with Qwen3's q/k norms where the plan puts them there), then the
    split-KV decode attention kernel over each row's live KV, tiled as the training forward's
    attention (``arithmetic``: `matched_arithmetic`'s keywords) and launched with ``settings``."""

    def __init__(self, view: DecoderView, rows: DecodeRows, arithmetic: dict,
                 settings: DecodeAttentionSettings) -> None:  # fmt: skip
        from jetrl_trainer.kernels import triton_decode_attention

        self.view, self.rows, self.arithmetic, self.settings = view, rows, arithmetic, settings
        self.rope = kernels.optional_module("triton_rope_append")
        self.kernel = triton_decode_attention

    def attend(self, i: int, plan: LayerPlan, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Activation:
        """As `TorchAttention.attend`; q / k come before the q/k norms where the plan applies them here."""
        rows, cache = self.rows, self.rows.cache
        q = self.rope.rope_append(q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], cache.k[i], cache.v[i], rows.slots,
                                  rows.positions[:, 0], qk_norms=self._qk_norms(i, plan), **self._scales(i))  # fmt: skip
        return self._attention(i, plan, q)

    def attend_sums(self, i: int, plan: LayerPlan, sums: GroupedSplitSums, cos: Tensor, sin: Tensor) -> Activation:
        """`attend` of q/k/v given as their grouped launch's split-K sums: the RoPE launch reduces them."""
        rows, cache = self.rows, self.rows.cache
        q = self.rope.rope_append_from_partials(
            sums.parts, self.view.num_heads, cos[:, 0], sin[:, 0], cache.k[i], cache.v[i], rows.slots,
            rows.positions[:, 0], biases=sums.biases, qk_norms=self._qk_norms(i, plan), **self._scales(i),
        )  # fmt: skip
        return self._attention(i, plan, q)

    def _attention(self, i: int, plan: LayerPlan, q: Tensor) -> Activation:
        """The kernel over the rotated ``q`` ``(B, H, D)``; with the plan's ``"kernel+fp8"``, and the o
        projection on an FP8 recipe, it also writes that projection's 1x128 FP8 input (one group a head)."""
        rows, cache = self.rows, self.rows.cache
        fmt = self.view.o_groups[i].input_scale_format() if plan.attention == "kernel+fp8" else None
        # pads: tiles on the training forward's boundaries over the padded rows
        options = dict(self._scales(i), pads=rows.pads, settings=self.settings, **self.arithmetic)
        if fmt is None:
            out = self.kernel.decode_attention(q, cache.k[i], cache.v[i], rows.slots, rows.lengths, self.view.scaling,
                                               **options)  # fmt: skip
            return Activation(out.reshape(out.shape[0], 1, -1))
        out, out_q, out_s = self.kernel.decode_attention(q, cache.k[i], cache.v[i], rows.slots, rows.lengths,
                                                         self.view.scaling, quantize_output=fmt, **options)  # fmt: skip
        return Activation(out.view(out.shape[0], 1, -1), (out_q, out_s), fmt)

    def _qk_norms(self, i: int, plan: LayerPlan) -> Optional[tuple]:
        return self.view.qk_norms[i] if plan.qk_norms == "rope" else None

    def _scales(self, i: int) -> dict:
        cache = self.rows.cache
        return dict(k_scale=cache.k_scale[i], v_scale=cache.v_scale[i]) if cache.fp8 else {}
