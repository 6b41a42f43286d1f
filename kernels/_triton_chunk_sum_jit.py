"""``@triton.jit`` ordered sum of K-chunk partials (imported only when Triton is present).

``out[i] = (((0 + p[0, i]) + p[1, i]) + ...)`` in FP32, rounded once to ``out``'s dtype: the
additions a split-K program makes when it adds its own chunks, so a decode step's spread chunks
(`triton_invariant_matmul.py`, `triton_gemm.py`) get the training forward's bits, in one launch
where torch's ops took two plus one per chunk.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["numel"])
def chunk_sum_kernel(p_ptr, out_ptr, numel, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    stride = numel.to(tl.int64)  # chunks x numel may pass 2**31
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):  # in order, from zero
        total += tl.load(p_ptr + c * stride + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
