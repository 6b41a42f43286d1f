"""``@triton.jit`` split-KV decode attention (imported only when Triton is present).

Phase 1, one program per (row, KV head, split): the G query heads that share the KV head attend
to the split's live positions with an online softmax; it writes its running max ``m``, sum ``l``
and unnormalized output ``acc`` in FP32. The loop runs over the live tiles only (a trip count read from
the row's length), so positions past it are never loaded and the next tile's loads pipeline
(``LOOP_STAGES``). ``HAS_PADS``: a row's tiles start ``pads[b] mod BLOCK_N`` positions before its
first cached one, where the training forward's tiles over the left-padded row start.
``KV_FP8``: FP8 caches with one FP32 scale per (slot, KV head, position), dequantized to the query
dtype as they are loaded.
Phase 2, one program per (row, query head): rescales and sums the splits. With one split
(``DIRECT``) phase 1 writes the normalized output itself, the same bits phase 2 would give.
``FLASH_ORDER`` follows flash attention 2's arithmetic instead (tiles newest first, exp2 of raw scores
times scale·log2(e), normalized by a reciprocal); without it, tiles run oldest first with exp of
scaled scores and a division, the order cuDNN's attention sums in. With one split of the training
kernel's tile size, either reproduces that kernel's output on all but a few in 10,000 elements
(``benchmarks/probe_attention_bits.py``).
Phase 1 drops the rows the MMA's 16-row minimum padded the query heads with (12 of 16 in an 8B
layout) before it rounds, stores and quantizes its output: the quant's amax and IEEE divisions cost
as much on a padded row as on a real one (the same values either way).
``QUANT``: the output's 1×128 FP8 quantization (one group per head, ``D`` = 128) is written too, from
the rounded output, by the functions of ``_triton_quant_jit`` (the bits of ``quantize_fp8_groups``
of the ``[B, H·D]`` output): the o projection's activation quant costs no launch of its own.
"""

import triton
import triton.language as tl

from jetrl_trainer.kernels._triton_quant_jit import _amax, _fp8_bits, _scale_from_amax


@triton.jit
def _top_half(x):
    """The first half of the rows of ``x`` (2-D, an even row count)."""
    top, _ = tl.split(tl.permute(tl.reshape(x, (2, x.shape[0] // 2, x.shape[1])), (1, 2, 0)))
    return top


@triton.jit
def _leading_rows(x, ROWS: tl.constexpr):
    """The first rows of ``x`` (a power of two of them, at least ``ROWS``): a tile's real query heads
    without the rows the MMA's 16-row minimum padded it with (12 of 16 in an 8B layout)."""
    for _ in tl.static_range(4):  # 16 rows -> 1 at most (wider tiles are not padded)
        if x.shape[0] // 2 >= ROWS:
            x = _top_half(x)
    return x


@triton.jit
def _store_output(o, out_ptr, oq_ptr, os_ptr, b, head0, d, stride_ob, stride_oh, ROWS: tl.constexpr, H: tl.constexpr,
                  D: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr):  # fmt: skip
    """Store the FP32 output rows ``o (rows, D)`` of heads ``head0 ..`` (the first ``ROWS`` real)
    rounded to the output dtype, and with ``QUANT`` their FP8 quantization (``[B, H·D]`` bits,
    ``[B, H]`` scales: each head is one 128-group). The padding rows are dropped first."""
    o = _leading_rows(o, ROWS)
    rounded = o.to(out_ptr.dtype.element_ty)
    g = tl.arange(0, rounded.shape[0])
    heads = head0 + g
    h_ok = g < ROWS
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], rounded, mask=h_ok[:, None])
    if QUANT:
        of = rounded.to(tl.float32)
        scale = _scale_from_amax(_amax(of, 1), UE8M0)
        bits = _fp8_bits(of, scale[:, None])
        tl.store(oq_ptr + b * H * D + heads[:, None] * D + d[None, :], bits, mask=h_ok[:, None])
        tl.store(os_ptr + b * H + heads, scale, mask=h_ok)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, t0, end, d, k_base, v_base, ks_ptr, vs_ptr, scale_base, stride_kt, stride_vt,
                 scale, scale_log2, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                 FLASH_ORDER: tl.constexpr):  # fmt: skip
    """One online-softmax step over the ``BLOCK_N`` positions from ``t0`` (those outside ``[0, end)`` masked)."""
    t = t0 + tl.arange(0, BLOCK_N)
    t_ok = (t >= 0) & (t < end)  # before 0: the training forward's padding, masked there too
    k = tl.load(k_base + t[:, None] * stride_kt + d[None, :], mask=t_ok[:, None], other=0.0)
    if KV_FP8:  # dequantized to the query dtype, as KVCache.read does for the reference
        k_s = tl.load(ks_ptr + scale_base + t, mask=t_ok, other=0.0)
        k = (k.to(tl.float32) * k_s[:, None]).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (G_PAD, BLOCK_N), FP32, unscaled
    if not FLASH_ORDER:
        s = s * scale
    s = tl.where(t_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if FLASH_ORDER:  # the running max stays in raw score units
        alpha = tl.math.exp2((m_i - m_new) * scale_log2)
        p = tl.math.exp2(s * scale_log2 - (m_new * scale_log2)[:, None])
    else:
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + t[:, None] * stride_vt + d[None, :], mask=t_ok[:, None], other=0.0)
    if KV_FP8:
        v_s = tl.load(vs_ptr + scale_base + t, mask=t_ok, other=0.0)
        v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def decode_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, lengths_ptr, pads_ptr, m_ptr, l_ptr, acc_ptr, ks_ptr, vs_ptr, out_ptr,
    oq_ptr, os_ptr, scale, scale_log2,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kt,
    stride_vs, stride_vh, stride_vt,
    stride_mb, stride_mh,
    stride_ab, stride_ah, stride_as,
    stride_ss, stride_sh, stride_ob, stride_oh,
    tiles,  # BLOCK_N-position tiles per split: a runtime value, so a new cache length compiles nothing
    GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr, FLASH_ORDER: tl.constexpr, DIRECT: tl.constexpr,
    H: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr, HAS_PADS: tl.constexpr, LOOP_STAGES: tl.constexpr,
):  # fmt: skip
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lengths_ptr + b).to(tl.int32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    start = split * tiles * BLOCK_N
    if HAS_PADS:  # tiles as the training forward lays them over the left-padded row: the first one starts
        start -= tl.load(pads_ptr + b).to(tl.int32) % BLOCK_N  # (pads mod BLOCK_N) positions before slot position 0
    end = tl.minimum(start + tiles * BLOCK_N, length)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kvh * GROUPS + g
    g_ok = g < GROUPS
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    k_base = k_ptr + slot * stride_ks + kvh * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh * stride_vh
    scale_base = slot * stride_ss + kvh * stride_sh  # FP8 caches: one scale per (position, KV head)
    n_tiles = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)  # live tiles only: their loads pipeline
    for i in tl.range(0, n_tiles, num_stages=LOOP_STAGES):
        if FLASH_ORDER:  # newest tile first, as flash attention walks a causal row
            t0 = start + (n_tiles - 1 - i) * BLOCK_N
        else:
            t0 = start + i * BLOCK_N
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, t0, end, d, k_base, v_base, ks_ptr, vs_ptr, scale_base,
                                     stride_kt, stride_vt, scale, scale_log2, BLOCK_N, PRECISION, KV_FP8,
                                     FLASH_ORDER)  # fmt: skip
    if DIRECT:  # one split: the normalized output, as phase 2 would compute it with a weight of exactly 1
        if FLASH_ORDER:
            o = acc * (1.0 / l_i)[:, None]
        else:
            o = acc / l_i[:, None]
        _store_output(o, out_ptr, oq_ptr, os_ptr, b, kvh * GROUPS, d, stride_ob, stride_oh, GROUPS, H, D, QUANT, UE8M0)
        return
    row = b * stride_mb + heads * stride_mh + split
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)
    out = acc_ptr + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + d[None, :]
    tl.store(out, acc, mask=g_ok[:, None])


@triton.jit
def decode_attention_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, oq_ptr, os_ptr,
    stride_mb, stride_mh, stride_ab, stride_ah, stride_as, stride_ob, stride_oh,
    m_scale, SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr, FLASH_ORDER: tl.constexpr,
    H: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < SPLITS
    d = tl.arange(0, D)
    m = tl.load(m_ptr + b * stride_mb + h * stride_mh + s, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + b * stride_mb + h * stride_mh + s, mask=s_ok, other=0.0)
    acc = tl.load(acc_ptr + b * stride_ab + h * stride_ah + s[:, None] * stride_as + d[None, :], mask=s_ok[:, None],
                  other=0.0)  # fmt: skip
    m_max = tl.max(m, axis=0)
    if FLASH_ORDER:  # m in raw score units; normalized by the reciprocal of the sum, as flash attention
        w = tl.where(m > float("-inf"), tl.math.exp2((m - m_max) * m_scale), 0.0)
        out = tl.sum(acc * w[:, None], axis=0) * (1.0 / tl.sum(l * w, axis=0))
    else:
        w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # empty splits weigh nothing
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    # one head as a (1, D) row (no padding rows to drop), so the output store is phase 1's
    _store_output(out[None, :], out_ptr, oq_ptr, os_ptr, b, h, d, stride_ob, stride_oh, 1, H, D, QUANT, UE8M0)
