"""``@triton.jit`` batch-invariant row sum (imported only when Triton is present).

One program per row: each lane accumulates its column of ``BLOCK_K``-wide chunks in order, in FP32,
then one reduction of the ``BLOCK_K`` lanes. The order depends on ``K`` and ``BLOCK_K`` only, never on
the number of rows or on the other rows. ``M`` is not specialized on (another kernel would be compiled
when M becomes a multiple of 16, and the decode and the training forward would run different ones).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def row_sum_kernel(x_ptr, out_ptr, M, K, stride_xm, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + cols
        acc += tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))
