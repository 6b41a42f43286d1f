"""``@triton.jit`` split-K FP8 GEMM for decode-sized M (imported only when Triton is present).

``out [M, N] = sum_g (x_q_g @ W_g^T) * sa[:, g] * sb[n // 128, g]``: an activation quantized 1×128
(``x_q``, scales ``sa``) against 128×128-block FP8 weights (``W``, scales ``sb``).

``SWAP`` computes the product transposed, ``acc [BLOCK_N, BLOCK_M] = W_tile @ x_tileᵀ``: at decode M
is 1–64, too small for the MMA's M dimension (64 on Hopper) but fine for its N dimension, while
BLOCK_N rows of W fill the MMA. K is split over ``grid[1]`` programs so that a GEMM with few N tiles
still streams W from every SM. Partial sums go to an FP32 workspace that ``splitk_reduce_kernel``
adds in split order: deterministic, no atomics, graph-capturable. (A variant where the last program
of a tile to arrive did the reduction, found by a per-tile counter, measured no faster inside CUDA
graphs on the H200, so the simpler second launch stays.)

Each K-loop iteration loads the next group's scales and keeps them in registers: Triton's pipeliner
makes the FP8 tiles asynchronous copies but leaves the scale loads synchronous in the loop, where the
scaling after each MMA would wait on them, a global-memory latency per K group on every program's
critical path (seen in the sm_90 TTGIR). Two groups ahead made Triton 3.6 drop the tiles'
asynchronous copies.
"""

import triton
import triton.language as tl


@triton.jit
def _group_scales(xs_ptr, ws_ptr, rows_x, rows_w, stride_xsm, stride_wsn, g, m_ok, n_groups):
    """K group ``g``'s scales: the activation's ``(BLOCK_M,)`` and the weight's ``(BLOCK_N,)``, one per
    128-row block (zeros past K)."""
    g_ok = g < n_groups
    sa = tl.load(xs_ptr + rows_x * stride_xsm + g, mask=m_ok & g_ok, other=0.0)
    return sa, tl.load(ws_ptr + (rows_w // 128) * stride_wsn + g, mask=g_ok, other=0.0)


@triton.jit
def _k_loop(x_ptr, xs_ptr, w_ptr, ws_ptr, K, stride_xm, stride_xsm, stride_wn, stride_wsn, pid_k, offs_k, m_ok,
            rows_x, rows_w, n_groups, GROUPS_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            SWAP: tl.constexpr):  # fmt: skip
    """The split's K groups: the FP32 tile ``(BLOCK_N, BLOCK_M)`` with ``SWAP``, else ``(BLOCK_M, BLOCK_N)``."""
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g0 = pid_k * GROUPS_PER_SPLIT
    sa_next, sb_next = _group_scales(xs_ptr, ws_ptr, rows_x, rows_w, stride_xsm, stride_wsn, g0, m_ok, n_groups)
    # A static trip count (pipelines well); groups past K in the last split load nothing (masked).
    for i in tl.range(GROUPS_PER_SPLIT):
        g = g0 + i
        sa, sb = sa_next, sb_next  # this group's scales, loaded one iteration early (see the module doc)
        sa_next, sb_next = _group_scales(xs_ptr, ws_ptr, rows_x, rows_w, stride_xsm, stride_wsn, g + 1, m_ok, n_groups)
        cols = g * 128 + offs_k
        k_ok = cols < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        a = tl.load(x_ptr + rows_x[:, None] * stride_xm + cols[None, :], mask=x_mask, other=0.0)
        w = tl.load(w_ptr + rows_w[:, None] * stride_wn + cols[None, :], mask=k_ok[None, :], other=0.0)
        if SWAP:
            acc += tl.dot(w, tl.trans(a)) * sb[:, None] * sa[None, :]
        else:
            acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def fp8_decode_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, bias_ptr,
    M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
    w1_ptr, ws1_ptr, bias1_ptr, out1_ptr, N1, w2_ptr, ws2_ptr, bias2_ptr, out2_ptr, N2,
    GROUPS_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SWAP: tl.constexpr, HAS_BIAS: tl.constexpr, SEGMENTS: tl.constexpr, PARTIALS: tl.constexpr,
):  # fmt: skip
    """``SEGMENTS`` > 1: one launch for two or three weights that share the activation (q/k/v,
    gate/up). Segment ``s`` (weight ``[N_s, K]`` contiguous, output ``[M, N_s]`` contiguous) owns
    ``cdiv(N_s, BLOCK_N)`` consecutive N tiles; in the partial sums it sits at column offset
    ``N_0 + ... + N_{s-1}`` of ``N_0 + N_1 + N_2`` columns.

    ``PARTIALS``: a one-split launch also writes its FP32 sums (no bias) into the partials layout
    ``[1, M, N_0 + N_1 + N_2]``, for a consumer that reduces a grouped launch's output itself."""
    # N tiles fastest, M tiles slowest: M tiles fastest (programs sharing a weight tile side by side)
    # measured slower on the H200 (docs/performance.md), one M tile or not.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n_total = N
    col0 = pid_n * 0  # a tensor, not a constexpr: it is rebound inside a runtime branch
    if SEGMENTS > 1:  # find this tile's segment; rebind its operands (segment 0 keeps the arguments)
        n_total = N + N1 + N2
        tiles0 = tl.cdiv(N, BLOCK_N)
        if pid_n >= tiles0:
            pid_n -= tiles0
            col0 = N
            N, w_ptr, ws_ptr, bias_ptr, out_ptr, stride_om = N1, w1_ptr, ws1_ptr, bias1_ptr, out1_ptr, N1
            if SEGMENTS > 2:
                tiles1 = tl.cdiv(N1, BLOCK_N)
                if pid_n >= tiles1:
                    pid_n -= tiles1
                    col0 += N1
                    N, w_ptr, ws_ptr, bias_ptr, out_ptr, stride_om = N2, w2_ptr, ws2_ptr, bias2_ptr, out2_ptr, N2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    m_ok = offs_m < M
    rows_x = tl.where(m_ok, offs_m, 0).to(tl.int64)
    rows_w = tl.where(offs_n < N, offs_n, 0).to(tl.int64)  # clamp, not mask: no branch in the K loop
    n_groups = tl.cdiv(K, 128)
    acc = _k_loop(x_ptr, xs_ptr, w_ptr, ws_ptr, K, stride_xm, stride_xsm, stride_wn, stride_wsn, pid_k, offs_k, m_ok,
                  rows_x, rows_w, n_groups, GROUPS_PER_SPLIT, BLOCK_M, BLOCK_N, SWAP)  # fmt: skip
    if SWAP:
        acc = tl.trans(acc)  # (BLOCK_M, BLOCK_N)
    out_mask = m_ok[:, None] & (offs_n[None, :] < N)
    tile = offs_m[:, None].to(tl.int64) * n_total + col0 + offs_n[None, :]  # index into one [M, N] partial
    if SPLITS > 1 or PARTIALS:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * n_total + tile, acc, mask=out_mask)
        return
    if HAS_BIAS:  # added to the FP32 result, then rounded once (QuantLinear's contract)
        acc += tl.load(bias_ptr + rows_w).to(tl.float32)[None, :]
    dst = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def splitk_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_om, bias1_ptr, out1_ptr, N1, bias2_ptr, out2_ptr, N2,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, SEGMENTS: tl.constexpr,
):
    """out [M, N] = sum over splits of part [SPLITS, M, N] (+ bias), in split order, rounded once.
    With ``SEGMENTS`` > 1 the partials hold ``N + N1 + N2`` columns, written to the segments' outputs."""
    n_total = N + N1 + N2 if SEGMENTS > 1 else N
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * n_total
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * M * n_total + offs, mask=mask, other=0.0)
    m = offs // n_total
    n = offs % n_total
    m64 = m.to(tl.int64)
    if SEGMENTS > 1:
        in1 = n >= N
        if SEGMENTS > 2:
            in2 = n >= N + N1
        else:
            in2 = n < 0  # no third segment
        local = tl.where(in2, n - N - N1, tl.where(in1, n - N, n))
        dst = tl.where(in2, out2_ptr + m64 * N2 + local, tl.where(in1, out1_ptr + m64 * N1 + local,
                                                                 out_ptr + m64 * stride_om + local))
        if HAS_BIAS:
            bias = tl.where(in2, bias2_ptr + local, tl.where(in1, bias1_ptr + local, bias_ptr + local))
            acc += tl.load(bias, mask=mask, other=0.0).to(tl.float32)
    else:
        dst = out_ptr + m64 * stride_om + n
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)
