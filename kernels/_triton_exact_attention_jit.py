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

``SPLIT`` (keys per split, a multiple of ``BLOCK_N``; 0: none): the keys of a row run in splits of
``SPLIT`` positions counted from its first real key, each in its own program (grid axis 2) from an empty
state, which it writes out; `exact_attention_combine_kernel` then merges a row's splits in order. The
split boundaries depend on the row's first key only, never on the batch or the cache's size, so a query
gets the same bits in a decode step and in a training forward; what the split buys is programs: a decode
step of few rows over long contexts otherwise runs one program per row and KV head.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["S", "T", "ROWS", "SPLITS"])
def exact_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, first_ptr, last_ptr, kv_rows_ptr, k_scale_ptr, v_scale_ptr, part_m_ptr,
    part_sum_ptr, part_acc_ptr, S, T, ROWS, SPLITS,
    scale,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd, stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_ls, stride_sb, stride_sh, stride_st,
    GROUP: tl.constexpr, HEADS_KV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_ROWS: tl.constexpr, SCALED: tl.constexpr,
    BF16_DOT: tl.constexpr, SPLIT: tl.constexpr,
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
    lo = first
    if SPLIT > 0:  # this program's split of the keys; an empty range leaves the empty state
        lo = first + tl.program_id(2) * SPLIT
        stop = tl.minimum(stop, lo + SPLIT)
    for start in range(lo, stop, BLOCK_N):
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
    if SPLIT > 0:  # the split's state, at (batch row, head, position, split), for the combine kernel
        part = ((b * HEADS_KV * GROUP + head) * S + pos) * SPLITS + tl.program_id(2)
        tl.store(part_m_ptr + part, m, mask=live)
        tl.store(part_sum_ptr + part, total, mask=live)
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=live[:, None] & d_ok[None, :])
    else:
        out = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)  # a query with no key (padding): 0, not NaN
        o = out_ptr + b * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_os + d[None, :] * stride_od
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["S", "QUERIES", "SPLITS"])
def exact_attention_combine_kernel(
    part_m_ptr, part_sum_ptr, part_acc_ptr, out_ptr, first_ptr, last_ptr, S, QUERIES, SPLITS,
    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_ls,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Each query's splits merged in order, split 0 first: ``BLOCK_R`` queries (batch row, head, position)
    per program. A query merges only its own splits (as many as its keys fill), with one instruction
    sequence whatever the other queries hold, so its bits do not depend on the batch either."""
    MASKED: tl.constexpr = -3.4028234663852886e38
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    live = r < QUERIES
    b = r // (HEADS * S)
    head = (r // S) % HEADS
    pos = r % S
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < D
    first = tl.load(first_ptr + b, mask=live, other=0)
    last = tl.load(last_ptr + b * stride_lb + pos * stride_ls, mask=live, other=-1)
    own = tl.where(last >= first, (last - first) // SPLIT + 1, 0)  # the query's splits
    base = r * SPLITS
    m = tl.load(part_m_ptr + base, mask=live, other=MASKED)
    total = tl.load(part_sum_ptr + base, mask=live, other=0.0)
    acc = tl.load(part_acc_ptr + base[:, None] * D + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0)
    for split in range(1, SPLITS):
        take = live & (split < own)
        m_s = tl.load(part_m_ptr + base + split, mask=take, other=MASKED)
        sum_s = tl.load(part_sum_ptr + base + split, mask=take, other=0.0)
        acc_s = tl.load(part_acc_ptr + (base + split)[:, None] * D + d[None, :], mask=take[:, None] & d_ok[None, :],
                        other=0.0)  # fmt: skip
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(m_s - m_new)
        acc = tl.where(take[:, None], acc * alpha[:, None] + acc_s * beta[:, None], acc)
        total = tl.where(take, total * alpha + sum_s * beta, total)
        m = tl.where(take, m_new, m)
    out = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)  # a query with no key (padding): 0, not NaN
    o = out_ptr + b[:, None] * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_os + d[None, :] * stride_od
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])
