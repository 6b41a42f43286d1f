"""``@triton.jit`` batch-invariant matmul (imported only when Triton is present).

``C[g] = A[g] @ B[g]`` with one fixed tile shape and no split-K: every output element is summed over
K in ``BLOCK_K`` steps, in order, by the same instruction sequence whatever M is, where its row sits
in a tile, and whatever the other rows hold. ``M`` is not specialized on (Triton would otherwise
compile another kernel when M becomes a multiple of 16).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def invariant_matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_ag, stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_cg, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    a_rows = a_ptr + g * stride_ag + rm[:, None] * stride_am
    b_cols = b_ptr + g * stride_bg + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_cols + ks[:, None] * stride_bk, mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IEEE:  # FP32 operands: full FP32 products, as torch's matmul without TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = c_ptr + g * stride_cg + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))
