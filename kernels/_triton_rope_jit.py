"""``@triton.jit`` RoPE of one decode token and its KV-cache append (imported only when Triton is present).

One program per (row, head) over ``H`` query heads then ``H_kv`` key/value heads. Each op rounds to
the tensor dtype exactly where transformers' eager ``(x * cos) + (rotate_half(x) * sin)`` rounds
(a product of two BF16 values is exact in FP32, so FP32 math rounded once per op is those ops), so
the rotated query and key are the same bits as ``apply_rotary_pos_emb``. ``KV_FP8`` stores key and
value as FP8 with one scale per head vector, quantized from those model-dtype values exactly as
``quantize_fp8_groups(x, group=D)`` (the ``_triton_quant_jit`` functions). ``NORM`` first applies
Qwen3's per-head q/k RMSNorm as ``rmsnorm_reference`` (the ``_triton_fused_jit`` tree).

``kv_append_kernel`` is the append alone, for keys the model's own RoPE already rotated (the exact
decode's ``KVCache.append``): the same stores, so the same bytes as ``fp8_kv_encode`` for an FP8 cache.
"""

import triton
import triton.language as tl

from jetrl_trainer.kernels._triton_fused_jit import rms_divisor_rows
from jetrl_trainer.kernels._triton_quant_jit import _amax, _fp8_bits, _scale_from_amax


@triton.jit
def _head(x_ptr, d, bias_ptr, part_stride, dtype: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Elements ``d`` of one head vector in the model ``dtype``: loaded (``SPLITS`` = 0), or a grouped
    decode GEMM's FP32 partial sums (``part_stride`` apart) added in split order, plus the bias, and
    rounded once: what ``splitk_reduce_kernel`` stores, so the same bits."""
    if SPLITS == 0:
        return tl.load(x_ptr + d)
    acc = tl.load(x_ptr + d)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(x_ptr + s * part_stride + d)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d).to(tl.float32)
    return acc.to(dtype)


@triton.jit
def _rotate(x_ptr, cos, sin, d, HALF: tl.constexpr, norm_w_ptr, eps, NORM: tl.constexpr, LEVELS: tl.constexpr,
            dtype: tl.constexpr, bias_ptr, part_stride, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """RoPE of one head vector (``_head``); with ``NORM``, of its RMSNorm (``rmsnorm_reference`` bits, as
    ``quant.fused.FusedRMSNorm`` computes the per-head q/k norm) instead."""
    partner_d = tl.where(d < HALF, d + HALF, d - HALF)
    x_raw = _head(x_ptr, d, bias_ptr, part_stride, dtype, SPLITS, HAS_BIAS)
    partner_raw = _head(x_ptr, partner_d, bias_ptr, part_stride, dtype, SPLITS, HAS_BIAS)
    if NORM:  # y = w * (x / sqrt(mean(x²) + eps)).to(dtype), rounded to dtype; the partner shares the divisor
        divisor = tl.sum(rms_divisor_rows(tl.reshape(x_raw.to(tl.float32), (1, 2 * HALF)), 2.0 * HALF, eps, LEVELS), 0)
        w = tl.load(norm_w_ptr + d).to(tl.float32)
        w_partner = tl.load(norm_w_ptr + partner_d).to(tl.float32)
        x_raw = (w * tl.math.div_rn(x_raw.to(tl.float32), divisor).to(dtype).to(tl.float32)).to(dtype)
        partner_raw = (w_partner * tl.math.div_rn(partner_raw.to(tl.float32), divisor).to(dtype).to(tl.float32)).to(dtype)
    x = x_raw.to(tl.float32)
    partner = partner_raw.to(tl.float32)
    rotated = tl.where(d < HALF, -partner, partner)  # rotate_half: cat(-x2, x1), exact
    return ((x * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _store_kv(cache_ptr, scale_ptr, x, d, KV_FP8: tl.constexpr):
    """One head vector into the cache; FP8: ``quantize_fp8_groups(x, group=D)`` (``fp8_kv_encode``), the
    scale ``max(amax, 1e-10) * fp32(1/448)``, the codes ``x / scale`` (IEEE division) cast to nearest even."""
    if KV_FP8:  # one group per head vector, as a (1, D) tile so the scale is a (1,) tensor
        xf = x.to(tl.float32)[None, :]
        scale = _scale_from_amax(_amax(xf, 1), False)
        tl.store(cache_ptr + d[None, :], _fp8_bits(xf, scale[:, None]))  # the cache through a uint8 view
        tl.store(scale_ptr + tl.arange(0, 1), scale)
    else:
        tl.store(cache_ptr + d, x)


@triton.jit
def _append_kv(k, v, d, slot, kv, pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
               stride_kcs, stride_kch, stride_kct, stride_vcs, stride_vch, stride_vct, stride_ss, stride_sh,
               KV_FP8: tl.constexpr):  # fmt: skip
    """Key and value head vectors ``kv`` stored at ``(slot, kv, pos)`` of the caches; a value whose dtype
    is narrower than a BF16/FP16/FP32 cache's is widened by the store (exact)."""
    scale_at = slot * stride_ss + kv * stride_sh + pos  # scales: (S, H_kv, T), unit stride along T
    _store_kv(k_cache_ptr + slot * stride_kcs + kv * stride_kch + pos * stride_kct, k_scale_ptr + scale_at, k, d, KV_FP8)
    _store_kv(v_cache_ptr + slot * stride_vcs + kv * stride_vch + pos * stride_vct, v_scale_ptr + scale_at, v, d, KV_FP8)


@triton.jit
def rope_append_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, positions_ptr,
    k_scale_ptr, v_scale_ptr, q_norm_ptr, k_norm_ptr, q_eps, k_eps,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_sb, stride_ob, stride_oh,
    stride_kcs, stride_kch, stride_kct, stride_vcs, stride_vch, stride_vct, stride_ss, stride_sh,
    q_bias_ptr, k_bias_ptr, v_bias_ptr, part_stride,
    H: tl.constexpr, D: tl.constexpr, KV_FP8: tl.constexpr, NORM: tl.constexpr, LEVELS: tl.constexpr,
    SPLITS: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False,
):
    """``SPLITS`` > 0: ``q_ptr`` / ``k_ptr`` / ``v_ptr`` point into a grouped decode GEMM's FP32 partial
    sums (split ``s`` at ``s * part_stride``), reduced here with the biases (``HAS_BIAS``) instead of
    by the GEMM's own reduction launch."""
    dtype = q_out_ptr.dtype.element_ty
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    cos = tl.load(cos_ptr + b * stride_cb + d).to(tl.float32)
    sin = tl.load(sin_ptr + b * stride_sb + d).to(tl.float32)
    if h < H:
        q = _rotate(q_ptr + b * stride_qb + h * stride_qh, cos, sin, d, D // 2, q_norm_ptr, q_eps, NORM, LEVELS, dtype,
                    q_bias_ptr + h * D, part_stride, SPLITS, HAS_BIAS)  # fmt: skip
        tl.store(q_out_ptr + b * stride_ob + h * stride_oh + d, q)
    else:
        kv = h - H
        slot = tl.load(slots_ptr + b).to(tl.int64)
        pos = tl.load(positions_ptr + b).to(tl.int64)
        k = _rotate(k_ptr + b * stride_kb + kv * stride_kh, cos, sin, d, D // 2, k_norm_ptr, k_eps, NORM, LEVELS, dtype,
                    k_bias_ptr + kv * D, part_stride, SPLITS, HAS_BIAS)  # fmt: skip
        v = _head(v_ptr + b * stride_vb + kv * stride_vh, d, v_bias_ptr + kv * D, part_stride, dtype, SPLITS, HAS_BIAS)
        _append_kv(k, v, d, slot, kv, pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                   stride_kcs, stride_kch, stride_kct, stride_vcs, stride_vch, stride_vct, stride_ss, stride_sh, KV_FP8)


@triton.jit
def kv_append_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, lengths_ptr, k_scale_ptr, v_scale_ptr,
    stride_slot, stride_length, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_kcs, stride_kch, stride_kct, stride_vcs, stride_vch, stride_vct, stride_ss, stride_sh,
    D: tl.constexpr, KV_FP8: tl.constexpr,
):
    """The appends of ``rope_append_kernel`` without its RoPE: program (row ``b``, KV head ``h``) stores
    the already-rotated key and the value of that head at position ``lengths[slots[b]]`` of the row's
    slot (``KVCache.append``'s contract; the lengths are read here, so no gather launch precedes)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    # The engine's slots are a column of its step inputs (a strided view): index by stride, not by 1
    slot = tl.load(slots_ptr + b * stride_slot).to(tl.int64)
    pos = tl.load(lengths_ptr + slot * stride_length).to(tl.int64)
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + d)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + d)
    _append_kv(k, v, d, slot, h, pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
               stride_kcs, stride_kch, stride_kct, stride_vcs, stride_vch, stride_vct, stride_ss, stride_sh, KV_FP8)
