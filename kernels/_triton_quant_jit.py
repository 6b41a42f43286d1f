"""``@triton.jit`` FP8 quantization kernels (imported only when Triton is present).

Each kernel reproduces ``jetrl_trainer.quant.fp8`` *as torch computes it on CUDA*, bit for bit:

* ``scale = max(amax, 1e-10) * fp32(1/448)``: on CUDA, ``tensor / 448.0`` (a CPU scalar divisor)
  is executed by ATen as a multiply by the FP32 reciprocal (``div_true_kernel_cuda``), so that is
  what we do too — a true division here would differ in the last bit;
* ``q = fp8(clamp(x / scale, ±448))`` with an IEEE division (``div_rn``; Triton's ``/`` is the
  approximate ``div.full.f32``) and round-to-nearest-even (the saturating hardware cast, see
  ``_fp8_bits``);
* NaN is propagated through the amax (``tl.max`` alone would drop it);
* ue8m0 rounds the scale up to a power of two by bit manipulation (== frexp/ldexp for the normal,
  positive scales that ``max(amax, 1e-10) / 448`` can produce); under its top scale 2^120, q
  saturates at ±240 so that q * scale stays finite, as in the reference.

Quantized tensors are stored through ``uint8`` views so no FP8 store path is involved.
"""

import triton
import triton.language as tl

_INV_FP8_MAX = tl.constexpr(1.0 / 448.0)
_AMAX_FLOOR = tl.constexpr(1e-10)
_UE8M0_TOP = tl.constexpr(2.0**120)  # quant/fp8.py: q * 2^120 overflows from q = 256 up
_UE8M0_TOP_MAX = tl.constexpr(240.0)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax(x, axis: tl.constexpr):
    """max(|x|) along ``axis`` that keeps NaN (like torch.amax)."""
    return tl.reduce(tl.abs(x), axis, _max_nan)


@triton.jit
def _scale_from_amax(amax, UE8M0: tl.constexpr):
    scale = tl.maximum(amax, _AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL) * _INV_FP8_MAX
    if UE8M0:
        bits = scale.to(tl.int32, bitcast=True)
        exp_bits = bits & 0x7F800000
        # Round up to 2^k: a non-zero mantissa bumps the exponent (into Inf for the largest binade).
        up = tl.where((bits & 0x007FFFFF) != 0, exp_bits + 0x00800000, bits)
        scale = tl.where(exp_bits != 0x7F800000, up.to(tl.float32, bitcast=True), scale)
    return scale


@triton.jit
def _fp8_bits(x, scale):
    """uint8 bit patterns of ``fp8_e4m3fn(clamp(x / scale, -448, 448))`` as torch produces them.

    No explicit clamp: Triton lowers this cast to ``cvt.rn.satfinite.e4m3x2.f32`` on SM89+, which
    rounds to nearest even and saturates to ±448 exactly as clamp-then-cast does. NaN needs no
    care either: a NaN quotient on the GPU is the canonical (positive) NaN, which both torch and
    the hardware cast turn into 0x7f. The GPU tests check both claims bit for bit. Under the top
    ue8m0 scale (fp32 scales never reach it) the quotient is clamped to ±240 first, as the reference does.
    """
    v = tl.math.div_rn(x, scale)
    top = (scale == _UE8M0_TOP) & (tl.abs(v) > _UE8M0_TOP_MAX)
    v = tl.where(top, tl.where(v > 0, _UE8M0_TOP_MAX, -_UE8M0_TOP_MAX), v)
    return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm, stride_sm,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, UE8M0: tl.constexpr,
):
    """x [M, K] -> q [M, K] (uint8 view), s [M, ceil(K/GROUP)] (row-major); one [BLOCK_M, GROUPS_PER_PROG*GROUP] tile.

    ``x`` may have any strides: for a transposed view (stride_xm == 1, specialised by Triton) the
    loads are coalesced along M and the compiler moves the tile through shared memory for the store.
    """
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    groups = pid_g * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (G, GROUP)
    mask = (rows[:, None, None] < M) & (cols[None, :, :] < K)
    x = tl.load(x_ptr + rows[:, None, None] * stride_xm + cols[None, :, :].to(tl.int64) * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = _scale_from_amax(_amax(x, 2), UE8M0)  # (BLOCK_M, G)
    q = _fp8_bits(x, scale[:, :, None])
    tl.store(q_ptr + rows[:, None, None] * stride_qm + cols[None, :, :], q, mask=mask)
    n_groups = tl.cdiv(K, GROUP)
    s_mask = (rows[:, None] < M) & (groups[None, :] < n_groups)
    tl.store(s_ptr + rows[:, None] * stride_sm + groups[None, :], scale, mask=s_mask)


@triton.jit
def weight_quant_kernel(
    w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_qn, stride_sn,
    BLOCK: tl.constexpr, UE8M0: tl.constexpr,
):
    """w [N, K] -> q [N, K] (uint8 view), s_inv [ceil(N/BLOCK), ceil(K/BLOCK)]; one tile per program."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    x = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.reduce(_amax(x, 1), 0, _max_nan)
    scale = _scale_from_amax(amax, UE8M0)
    q = _fp8_bits(x, scale)
    tl.store(q_ptr + rows[:, None] * stride_qn + cols[None, :], q, mask=mask)
    tl.store(s_ptr + pid_n * stride_sn + pid_k, scale)


@triton.jit
def requant_transpose_kernel(
    q_ptr, s_ptr, qt_ptr, st_ptr, M, K, stride_qm, stride_sm, stride_qtk, stride_stk,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, UE8M0: tl.constexpr, PACK4: tl.constexpr,
):
    """q [M, K] fp8 (uint8 view) with s [M, ceil(K/GROUP)] -> qt [K, M], st [K, ceil(M/GROUP)] (row-major).

    Dequantizes one (GROUP tokens x BLOCK_K features) tile (``q.float() * s``, as the reference),
    then re-quantizes it in GROUP x 1 groups along the tokens and writes it transposed.
    BLOCK_K divides GROUP, so each tile column reads one input scale per token.
    PACK4 (M % 4 == 0, ``qt_ptr`` a 32-bit view of qt, ``stride_qtk`` in words) packs four consecutive
    tokens' bytes into one 32-bit word before the transpose, so the shared-memory round trip moves
    words instead of single bytes (same bits: the amax and the scale do not depend on the layout);
    other M take the byte transpose.
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PACK4:
        scale, cols = _requant_transpose_words(q_ptr, s_ptr, qt_ptr, M, K, stride_qm, stride_sm, stride_qtk, pid_m,
                                               pid_k, GROUP, BLOCK_K, UE8M0)  # fmt: skip
    else:
        scale, cols = _requant_transpose_bytes(q_ptr, s_ptr, qt_ptr, M, K, stride_qm, stride_sm, stride_qtk, pid_m,
                                               pid_k, GROUP, BLOCK_K, UE8M0)  # fmt: skip
    tl.store(st_ptr + cols.to(tl.int64) * stride_stk + pid_m, scale, mask=cols < K)


@triton.jit
def _requant_transpose_bytes(q_ptr, s_ptr, qt_ptr, M, K, stride_qm, stride_sm, stride_qtk, pid_m, pid_k,
                             GROUP: tl.constexpr, BLOCK_K: tl.constexpr, UE8M0: tl.constexpr):
    rows = pid_m * GROUP + tl.arange(0, GROUP)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    bits = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], mask=mask, other=0)
    s_in = tl.load(s_ptr + rows.to(tl.int64) * stride_sm + (pid_k * BLOCK_K) // GROUP, mask=rows < M, other=0.0)
    x = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s_in[:, None]
    x = tl.where(mask, x, 0.0)  # absent tokens never raise the amax (and 0 * inf would be NaN)
    scale = _scale_from_amax(_amax(x, 0), UE8M0)  # (BLOCK_K,)
    qt = tl.trans(_fp8_bits(x, scale[None, :]))  # (BLOCK_K, GROUP)
    tl.store(qt_ptr + cols[:, None].to(tl.int64) * stride_qtk + rows[None, :], qt, mask=tl.trans(mask))
    return scale, cols


@triton.jit
def _requant_transpose_words(q_ptr, s_ptr, qt_ptr, M, K, stride_qm, stride_sm, stride_qtk, pid_m, pid_k,
                             GROUP: tl.constexpr, BLOCK_K: tl.constexpr, UE8M0: tl.constexpr):
    words = pid_m * (GROUP // 4) + tl.arange(0, GROUP // 4)  # one per 4 tokens
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    # Four (GROUP/4 x BLOCK_K) loads, tokens 4w + b: same shape and pointer pattern, so the same register
    # layout, and the four bytes of an output word meet in one thread with no shuffle.
    x0 = _dequantized_rows(q_ptr, s_ptr, M, K, stride_qm, stride_sm, words * 4, cols, pid_k, GROUP, BLOCK_K)
    x1 = _dequantized_rows(q_ptr, s_ptr, M, K, stride_qm, stride_sm, words * 4 + 1, cols, pid_k, GROUP, BLOCK_K)
    x2 = _dequantized_rows(q_ptr, s_ptr, M, K, stride_qm, stride_sm, words * 4 + 2, cols, pid_k, GROUP, BLOCK_K)
    x3 = _dequantized_rows(q_ptr, s_ptr, M, K, stride_qm, stride_sm, words * 4 + 3, cols, pid_k, GROUP, BLOCK_K)
    a = _max_nan(_max_nan(tl.abs(x0), tl.abs(x1)), _max_nan(tl.abs(x2), tl.abs(x3)))  # in-thread, then one reduction
    scale = _scale_from_amax(tl.reduce(a, 0, _max_nan), UE8M0)  # (BLOCK_K,): the max is the same in any order
    packed = (_fp8_bits(x0, scale[None, :]).to(tl.uint32) | (_fp8_bits(x1, scale[None, :]).to(tl.uint32) << 8)
              | (_fp8_bits(x2, scale[None, :]).to(tl.uint32) << 16) | (_fp8_bits(x3, scale[None, :]).to(tl.uint32) << 24))  # fmt: skip
    word_mask = (cols[:, None] < K) & (words[None, :] < M // 4)  # little-endian: token 4w in the low byte
    tl.store(qt_ptr + cols[:, None].to(tl.int64) * stride_qtk + words[None, :], tl.trans(packed).to(tl.int32, bitcast=True),
             mask=word_mask)  # fmt: skip
    return scale, cols


@triton.jit
def _dequantized_rows(q_ptr, s_ptr, M, K, stride_qm, stride_sm, rows, cols, pid_k, GROUP: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    """``q.float() * s`` of ``rows`` x ``cols`` (absent ones 0)."""
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    bits = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], mask=mask, other=0)
    s_in = tl.load(s_ptr + rows.to(tl.int64) * stride_sm + (pid_k * BLOCK_K) // GROUP, mask=rows < M, other=0.0)
    return tl.where(mask, bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s_in[:, None], 0.0)


@triton.jit
def transpose_u8_kernel(x_ptr, y_ptr, R, C, stride_xr, stride_yc, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """y [C, R] = x [R, C].T for 1-byte elements (the FP8 weight for DGrad)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=mask)
    tl.store(y_ptr + cols[:, None].to(tl.int64) * stride_yc + rows[None, :], tl.trans(tile), mask=tl.trans(mask))
