"""``@triton.jit`` batch-invariant RMSNorm of the Llama / Qwen2 / Qwen3 modules (imported only when Triton is present).

One program per row, the module's arithmetic in one launch: ``x`` in FP32, its squares summed as the row
sum does (each lane its column of ``BLOCK_K``-wide chunks in order, then one reduction of the lanes), the
mean, ``rsqrt(mean + eps)``, ``x * r`` rounded to the input's dtype, then ``weight * that`` in the output
dtype. A row's bits depend on that row, its weight and ``K`` only, never on ``M`` (not specialized on).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def exact_rmsnorm_kernel(x_ptr, w_ptr, out_ptr, M, K, stride_xm, stride_om, eps, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + cols
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        acc += x * x
    r = tl.math.rsqrt(tl.sum(acc, axis=0) / K + eps)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + cols
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0)
        y = (x.to(tl.float32) * r).to(x.dtype)  # the module's ``hidden_states.to(input_dtype)``
        w = tl.load(w_ptr + ks, mask=ks < K, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + row * stride_om + ks, out.to(out_ptr.dtype.element_ty), mask=ks < K)
