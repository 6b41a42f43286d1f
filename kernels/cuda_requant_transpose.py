"""``requant_transpose_fp8`` as a hand-written CUDA kernel (opt-in; compiled at first use with NVRTC).

Why CUDA here: WGrad's operand ``X_q'ᵀ`` is a transpose of 1-byte data, and every Triton launch of it
(docs/history.md §1: byte tiles, FP32 tiles, four tokens packed per word) stops at 25–37% of copy
bandwidth, because Triton moves the tile through shared memory with its generic layout conversion.
This kernel chooses the shared-memory layout itself: one (128 tokens x 64 features) tile per block of
256 threads; 16-byte global loads into shared memory, XOR-swizzled so that the transposing reads are
free of bank conflicts; each thread then owns 4 features x 8 tokens, reduces the amax over the group's
128 tokens with warp shuffles and writes 8 contiguous bytes per feature.

Measured on the H200 (docs/history.md §1, run 45): the same bits as the Triton kernel, at 0.315 of
copy bandwidth against the Triton PACK4 launch's 0.370. The layout was not the bound: the per-element
work (dequantize, amax, IEEE division, cast; about 60 SASS instructions) saturates instruction issue.
So it stays opt-in.

The numerics are those of ``quant.fp8`` as the Triton kernel computes them (same bits, GPU test):
dequantize ``fp8 -> f32 * s`` (one rounding), amax with NaN propagated, ``scale = max(amax, fp32(1e-10))
* fp32(1/448)`` (ue8m0: rounded up to a power of two by bit manipulation), ``q = cvt.rn.satfinite(x /
scale)`` with the IEEE division.

It is launched through ``torch.cuda._compile_kernel`` (NVRTC, shipped with CUDA builds of torch: no
compiler at install time). Where that is missing or fails, ``kernel()`` returns None, the reason is
logged once, and the caller runs the Triton kernel. Shapes it takes: group 128, K % 16 == 0,
M % 8 == 0, contiguous operands (``supports``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

__all__ = ["kernel", "launch", "supports"]

logger = logging.getLogger("jetrl_trainer")

_NAME = "jetrl_requant_transpose_fp8"
TOKENS, FEATURES, THREADS = 128, 64, 256  # tile (one 1x128 group along tokens) and block size

SOURCE = r"""
// Shared-memory word (row, word) of the (128 x 64)-byte tile sits at row * 16 + (word ^ ((row >> 3) & 15)).
__device__ __forceinline__ int swizzled(int row, int word) { return row * 16 + (word ^ ((row >> 3) & 15)); }

__device__ __forceinline__ float max_nan(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

__device__ __forceinline__ float fp8_to_float(unsigned int byte) {
    unsigned int pair;  // f16x2; the low half holds the low byte's value (exact: every e4m3 value is an f16)
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"((unsigned short)byte));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(pair & 0xffff)));
    return f;
}

__device__ __forceinline__ unsigned int fp8_pair(float lo, float hi) {  // (fp8(hi) << 8) | fp8(lo)
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float quotient(float x, float scale) {
    float v = __fdiv_rn(x, scale);
    if (scale == 0x1p120f && fabsf(v) > 240.0f) v = v > 0.0f ? 240.0f : -240.0f;  // ue8m0's top scale
    return v;
}

extern "C" __global__ void __launch_bounds__(256) jetrl_requant_transpose_fp8(
    const unsigned char* __restrict__ q, const float* __restrict__ s, unsigned char* __restrict__ qt,
    float* __restrict__ st, int M, int K, int stride_qm, int stride_sm, int stride_qtk, int stride_stk,
    int stride_stg, int ue8m0) {
    __shared__ __align__(16) unsigned int tile[128 * 16];
    __shared__ float row_scale[128];
    const int m0 = blockIdx.x * 128, k0 = blockIdx.y * 64, tid = threadIdx.x;

    // Phase 1: 512 chunks of 16 bytes (row = chunk / 4), two per thread, stored swizzled.
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = tid + 256 * r, row = i >> 2, chunk = i & 3, m = m0 + row, k = k0 + chunk * 16;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (m < M && k < K) v = *reinterpret_cast<const uint4*>(q + (long long)m * stride_qm + k);
        const int flip = (row >> 3) & 3;  // under the swizzle, word w of the chunk sits at w ^ flip
        const unsigned int a = flip & 1 ? v.y : v.x, b = flip & 1 ? v.x : v.y;
        const unsigned int c = flip & 1 ? v.w : v.z, d = flip & 1 ? v.z : v.w;
        *reinterpret_cast<uint4*>(&tile[swizzled(row, chunk * 4) & ~3]) = flip & 2 ? make_uint4(c, d, a, b)
                                                                                    : make_uint4(a, b, c, d);
    }
    // Row r's scale at (r % 8) * 16 + r / 8: phase 2's reads of rows 8o + j' then hit 32 banks too.
    if (tid < 128) row_scale[(tid & 7) * 16 + (tid >> 3)] = m0 + tid < M ? s[(long long)(m0 + tid) * stride_sm + k0 / 128] : 0.0f;
    __syncthreads();

    // Phase 2: thread = (feature word fw: features 4fw..4fw+3, token octet o: tokens 8o..8o+7). The two
    // half-warps read rows of opposite parity at each step (j ^ half), so the 32 words hit 32 banks.
    const int lane = tid & 31, half = lane >> 4, o = lane & 15, fw = 2 * (tid >> 5) + half;
    float x[8][4];
    float amax[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int row = 8 * o + (j ^ half);  // slot j holds token j ^ half
        const unsigned int word = tile[swizzled(row, fw)];
        const float sc = row_scale[(row & 7) * 16 + o];
        #pragma unroll
        for (int b = 0; b < 4; ++b) {
            x[j][b] = __fmul_rn(fp8_to_float((word >> (8 * b)) & 0xffu), sc);
            amax[b] = max_nan(amax[b], fabsf(x[j][b]));
        }
    }
    #pragma unroll
    for (int b = 0; b < 4; ++b) {
        #pragma unroll
        for (int d = 1; d < 16; d <<= 1) amax[b] = max_nan(amax[b], __shfl_xor_sync(0xffffffffu, amax[b], d));
    }
    #pragma unroll
    for (int b = 0; b < 4; ++b) {
        const int k = k0 + 4 * fw + b;
        float scale = __fmul_rn(max_nan(amax[b], 0x1.b7cdfep-34f), 0x1.24924ap-9f);  // fp32(1e-10), fp32(1/448)
        if (ue8m0) {
            const unsigned int bits = __float_as_uint(scale), exp_bits = bits & 0x7f800000u;
            const unsigned int up = (bits & 0x007fffffu) != 0u ? exp_bits + 0x00800000u : bits;
            if (exp_bits != 0x7f800000u) scale = __uint_as_float(up);
        }
        unsigned int lo = 0u, hi = 0u;  // tokens 0-3 and 4-7 of the octet, token 8o in the low byte
        #pragma unroll
        for (int t = 0; t < 4; t += 2) {
            lo |= fp8_pair(quotient(x[t][b], scale), quotient(x[t + 1][b], scale)) << (8 * t);
            hi |= fp8_pair(quotient(x[t + 4][b], scale), quotient(x[t + 5][b], scale)) << (8 * t);
        }
        if (half) {  // slots held tokens j ^ 1: swap neighbouring bytes back into token order
            lo = __byte_perm(lo, 0u, 0x2301);
            hi = __byte_perm(hi, 0u, 0x2301);
        }
        if (k < K && m0 + 8 * o < M)
            *reinterpret_cast<uint2*>(qt + (long long)k * stride_qtk + m0 + 8 * o) = make_uint2(lo, hi);
        if (k < K && o == 0) st[(long long)k * stride_stk + (long long)blockIdx.x * stride_stg] = scale;
    }
}
"""


def supports(q: torch.Tensor, s: torch.Tensor, group: int) -> bool:
    """Shapes and layouts the CUDA kernel takes (else the Triton kernel runs)."""
    m, k = q.shape
    return (
        q.is_cuda and group == TOKENS and m > 0 and k > 0 and k % 16 == 0 and m % 8 == 0 and q.is_contiguous()
        and s.is_contiguous() and q.data_ptr() % 16 == 0
    )  # fmt: skip


@functools.lru_cache(maxsize=None)
def kernel(device_index: int) -> Optional[Any]:
    """The compiled kernel for this device, or None (reason logged once)."""
    compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
    if compile_kernel is None:
        logger.warning("CUDA requant-transpose: torch %s has no torch.cuda._compile_kernel; Triton runs instead.",
                       torch.__version__)  # fmt: skip
        return None
    try:
        with torch.cuda.device(device_index):
            return compile_kernel(SOURCE, _NAME)
    except Exception as exc:  # NVRTC missing or refusing the source: the Triton kernel still gives the bits
        logger.warning("CUDA requant-transpose: NVRTC compile failed (%s); Triton runs instead.", exc)
        return None


def launch(q: torch.Tensor, s: torch.Tensor, qt: torch.Tensor, st: torch.Tensor, ue8m0: bool) -> bool:
    """Fill ``qt`` / ``st`` from ``q`` / ``s``; False (nothing written) where the kernel is unavailable."""
    fn = kernel(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if fn is None:
        return False
    m, k = q.shape
    grid = ((m + TOKENS - 1) // TOKENS, (k + FEATURES - 1) // FEATURES, 1)
    fn(grid=grid, block=(THREADS, 1, 1), args=[q.view(torch.uint8), s, qt.view(torch.uint8), st, m, k, q.stride(0),
       s.stride(0), qt.stride(0), st.stride(0), st.stride(1), int(ue8m0)])  # fmt: skip
    return True
