"""RoPE of the decode token's query and key, and the key/value append to the slot KV cache, in one launch.

Replaces, in the engine's decode step, transformers' eager ``apply_rotary_pos_emb`` (about eight
elementwise launches each for q and k: two products, a slice, a negation, a concatenation, a sum)
and the two indexed cache writes: at decode every one of those launches moves a few kilobytes, so
the step paid launches, not bytes. The values are the same bits as the eager ops (see the jit module).

=====================  ============================================  ==================
operand                shape / layout                                 dtype
=====================  ============================================  ==================
``q``                  [B, H, D], unit stride along D                 bf16 / fp16 / fp32
``k``, ``v``           [B, H_kv, D], unit stride along D              same
``cos``, ``sin``       [B, D] (HF rotary output at each row's position)  same
``k_cache, v_cache``   [S, H_kv, T, D], unit stride along D           same (written)
``slots``, ``positions``  [B] int                                     -
``k_scale, v_scale``   [S, H_kv, T] contiguous, only for FP8 caches   fp32 (written)
output                 rotated ``q`` [B, H, D], contiguous            same
=====================  ============================================  ==================

With FP8 caches (``float8_e4m3fn``, with their scales) the rotated key and the value are stored
quantized, one scale per head vector: ``quantize_fp8_groups(x, group=D)`` of the model-dtype value.

:func:`kv_append` is the append alone, for keys already rotated by the model's own RoPE: the exact
decode's ``KVCache.append`` in one launch, the bytes of its torch ops (``fp8_kv_encode`` for FP8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from jetrl_trainer._choices import FLOAT_DTYPES, check_choice

from ._triton_support import call_op, load_jit

__all__ = ["check_kv_scales", "kv_append", "rope_append", "rope_append_from_partials", "tiles_head_dim"]

_FP8 = torch.float8_e4m3fn


@torch.library.custom_op(
    "jetrl::rope_append", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"), device_types="cuda"
)
def _rope_append_op(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    slots: Tensor, positions: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor],
    q_norm: Optional[Tensor], k_norm: Optional[Tensor], q_eps: float, k_eps: float,
    parts: Optional[Tensor] = None, q_bias: Optional[Tensor] = None, k_bias: Optional[Tensor] = None,
    v_bias: Optional[Tensor] = None,
) -> Tensor:  # fmt: skip
    jit = load_jit("_triton_rope_jit")
    B, H, D = q.shape
    out = torch.empty((B, H, D), dtype=cos.dtype, device=q.device)  # the model dtype (q's, unless partial sums)
    if B == 0:
        return out
    fp8 = k_scale is not None
    caches = (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if fp8 else (k_cache, v_cache)
    scales = (k_scale, v_scale) if fp8 else (out, out)  # unused pointers when not FP8
    norm = q_norm is not None
    # q / k / v as views of a grouped GEMM's partial sums: the splits sit parts.stride(0) apart
    splits = dict(SPLITS=parts.shape[0], HAS_BIAS=q_bias is not None) if parts is not None else {}
    biases = (q_bias, k_bias, v_bias) if q_bias is not None else (out, out, out)  # unused pointers without
    jit.rope_append_kernel[(B, H + k.shape[1])](
        q, k, v, cos, sin, out, *caches, slots, positions, *scales,
        q_norm if norm else out, k_norm if norm else out, q_eps, k_eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        *biases, parts.stride(0) if parts is not None else 0,
        H=H, D=D, KV_FP8=fp8, NORM=norm, LEVELS=D.bit_length() - 2, num_warps=1, enable_fp_fusion=False,
        **splits,
    )  # fmt: skip
    return out


@_rope_append_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slots, positions, k_scale, v_scale, q_norm, k_norm, q_eps, k_eps,
      parts=None, q_bias=None, k_bias=None, v_bias=None):  # fmt: skip
    return q.new_empty(q.shape, dtype=cos.dtype)


def rope_append(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    slots: Tensor, positions: Tensor, *, k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
    qk_norms: Optional[tuple[Tensor, Tensor, float, float]] = None,
) -> Tensor:  # fmt: skip
    """Rotated ``q``; writes rotated ``k`` and ``v`` at ``[slots[b], :, positions[b]]`` of the caches
    (quantized, with their scales, when the caches are FP8).

    ``qk_norms = (q_weight, k_weight, q_eps, k_eps)`` first applies Qwen3's per-head RMSNorms to
    ``q`` and ``k``, as ``rmsnorm_reference`` (what ``quant.fused.FusedRMSNorm`` runs in both phases),
    bit for bit; weights ``[D]`` in the dtype of ``q``."""
    _check_operands(q, k, v, cos, sin, k_cache, v_cache, k_scale, v_scale)
    fp8 = k_cache.dtype == _FP8
    tensors = (q, k, v, cos, sin) if fp8 else (q, k, v, cos, sin, k_cache, v_cache)
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError("q, k, v, cos, sin (and caches not in FP8) must share a dtype.")
    return call_op(_rope_append_op, q, k, v, cos, sin, k_cache, v_cache, slots, positions, k_scale, v_scale,
                   *_norm_args(qk_norms, q.shape[2], q.dtype))  # fmt: skip


def rope_append_from_partials(
    parts: Tensor, heads: int, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
    positions: Tensor, *, biases: Optional[Sequence[Tensor]] = None, k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None, qk_norms: Optional[tuple[Tensor, Tensor, float, float]] = None,
) -> Tensor:  # fmt: skip
    """:func:`rope_append` of q/k/v given as the FP32 partial sums ``[S, B, (heads + 2 H_kv) · D]`` of
    their grouped decode GEMM (``triton_decode_gemm.fp8_decode_gemm_grouped_partials``), with the
    projections' ``biases`` (q, k, v; model dtype) or none: the split-K reduction runs in this launch
    instead of one of its own. The splits are added in order, the bias added and the sum rounded to
    the model dtype (``cos``'s) once, as the GEMM's reduction does, so the results are the bits of
    reducing first and calling :func:`rope_append`."""
    D = cos.shape[-1]
    kv_heads = k_cache.shape[1]
    widths = (heads * D, kv_heads * D, kv_heads * D)
    if parts.dim() != 3 or parts.dtype != torch.float32 or not parts.is_contiguous() or parts.shape[2] != sum(widths):
        raise ValueError(f"parts must be contiguous float32 (S, B, {sum(widths)}) for {heads} query and {kv_heads} KV "
                         f"heads of {D}; got {parts.dtype} {tuple(parts.shape)}.")  # fmt: skip
    if parts.shape[0] < 1:
        raise ValueError("parts needs at least one split.")
    q, k, v = partial_views(parts, heads, kv_heads, D)
    if biases is not None:
        biases = list(biases)
        if len(biases) != 3 or any(b.shape != (w,) or b.dtype != cos.dtype or not b.is_contiguous()
                                   for b, w in zip(biases, widths)):
            raise ValueError(f"biases must be three contiguous {cos.dtype} vectors of {widths}.")
    _check_operands(q, k, v, cos, sin, k_cache, v_cache, k_scale, v_scale)
    if sin.dtype != cos.dtype or (k_cache.dtype != _FP8 and k_cache.dtype != cos.dtype):
        raise ValueError("cos, sin (and caches not in FP8) must share the model dtype.")
    return call_op(_rope_append_op, q, k, v, cos, sin, k_cache, v_cache, slots, positions, k_scale, v_scale,
                   *_norm_args(qk_norms, D, cos.dtype), parts, *(biases or (None, None, None)))  # fmt: skip


@torch.library.custom_op(
    "jetrl::kv_append", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"), device_types="cuda"
)
def _kv_append_op(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor,
    k_scale: Optional[Tensor], v_scale: Optional[Tensor],
) -> None:  # fmt: skip
    B, H_kv, D = k.shape
    if B == 0:
        return
    jit = load_jit("_triton_rope_jit")
    fp8 = k_scale is not None
    caches = (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if fp8 else (k_cache, v_cache)
    scales = (k_scale, v_scale) if fp8 else (lengths, lengths)  # unused pointers when not FP8
    # One head vector per program, as rope_append: one warp, and no FMA contraction of the scale rule
    jit.kv_append_kernel[(B, H_kv)](
        k, v, *caches, slots, lengths, *scales, slots.stride(0), lengths.stride(0), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        D=D, KV_FP8=fp8, num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip


@_kv_append_op.register_fake
def _(k, v, k_cache, v_cache, slots, lengths, k_scale, v_scale):
    return None


def kv_append(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor, *,
    k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
) -> None:  # fmt: skip
    """Writes ``k`` and ``v`` ``[B, H_kv, D]`` (keys already rotated) at ``[slots[b], :, lengths[slots[b]]]``
    of the caches ``[S, H_kv, T, D]``, ``lengths`` ``[S]`` (a ``KVCache``'s, read on the device and left
    as they are): ``KVCache.append`` in one launch. FP8 caches get ``fp8_kv_encode``'s codes and scales;
    other caches the values themselves, widened where the cache's dtype is wider (the prefill's
    promoted dtype). The caller keeps each position below ``T``, as the engine sizes its cache."""
    _check_append_operands(k, v, k_cache, v_cache, slots, lengths, k_scale, v_scale)
    call_op(_kv_append_op, k, v, k_cache, v_cache, slots, lengths, k_scale, v_scale)


def partial_views(parts: Tensor, heads: int, kv_heads: int, D: int) -> tuple[Tensor, Tensor, Tensor]:
    """Split 0 of grouped q/k/v partial sums as ``(B, heads, D)`` and two ``(B, kv_heads, D)`` views: the
    kernel reads split ``s`` at ``s * parts.stride(0)`` past each."""
    widths = (heads * D, kv_heads * D, kv_heads * D)
    return tuple(t.unflatten(-1, (-1, D)) for t in parts[0].split(widths, dim=-1))


def _check_operands(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                    k_scale: Optional[Tensor], v_scale: Optional[Tensor]) -> None:  # fmt: skip
    B, H, D = q.shape
    if q.device.type != "cuda":
        raise ValueError("rope_append is a CUDA kernel; on CPU the engine runs the model's own apply_rotary_pos_emb.")
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != D:
        raise ValueError(f"need q (B, H, D), k / v (B, H_kv, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}.")  # fmt: skip
    if cos.shape != (B, D) or sin.shape != (B, D):
        raise ValueError(f"cos / sin must be (B, D) = {(B, D)}; got {tuple(cos.shape)}, {tuple(sin.shape)}.")
    if any(t.stride(-1) != 1 for t in (q, cos, sin)):
        raise ValueError("q, cos and sin need unit stride along head_dim.")
    _check_kv_layout(k, v, k_cache, v_cache, k_scale, v_scale)


def _check_append_operands(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor,
                           k_scale: Optional[Tensor], v_scale: Optional[Tensor]) -> None:  # fmt: skip
    if any(t.device.type != "cuda" for t in (k, v, k_cache, v_cache, slots, lengths)):
        raise ValueError("kv_append is a CUDA kernel; on CPU KVCache.append writes with torch ops.")
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be (B, H_kv, D); got {tuple(k.shape)}, {tuple(v.shape)}.")
    check_choice("k dtype", k.dtype, FLOAT_DTYPES)
    check_choice("v dtype", v.dtype, FLOAT_DTYPES)
    _check_kv_layout(k, v, k_cache, v_cache, k_scale, v_scale)
    ints = (torch.int32, torch.int64)
    if slots.shape != k.shape[:1] or lengths.shape != k_cache.shape[:1] or slots.dtype not in ints \
            or lengths.dtype not in ints:  # fmt: skip
        raise ValueError(f"slots must be ({k.shape[0]},) and lengths ({k_cache.shape[0]},), int32 or int64; got "
                         f"{tuple(slots.shape)} {slots.dtype}, {tuple(lengths.shape)} {lengths.dtype}.")  # fmt: skip
    if k_cache.dtype != _FP8 and any(torch.promote_types(x.dtype, k_cache.dtype) != k_cache.dtype for x in (k, v)):
        raise ValueError(f"a {k_cache.dtype} cache cannot hold {k.dtype} / {v.dtype} keys / values without rounding "
                         "them; KVCache.append only ever widens (the cache holds the prefill's promoted dtype).")


def tiles_head_dim(d: int) -> bool:
    """Whether the kernels here tile a head_dim of ``d`` (one power-of-two tile of at least 16)."""
    return d >= 16 and not d & (d - 1)


def _check_kv_layout(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Optional[Tensor],
                     v_scale: Optional[Tensor]) -> None:  # fmt: skip
    """k / v ``(B, H_kv, D)`` into caches ``(S, H_kv, T, D)`` of one dtype (scales for FP8), D a power of two >= 16."""
    H_kv, D = k.shape[1:]
    if not tiles_head_dim(D):
        raise ValueError(f"head_dim must be a power of two >= 16 for the kernel; got {D}.")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[1] != H_kv or k_cache.shape[3] != D:
        raise ValueError(f"the caches must both be (S, {H_kv}, T, {D}) for k / v {tuple(k.shape)}; got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}.")  # fmt: skip
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"the caches must share a dtype; got {k_cache.dtype} / {v_cache.dtype}.")
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("k, v and the caches need unit stride along head_dim.")


def _norm_args(qk_norms: Optional[tuple], D: int, dtype: torch.dtype) -> tuple:
    """The op's (q_norm, k_norm, q_eps, k_eps) from ``qk_norms``, checked."""
    q_norm, k_norm, q_eps, k_eps = qk_norms if qk_norms is not None else (None, None, 0.0, 0.0)
    if qk_norms is not None and any(w.shape != (D,) or w.dtype != dtype or not w.is_contiguous() for w in (q_norm, k_norm)):
        raise ValueError(f"qk_norms weights must be contiguous ({D},) in {dtype}; got "
                         f"{tuple(q_norm.shape)} {q_norm.dtype}, {tuple(k_norm.shape)} {k_norm.dtype}.")  # fmt: skip
    return q_norm, k_norm, float(q_eps), float(k_eps)


def check_kv_scales(k_cache: Tensor, v_cache: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor]) -> None:
    """FP8 caches come with contiguous FP32 scales ``(S, H_kv, T)``; other caches with none."""
    fp8 = k_cache.dtype == _FP8
    if (v_cache.dtype == _FP8) != fp8 or (k_scale is not None) != fp8 or (v_scale is not None) != fp8:
        raise ValueError("FP8 KV caches need k_scale and v_scale (and only they do); got caches "
                         f"{k_cache.dtype} / {v_cache.dtype} with scales {k_scale is not None} / {v_scale is not None}.")  # fmt: skip
    if fp8:
        for s in (k_scale, v_scale):
            if s.dtype != torch.float32 or tuple(s.shape) != tuple(k_cache.shape[:3]) or not s.is_contiguous():
                raise ValueError(f"KV scales must be contiguous float32 {tuple(k_cache.shape[:3])}; got {s.dtype} "
                                 f"{tuple(s.shape)}.")  # fmt: skip
