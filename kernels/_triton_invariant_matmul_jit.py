"""``@triton.jit`` batch-invariant matmul (imported only when Triton is present).

``C[g] = A[g] @ B[g]``: every output element is summed over K in chunks of ``CHUNK`` (a multiple of
``BLOCK_K``), each chunk from zero in ``BLOCK_K`` steps, in order, and the chunks' sums added to a zero
total in order, the same sum whatever M is, where its row sits in a tile, how wide the tile is
(the launcher picks it by row count), and whatever the other rows hold. ``SPREAD=False``: one program walks every
chunk of its tile; ``SPREAD=True``: program ``(.., .., g * chunks + c)`` sums chunk ``c`` alone and
stores it in FP32 to ``c_ptr`` (``(chunks, G, M, N)``), and the caller adds the chunks in the same
order (`triton_invariant_matmul.py`), so both give the same bits. ``M`` is not specialized on
(Triton would otherwise compile another kernel when M becomes a multiple of 16).
"""

import triton
import triton.language as tl


@triton.jit
def _chunk_sum(a_rows, b_cols, rm, rn, start, K, M, N, stride_ak, stride_bk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
               IEEE: tl.constexpr):  # fmt: skip
    """The FP32 sum of positions ``start .. start + CHUNK`` (cut at K) of the tile's products."""
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, tl.minimum(start + CHUNK, K), BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_cols + ks[:, None] * stride_bk, mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IEEE:  # FP32 operands: full FP32 products, as torch's matmul without TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def invariant_matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, CHUNKS,
    stride_ag, stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_cc, stride_cg, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr,
    SPREAD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    z = tl.program_id(2).to(tl.int64)
    g = z // CHUNKS if SPREAD else z
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    a_rows = a_ptr + g * stride_ag + rm[:, None] * stride_am
    b_cols = b_ptr + g * stride_bg + rn[None, :] * stride_bn
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPREAD:  # this program's chunk, stored in FP32 for the caller's ordered sum
        c = z % CHUNKS
        acc = _chunk_sum(a_rows, b_cols, rm, rn, c * CHUNK, K, M, N, stride_ak, stride_bk,
                         BLOCK_M, BLOCK_N, BLOCK_K, CHUNK, IEEE)  # fmt: skip
        out = c_ptr + c * stride_cc + g * stride_cg + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(out, acc, mask=out_mask)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, CHUNK):
            total += _chunk_sum(a_rows, b_cols, rm, rn, start, K, M, N, stride_ak, stride_bk,
                                BLOCK_M, BLOCK_N, BLOCK_K, CHUNK, IEEE)  # fmt: skip
        out = c_ptr + g * stride_cg + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(out, total.to(c_ptr.dtype.element_ty), mask=out_mask)
