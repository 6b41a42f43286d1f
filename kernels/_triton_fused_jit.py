"""``@triton.jit`` RMSNorm+quant and SwiGLU+quant kernels (imported only when Triton is present).

Both write the high-precision result *and* its 1×GROUP FP8 quantization in one pass, so the
next GEMM's activation quant costs no extra read. Exactness notes (see the host wrappers):

* RMSNorm sums the squares in a fixed pairwise tree (adjacent pairs, level by level) — the same
  tree as ``rmsnorm_reference`` — and must be launched with ``enable_fp_fusion=False`` so that
  ``x*x + y*y`` is not contracted into an FMA;
* SiLU is ``g / (1 + expf(-g))`` with libdevice ``expf`` and an IEEE division, as ATen's CUDA
  ``silu_kernel`` computes it; launched with ``enable_reflect_ftz=False`` (nvcc's default).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from jetrl_trainer.kernels._triton_quant_jit import _amax, _fp8_bits, _scale_from_amax


@triton.jit
def _store_quantized_rows(y, rows, row_ok, K, q_ptr, s_ptr, stride_qm, stride_sm,
                          BLOCK_K: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr):  # fmt: skip
    """Quantize the rows of ``y`` (``[ROWS, BLOCK_K]`` fp32, zeros past K) in 1×GROUP groups and store them."""
    yg = tl.reshape(y, (y.shape[0], BLOCK_K // GROUP, GROUP))
    scale = _scale_from_amax(_amax(yg, 2), UE8M0)  # (ROWS, BLOCK_K // GROUP)
    q = tl.reshape(_fp8_bits(yg, scale[:, :, None]), (y.shape[0], BLOCK_K))
    cols = tl.arange(0, BLOCK_K)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=row_ok[:, None] & (cols[None, :] < K))
    groups = tl.arange(0, BLOCK_K // GROUP)
    s_mask = row_ok[:, None] & (groups[None, :] < tl.cdiv(K, GROUP))
    tl.store(s_ptr + rows[:, None] * stride_sm + groups[None, :], scale, mask=s_mask)


@triton.jit
def rms_divisor_rows(x, k_float, eps, LEVELS: tl.constexpr):
    """``sqrt(mean(x²) + eps)`` of each row of a ``[ROWS, BLOCK_K]`` FP32 tile (zeros past K) as
    ``rmsnorm_reference`` computes it: squares summed in a pairwise tree of adjacent pairs
    (``LEVELS`` = log2(BLOCK_K) - 1 halvings, then the last pair), a true division by ``k_float`` =
    fp32(K) (exact below 2^24), correctly rounded sqrt. Each row has its own tree, so its bits do not
    depend on the rows tiled with it. Needs ``enable_fp_fusion=False`` (no FMA contraction)."""
    total = x * x
    for _ in tl.static_range(LEVELS):
        total = tl.sum(tl.reshape(total, (total.shape[0], total.shape[1] // 2, 2)), axis=2)
    total = tl.sum(total, axis=1)  # the last pair of each row
    return tl.math.sqrt_rn(tl.math.div_rn(total, k_float) + eps)


@triton.jit
def _rmsnorm_quant_rows(x_raw, rows, row_ok, K, k_float, eps, w_ptr, y_ptr, q_ptr, s_ptr, stride_ym, stride_qm,
                        stride_sm, BLOCK_K: tl.constexpr, LEVELS: tl.constexpr, GROUP: tl.constexpr,
                        UE8M0: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """Store ``y = w * (x / sqrt(mean(x²) + eps)).to(dtype)`` of the rows ``x_raw`` (``[ROWS, BLOCK_K]``)
    and, with ``QUANT``, its quantization."""
    cols = tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (cols[None, :] < K)
    x = x_raw.to(tl.float32)
    h = tl.math.div_rn(x, rms_divisor_rows(x, k_float, eps, LEVELS)[:, None]).to(x_raw.dtype)
    w = tl.load(w_ptr + cols, mask=cols < K, other=0.0)
    y = (w.to(tl.float32)[None, :] * h.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y, mask=mask)
    if QUANT:
        _store_quantized_rows(y.to(tl.float32), rows, row_ok, K, q_ptr, s_ptr, stride_qm, stride_sm, BLOCK_K, GROUP,
                              UE8M0)  # fmt: skip


@triton.jit
def rmsnorm_quant_kernel(
    x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, M, K, k_float, eps, stride_xm, stride_ym, stride_qm, stride_sm,
    BLOCK_K: tl.constexpr, ROWS: tl.constexpr, LEVELS: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    """``ROWS`` rows per program (several for narrow rows such as Qwen3's per-head q/k norms, so that a
    program has work): y = w * (x / sqrt(mean(x²) + eps)).to(dtype); with ``QUANT``, q, s = quant(y)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    x_raw = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < K),
                    other=0.0)  # fmt: skip
    _rmsnorm_quant_rows(x_raw, rows, row_ok, K, k_float, eps, w_ptr, y_ptr, q_ptr, s_ptr, stride_ym, stride_qm,
                        stride_sm, BLOCK_K, LEVELS, GROUP, UE8M0, QUANT)  # fmt: skip


@triton.jit
def add_rmsnorm_quant_kernel(
    r_ptr, d_ptr, bias_ptr, w_ptr, h_ptr, y_ptr, q_ptr, s_ptr, M, K, k_float, eps,
    stride_rm, stride_dm, stride_hm, stride_ym, stride_qm, stride_sm,
    PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, LEVELS: tl.constexpr, GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
):  # fmt: skip
    """One row per program: the residual add ``h = (r + d).to(dtype)``, stored, then ``rmsnorm_quant_kernel``
    of ``h``. ``d`` is a tensor in ``r``'s dtype (``PARTS`` = 0), or the split-K partial sums
    ``[PARTS, M, K]`` (FP32, contiguous) of a decode GEMM, added in split order (+ bias) and rounded
    once, as ``splitk_reduce_kernel`` does: the same bits as that reduction, then torch's add."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    r_raw = tl.load(r_ptr + row * stride_rm + cols, mask=mask, other=0.0)
    if PARTS == 0:
        d = tl.load(d_ptr + row * stride_dm + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.load(d_ptr + row * K + cols, mask=mask, other=0.0)
        for p in tl.static_range(1, PARTS):
            acc += tl.load(d_ptr + p * M * K + row * K + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        d = acc.to(r_raw.dtype).to(tl.float32)
    h = (r_raw.to(tl.float32) + d).to(r_raw.dtype)
    tl.store(h_ptr + row * stride_hm + cols, h, mask=mask)
    one = tl.arange(0, 1)  # the row as a (1, BLOCK_K) tile
    _rmsnorm_quant_rows(tl.reshape(h, (1, BLOCK_K)), row + one, one == 0, K, k_float, eps, w_ptr, y_ptr, q_ptr, s_ptr,
                        stride_ym, stride_qm, stride_sm, BLOCK_K, LEVELS, GROUP, UE8M0, True)  # fmt: skip


@triton.jit
def swiglu_quant_kernel(
    g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, M, K, stride_gm, stride_um, stride_hm, stride_qm, stride_sm,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, UE8M0: tl.constexpr,
):
    """h = (silu(g).to(dtype) * u).to(dtype); q, s = quant(h); one [BLOCK_M, GROUPS_PER_PROG*GROUP] tile."""
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    groups = pid_g * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (G, GROUP)
    mask = (rows[:, None, None] < M) & (cols[None, :, :] < K)
    r3, c3 = rows[:, None, None], cols[None, :, :]
    g_raw = tl.load(g_ptr + r3 * stride_gm + c3, mask=mask, other=0.0)
    u = tl.load(u_ptr + r3 * stride_um + c3, mask=mask, other=0.0).to(tl.float32)
    g = g_raw.to(tl.float32)
    act = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(g_raw.dtype)
    h = (act.to(tl.float32) * u).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + r3 * stride_hm + c3, h, mask=mask)
    hf = h.to(tl.float32)
    scale = _scale_from_amax(_amax(hf, 2), UE8M0)  # (BLOCK_M, G)
    tl.store(q_ptr + r3 * stride_qm + c3, _fp8_bits(hf, scale[:, :, None]), mask=mask)
    s_mask = (rows[:, None] < M) & (groups[None, :] < tl.cdiv(K, GROUP))
    tl.store(s_ptr + rows[:, None] * stride_sm + groups[None, :], scale, mask=s_mask)


@triton.jit
def rmsnorm_backward_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, dw_part_ptr, M, K, k_float, eps, stride_xm, stride_dym, stride_dxm,
    tiles_per_prog, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
):
    """RMSNorm backward for y = w * (x * r).to(dtype), r = (mean(x²) + eps)^-1/2, in one pass:
    dx = r * (dh - h * mean(dh * h)) with dh = dy * w, h = x * r; ``tiles_per_prog`` tiles of ``ROWS``
    rows per program (several rows per tile for narrow rows, so that each load has work); per-program
    partial sums of dw = sum_rows(dy * h.to(dtype)) go to dw_part[pid] (summed by the host in a fixed order)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    dw = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for t in range(tiles_per_prog):
        rows = ((pid * tiles_per_prog + t) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x_raw = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x_raw.to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / k_float + eps)
        h = x * r[:, None]
        dh = dy * w[None, :]
        c = tl.sum(dh * h, axis=1) / k_float
        dx = r[:, None] * (dh - h * c[:, None])
        tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * h.to(x_raw.dtype).to(tl.float32)
    tl.store(dw_part_ptr + pid * BLOCK_K + cols, tl.sum(dw, axis=0), mask=cols < K)
