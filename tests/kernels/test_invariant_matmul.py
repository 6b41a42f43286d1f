"""The batch-invariant matmul kernel (`kernels/triton_invariant_matmul.py`, used by `jetrl_trainer.exact` on CUDA).

In the interpreter: it computes ``a @ b`` for ragged shapes and strided / broadcast operands. On sm_90:
it compiles, with wgmma for BF16. On the GPU: a row's bits are the same alone, among other rows, and
in another batch, for BF16 and FP32 (where cuBLAS's batched products were not), and the FP8 Triton
GEMM the exact mode uses for FP8 layers keeps a row's bits across M, across its 64-row config switch.
"""

from __future__ import annotations

import pytest
import torch
from _tensors import seeded_randn as _rand


@pytest.mark.interpreter
@pytest.mark.parametrize(("g", "m", "k", "n"), [(1, 5, 70, 33), (3, 64, 64, 64), (2, 130, 40, 129)])
def test_it_multiplies(g, m, k, n):
    from jetrl_trainer.kernels.triton_invariant_matmul import invariant_matmul

    a, b = _rand(g, m, k), _rand(g, k, n, seed=1)
    assert torch.allclose(invariant_matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
    shared = _rand(k, n, seed=2)[None].expand(g, k, n)  # one weight read by every batch (stride 0)
    assert torch.allclose(invariant_matmul(a, shared), a @ shared, rtol=1e-4, atol=1e-4)
    at = _rand(g, k, m, seed=3).transpose(1, 2)  # a column-major operand
    assert torch.allclose(invariant_matmul(at, b), at @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.sm90
def test_it_compiles_for_sm90_with_wgmma():
    from _sm90 import compile_sm90

    from jetrl_trainer.kernels._triton_invariant_matmul_jit import invariant_matmul_kernel

    for dtype, ieee, block_k in (("bf16", False, 64), ("fp32", True, 32)):
        ptx = compile_sm90(invariant_matmul_kernel, dict(a_ptr=f"*{dtype}", b_ptr=f"*{dtype}", c_ptr=f"*{dtype}"),
                           dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, IEEE=ieee), launch=dict(num_warps=4),
                           odd=("M",))  # fmt: skip
        assert ("wgmma" in ptx) == (dtype == "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_keeps_its_bits_across_m_and_batches(dtype):
    from jetrl_trainer.kernels.triton_invariant_matmul import invariant_matmul

    a, b = _rand(1, 300, 4096, dtype=dtype, device="cuda"), _rand(4096, 1024, dtype=dtype, device="cuda", seed=1)
    full = invariant_matmul(a, b[None])
    assert torch.allclose(full.float(), a.float() @ b.float(), rtol=2e-2, atol=5e-1)
    for rows in (1, 7, 64, 65, 200):
        assert torch.equal(invariant_matmul(a[:, :rows], b[None]), full[:, :rows])
    assert torch.equal(invariant_matmul(a[:, 100:101], b[None]), full[:, 100:101])
    batched = invariant_matmul(a.expand(5, 300, 4096), b[None].expand(5, 4096, 1024))
    assert all(torch.equal(batched[i], full[0]) for i in range(5))


@pytest.mark.gpu
def test_the_fp8_triton_gemm_keeps_a_rows_bits_across_m():
    from jetrl_trainer.kernels import fp8_gemm_nt
    from jetrl_trainer.quant.fp8 import quantize_fp8_blocks, quantize_fp8_groups

    x = _rand(300, 4096, dtype=torch.bfloat16, device="cuda")
    w = _rand(1024, 4096, dtype=torch.bfloat16, device="cuda", seed=1)
    wq = quantize_fp8_blocks(w)
    full = fp8_gemm_nt(quantize_fp8_groups(x), wq, out_dtype=torch.bfloat16, backend="triton")
    for rows in (1, 7, 64, 65, 200):
        assert torch.equal(fp8_gemm_nt(quantize_fp8_groups(x[:rows]), wq, out_dtype=torch.bfloat16, backend="triton"),
                           full[:rows]), rows  # fmt: skip
