"""``@triton.jit`` FP64 block sums of a probability table (imported only when Triton is present).

One program per (row, block): ``BLOCK`` FP32 entries, widened to FP64 and added in ``tl.sum``'s fixed
tree order, so a row's sums depend on that row alone, whatever the batch. Past the vocabulary the
entries load as 0 (no padded copy of the table).
"""

import triton
import triton.language as tl


@triton.jit
def block_sums_fp64_kernel(p_ptr, out_ptr, V, stride_p, n_blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(p_ptr + row.to(tl.int64) * stride_p + offs, mask=offs < V, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * n_blocks + block, tl.sum(x.to(tl.float64), axis=0))
