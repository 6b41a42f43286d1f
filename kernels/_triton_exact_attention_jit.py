"""``@triton.jit`` exact attention (imported only when Triton is present).

One program takes ``BLOCK_M`` query rows of one (batch row, KV head): the GQA group's heads at a run of
positions. It walks the keys in ``BLOCK_N`` tiles from the batch row's first real key, in order, with
an FP32 online softmax. A row's arithmetic is the same instruction sequence whatever the other rows
of its program hold and however many there are: tiles past a row's last key are masked to a finite
minimum, which leaves its running max, sum and accumulator exactly unchanged (``exp(0) = 1`` and
``exp(minimum - max) = 0``), so a decode step's query and the same query in a training forward get
the same bits. ``M`` (rows) and the key bounds are not specialized on.

``BF16_DOT``: the two products on tensor cores (BF16 operands, FP32 sums) instead of FP32 FMA; a row's
bits then depend on the tile shape, which both phases share, as before.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["S", "T", "ROWS"])
def exact_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, first_ptr, last_ptr, kv_rows_ptr, k_scale_ptr, v_scale_ptr, S, T, ROWS,
    scale,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd, stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_ls, stride_sb, stride_sh, stride_st,
    GROUP: tl.constexpr, HEADS_KV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_ROWS: tl.constexpr, SCALED: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    # KV_ROWS: batch row b reads keys/values at kv_rows[b] (the engine's cache slots); SCALED: FP8 keys
    # and values with one FP32 scale per (row, KV head, position), read as q * scale in FP32: the
    # values the training forward's attention reads through the cache's roundtrip.
    MASKED: tl.constexpr = -3.4028234663852886e38  # finite: a row with no key left gives no NaN
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HEADS_KV).to(tl.int64)
    kv_head = (bh % HEADS_KV).to(tl.int64)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # row = group head * S + position
    live = rows < ROWS
    head = kv_head * GROUP + rows // S
    pos = rows % S
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qs + d[None, :] * stride_qd,
                mask=live[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    first = tl.load(first_ptr + b)
    last = tl.load(last_ptr + b * stride_lb + pos * stride_ls, mask=live, other=-1)
    stop = tl.max(tl.where(live, last, first - 1)) + 1
    m = tl.full((BLOCK_M,), MASKED, dtype=tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    kv_b = tl.load(kv_rows_ptr + b).to(tl.int64) if KV_ROWS else b
    k_base = k_ptr + kv_b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + kv_b * stride_vb + kv_head * stride_vh
    scale_base = kv_b * stride_sb + kv_head * stride_sh
    n = tl.arange(0, BLOCK_N).to(tl.int64)
    for start in range(first, stop, BLOCK_N):
        t = start + n
        t_ok = t < T
        k = tl.load(k_base + t[None, :] * stride_kt + d[:, None] * stride_kd, mask=d_ok[:, None] & t_ok[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_D, BLOCK_N)
        if SCALED:
            k = k * tl.load(k_scale_ptr + scale_base + t * stride_st, mask=t_ok, other=0.0)[None, :]
        if BF16_DOT:  # tensor cores: operands rounded to BF16, products summed in FP32
            scores = tl.dot(q.to(tl.bfloat16), k.to(tl.bfloat16)) * scale
        else:
            scores = tl.dot(q, k, input_precision="ieee") * scale
        valid = t[None, :] <= last[:, None]
        scores = tl.where(valid, scores, MASKED)
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # A masked key's exp is 0 already where the row has a key; a row without any (padding) stays at 0.
        p = tl.where(valid, tl.exp(scores - m_new[:, None]), 0.0)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_base + t[:, None] * stride_vt + d[None, :] * stride_vd, mask=t_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_D)
        if SCALED:
            v = v * tl.load(v_scale_ptr + scale_base + t * stride_st, mask=t_ok, other=0.0)[:, None]
        if BF16_DOT:  # the probabilities rounded to BF16 for P.V, as flash attention does
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        total = total * alpha + tl.sum(p, axis=1)
        m = m_new
    out = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)  # a query with no key (padding): 0, not NaN
    o = out_ptr + b * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_os + d[None, :] * stride_od
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])
