"""``@triton.jit`` split-K FP8 GEMM for decode-sized M (imported only when Triton is present).

``out [M, N] = sum_g (q(x)_g @ W_g^T) * sa[:, g] * sb[n // 128, g]``, with ``q(x)`` the 1×128 FP8
quantization of the activation computed in the prologue (``QUANTIZE``) by the very functions of
``_triton_quant_jit`` (hence bit-identical to ``quantize_fp8_groups``), or loaded as given.

``SWAP`` computes the product transposed, ``acc [BLOCK_N, BLOCK_M] = W_tile @ q(x)_tileᵀ``: at
decode M is 1–64, too small for the MMA's M dimension (64 on Hopper) but fine for its N dimension,
while BLOCK_N rows of W fill the MMA. K is split over ``grid[1]`` programs so that a GEMM with few
N tiles still streams W from every SM. Partial sums go to an FP32 workspace that
``splitk_reduce_kernel`` adds in split order: deterministic, no atomics, graph-capturable. (A
variant where the last program of a tile to arrive did the reduction, found by a per-tile counter,
measured no faster inside CUDA graphs on the H200, so the simpler second launch stays.)

``PDL`` (programmatic dependent launch): the weight does not depend on the kernel before, so each
program first asks L2 for its first ``PREFETCH_GROUPS`` weight tiles, and only then waits for that
kernel; the weight stream starts while the previous launch drains.

``SCALE_AHEAD``: each iteration loads the next group's scales and keeps them in registers. Triton's
pipeliner makes the FP8 tiles asynchronous copies but leaves the scale loads (``sa``, ``sb``)
synchronous in the loop, where the scaling after each MMA waits on them: a global-memory latency
per K group on every program's critical path (seen in the sm_90 TTGIR). Same values, same math,
same bits. (Two groups ahead made Triton 3.6 drop the tiles' asynchronous copies: not offered.)

``PREFETCH_AHEAD`` (k > 0): each iteration also asks L2 for the weight lines of the group k ahead
(``prefetch.global.L2``: no register, no shared memory, no result). The pipeline keeps
``num_stages - 1`` weight tiles in flight per program; a short, narrow launch (q/k/v, o at decode)
then has too few bytes in flight to cover DRAM latency, and the hint adds k tiles more without
occupying what limits the programs per SM. Addresses stay inside the weight (clamped to its last
group); the arithmetic is untouched, so the bits are the same.
"""

import triton
import triton.language as tl

from jetrl_trainer.kernels._triton_quant_jit import _amax, _fp8_bits, _scale_from_amax, pdl_enter, prefetch_l2


@triton.jit
def _act_scales(xs_ptr, rows_x, stride_xsm, g, m_ok, g_ok):
    """K group ``g``'s activation scales ``(BLOCK_M,)`` (zeros past K)."""
    return tl.load(xs_ptr + rows_x * stride_xsm + g, mask=m_ok & g_ok, other=0.0)


@triton.jit
def _weight_scales(ws_ptr, rows_w, stride_wsn, g, g_ok):
    """K group ``g``'s weight scales ``(BLOCK_N,)``, one per 128-row block (zeros past K)."""
    return tl.load(ws_ptr + (rows_w // 128) * stride_wsn + g, mask=g_ok, other=0.0)


@triton.jit
def _group_scales(xs_ptr, ws_ptr, rows_x, rows_w, stride_xsm, stride_wsn, g, m_ok, n_groups, QUANTIZE: tl.constexpr):
    """Both scales of K group ``g`` (``SCALE_AHEAD``); with ``QUANTIZE`` the activation's are zeros (the
    prologue computes them)."""
    g_ok = g < n_groups
    if QUANTIZE:
        sa = tl.zeros(rows_x.shape, dtype=tl.float32)
    else:
        sa = _act_scales(xs_ptr, rows_x, stride_xsm, g, m_ok, g_ok)
    return sa, _weight_scales(ws_ptr, rows_w, stride_wsn, g, g_ok)


@triton.jit
def _prefetch_weight_group(w_ptr, rows_w, stride_wn, g, n_groups):
    """Hint: K group ``g``'s weight lines (one 128-byte line per row) into L2; ``g`` clamped to the last group."""
    prefetch_l2(w_ptr + rows_w * stride_wn + tl.minimum(g, n_groups - 1) * 128)


@triton.jit
def _k_loop(
    x_ptr, xs_ptr, ws_ptr, xq_ptr, xqs_ptr, K, stride_xm, stride_xsm, stride_wn, stride_wsn, pid_n, pid_m, pid_k,
    offs_k, m_ok, rows_x, rows_w, n_groups, w_ptr, x_desc, w_desc,
    GROUPS_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANTIZE: tl.constexpr,
    SWAP: tl.constexpr, WRITE_Q: tl.constexpr, UE8M0: tl.constexpr, TMA: tl.constexpr, SCALE_AHEAD: tl.constexpr,
    PREFETCH_AHEAD: tl.constexpr,
):  # fmt: skip
    """The split's K groups: the FP32 tile ``(BLOCK_N, BLOCK_M)`` with ``SWAP``, else ``(BLOCK_M, BLOCK_N)``."""
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g0 = pid_k * GROUPS_PER_SPLIT
    for i in tl.static_range(PREFETCH_AHEAD):  # the groups the loop's own hints start past
        _prefetch_weight_group(w_ptr, rows_w, stride_wn, g0 + i, n_groups)
    if SCALE_AHEAD:  # the next group's scales, loaded one iteration early (see the module doc)
        sa_next, sb_next = _group_scales(xs_ptr, ws_ptr, rows_x, rows_w, stride_xsm, stride_wsn, g0, m_ok, n_groups,
                                         QUANTIZE)  # fmt: skip
    # A static trip count (pipelines well); groups past K in the last split load nothing (masked).
    for i in tl.range(GROUPS_PER_SPLIT):
        g = g0 + i
        g_ok = g < n_groups
        if PREFETCH_AHEAD > 0:  # a hint for a later iteration's weight lines (see the module doc)
            _prefetch_weight_group(w_ptr, rows_w, stride_wn, g + PREFETCH_AHEAD, n_groups)
        if SCALE_AHEAD:
            sa, sb = sa_next, sb_next
            sa_next, sb_next = _group_scales(xs_ptr, ws_ptr, rows_x, rows_w, stride_xsm, stride_wsn, g + 1, m_ok,
                                             n_groups, QUANTIZE)  # fmt: skip
        cols = g * 128 + offs_k
        k_ok = cols < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        # Without SCALE_AHEAD the scales load where they always did (the shipped launch's code is unchanged).
        if QUANTIZE:
            x = tl.load(x_ptr + rows_x[:, None] * stride_xm + cols[None, :], mask=x_mask, other=0.0).to(tl.float32)
            sa = _scale_from_amax(_amax(x, 1), UE8M0)  # (BLOCK_M,)
            bits = _fp8_bits(x, sa[:, None])
            if WRITE_Q:  # tests: the prologue's quantization, written once (by the first N tile)
                if pid_n == 0:
                    tl.store(xq_ptr + rows_x[:, None] * K + cols[None, :], bits, mask=x_mask)
                    tl.store(xqs_ptr + rows_x * n_groups + g, sa, mask=m_ok & g_ok)
            a = bits.to(tl.float8e4nv, bitcast=True)
        elif TMA:  # out of range (rows past M, groups past K) reads zeros, as the masked load
            a = x_desc.load([pid_m * BLOCK_M, g * 128])
            if not SCALE_AHEAD:
                sa = _act_scales(xs_ptr, rows_x, stride_xsm, g, m_ok, g_ok)
        else:
            a = tl.load(x_ptr + rows_x[:, None] * stride_xm + cols[None, :], mask=x_mask, other=0.0)
            if not SCALE_AHEAD:
                sa = _act_scales(xs_ptr, rows_x, stride_xsm, g, m_ok, g_ok)
        if TMA:
            w = w_desc.load([pid_n * BLOCK_N, g * 128])
        else:
            w = tl.load(w_ptr + rows_w[:, None] * stride_wn + cols[None, :], mask=k_ok[None, :], other=0.0)
        if not SCALE_AHEAD:
            sb = _weight_scales(ws_ptr, rows_w, stride_wsn, g, g_ok)
        if SWAP:
            acc += tl.dot(w, tl.trans(a)) * sb[:, None] * sa[None, :]
        else:
            acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def fp8_decode_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, bias_ptr, xq_ptr, xqs_ptr,
    M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
    w1_ptr, ws1_ptr, bias1_ptr, out1_ptr, N1, w2_ptr, ws2_ptr, bias2_ptr, out2_ptr, N2,
    x_desc, w_desc, w1_desc, w2_desc,
    GROUPS_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANTIZE: tl.constexpr, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    WRITE_Q: tl.constexpr, UE8M0: tl.constexpr, SEGMENTS: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH_GROUPS: tl.constexpr = 0, TMA: tl.constexpr = False,
    SCALE_AHEAD: tl.constexpr = 0, PARTIALS: tl.constexpr = False, PREFETCH_AHEAD: tl.constexpr = 0,
):
    """``SEGMENTS`` > 1: one launch for two or three weights that share the activation (q/k/v,
    gate/up). Segment ``s`` (weight ``[N_s, K]`` contiguous, output ``[M, N_s]`` contiguous) owns
    ``cdiv(N_s, BLOCK_N)`` consecutive N tiles; in the partial sums it sits at column offset
    ``N_0 + ... + N_{s-1}`` of ``N_0 + N_1 + N_2`` columns.

    ``TMA``: the weight tiles, and a prequantized activation's, come through host-built tensor
    descriptors (``w_desc`` etc., blocks ``[BLOCK_N, 128]`` and ``[BLOCK_M, 128]``) instead of
    pointer loads. The tiles hold the same values (out-of-range rows and columns read as zeros,
    which only reach outputs that are not stored), so the result has the same bits.

    ``PARTIALS``: a one-split launch also writes its FP32 sums (no bias) into the partials layout
    ``[1, M, N_0 + N_1 + N_2]``, for a consumer that reduces a grouped launch's output itself."""
    # N tiles fastest, M tiles slowest: M tiles fastest (programs sharing a weight tile side by side)
    # made the batch-64 decode step's GEMMs 2.74 -> 3.23 ms on the H200 (run 22), one M tile or not.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n_total = N
    col0 = pid_n * 0  # a tensor, not a constexpr: it is rebound inside a runtime branch
    segment = pid_n * 0  # which weight (TMA picks its descriptor by it)
    if SEGMENTS > 1:  # find this tile's segment; rebind its operands (segment 0 keeps the arguments)
        n_total = N + N1 + N2
        tiles0 = tl.cdiv(N, BLOCK_N)
        if pid_n >= tiles0:
            pid_n -= tiles0
            col0 = N
            segment = 1
            N, w_ptr, ws_ptr, bias_ptr, out_ptr, stride_om = N1, w1_ptr, ws1_ptr, bias1_ptr, out1_ptr, N1
            if SEGMENTS > 2:
                tiles1 = tl.cdiv(N1, BLOCK_N)
                if pid_n >= tiles1:
                    pid_n -= tiles1
                    col0 += N1
                    segment = 2
                    N, w_ptr, ws_ptr, bias_ptr, out_ptr, stride_om = N2, w2_ptr, ws2_ptr, bias2_ptr, out2_ptr, N2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    m_ok = offs_m < M
    rows_x = tl.where(m_ok, offs_m, 0).to(tl.int64)
    rows_w = tl.where(offs_n < N, offs_n, 0).to(tl.int64)  # clamp, not mask: no branch in the K loop
    n_groups = tl.cdiv(K, 128)
    if PDL:  # the weight is no other kernel's output: stream it before waiting (one 128-byte line per row)
        for i in tl.static_range(PREFETCH_GROUPS):  # at most GROUPS_PER_SPLIT (the host clamps it)
            _prefetch_weight_group(w_ptr, rows_w, stride_wn, pid_k * GROUPS_PER_SPLIT + i, n_groups)
    pdl_enter(PDL)

    # A host-built descriptor is not rebound in a runtime branch like the pointers above: with TMA, one
    # loop per weight.
    if TMA and SEGMENTS > 1 and segment == 1:
        acc = _k_loop(x_ptr, xs_ptr, ws_ptr, xq_ptr, xqs_ptr, K, stride_xm, stride_xsm, stride_wn, stride_wsn, pid_n,
                      pid_m, pid_k, offs_k, m_ok, rows_x, rows_w, n_groups, w_ptr, x_desc, w1_desc,
                      GROUPS_PER_SPLIT, BLOCK_M, BLOCK_N, QUANTIZE, SWAP, WRITE_Q, UE8M0, TMA,
                      SCALE_AHEAD, PREFETCH_AHEAD)  # fmt: skip
    elif TMA and SEGMENTS > 2 and segment == 2:
        acc = _k_loop(x_ptr, xs_ptr, ws_ptr, xq_ptr, xqs_ptr, K, stride_xm, stride_xsm, stride_wn, stride_wsn, pid_n,
                      pid_m, pid_k, offs_k, m_ok, rows_x, rows_w, n_groups, w_ptr, x_desc, w2_desc,
                      GROUPS_PER_SPLIT, BLOCK_M, BLOCK_N, QUANTIZE, SWAP, WRITE_Q, UE8M0, TMA,
                      SCALE_AHEAD, PREFETCH_AHEAD)  # fmt: skip
    else:  # pointer loads (w_ptr is this segment's), or segment 0's descriptor
        acc = _k_loop(x_ptr, xs_ptr, ws_ptr, xq_ptr, xqs_ptr, K, stride_xm, stride_xsm, stride_wn, stride_wsn, pid_n,
                      pid_m, pid_k, offs_k, m_ok, rows_x, rows_w, n_groups, w_ptr, x_desc, w_desc,
                      GROUPS_PER_SPLIT, BLOCK_M, BLOCK_N, QUANTIZE, SWAP, WRITE_Q, UE8M0, TMA,
                      SCALE_AHEAD, PREFETCH_AHEAD)  # fmt: skip
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
    PDL: tl.constexpr = False,
):
    """out [M, N] = sum over splits of part [SPLITS, M, N] (+ bias), in split order, rounded once.
    With ``SEGMENTS`` > 1 the partials hold ``N + N1 + N2`` columns, written to the segments' outputs."""
    pdl_enter(PDL)
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
