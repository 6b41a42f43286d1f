"""The batch-invariant row sum (`kernels/triton_row_sum.py`, the exact RMSNorm's reduction on CUDA).

In the interpreter: it sums ragged rows of every float dtype and strided rows, and a row's sum is
the same alone, among other rows and at any M. On sm_90: it compiles. On the GPU: a row keeps its
bits across M at the engine's and the training forward's shapes."""

from __future__ import annotations

import pytest
import torch
from _tensors import seeded_randn as _rand


def _assert_invariant(x, sums):
    from jetrl_trainer.kernels.triton_row_sum import row_sum

    for start, stop in ((0, 1), (3, 4), (0, 7), (5, x.shape[0])):
        assert torch.equal(row_sum(x[start:stop]), sums[start:stop]), (start, stop)
    assert torch.equal(row_sum(torch.cat([x[2:3], _rand(9, x.shape[1], dtype=x.dtype, device=x.device, seed=5)]))[0],
                       sums[2])  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 100, 128, 1500])
def test_it_sums_each_row_in_fp32_and_a_row_keeps_its_bits_across_m(dtype, k):
    from jetrl_trainer.kernels.triton_row_sum import row_sum

    x = _rand(12, k, dtype=dtype)
    sums = row_sum(x)
    assert sums.dtype == torch.float32 and sums.shape == (12,)
    assert torch.allclose(sums.double(), x.double().sum(-1), rtol=1e-5, atol=1e-4)
    _assert_invariant(x, sums)


@pytest.mark.interpreter
def test_strided_and_empty_rows():
    from jetrl_trainer.kernels.settings import RowSumSettings
    from jetrl_trainer.kernels.triton_row_sum import row_sum

    x = _rand(40, 6)
    assert torch.equal(row_sum(x.t()), row_sum(x.t().contiguous()))  # unit stride along K is made
    assert row_sum(torch.empty(0, 8)).shape == (0,) and torch.equal(row_sum(torch.empty(3, 0)), torch.zeros(3))
    narrow = RowSumSettings(block_k=64)  # another chunk width: another order, still the sum
    wide = _rand(4, 1000)
    assert torch.allclose(row_sum(wide, narrow).double(), wide.double().sum(-1), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        RowSumSettings(block_k=1000)


@pytest.mark.sm90
def test_it_compiles_for_sm90():
    from _sm90 import compile_sm90

    from jetrl_trainer.kernels._triton_row_sum_jit import row_sum_kernel

    for dtype in ("fp32", "bf16"):
        ptx = compile_sm90(row_sum_kernel, dict(x_ptr=f"*{dtype}", out_ptr="*fp32"), dict(BLOCK_K=1024),
                           launch=dict(num_warps=4), odd=("M",))  # fmt: skip
        assert ".entry" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "k"), [(torch.float32, 4096), (torch.float32, 128), (torch.bfloat16, 4096)])
def test_a_row_keeps_its_bits_across_m_on_the_gpu(dtype, k):
    from jetrl_trainer.kernels.triton_row_sum import row_sum

    x = _rand(5000, k, dtype=dtype, device="cuda")  # a training forward's rows; a decode step's are the first few
    sums = row_sum(x)
    assert torch.allclose(sums.double(), x.double().sum(-1), rtol=1e-5, atol=1e-3)
    _assert_invariant(x, sums)
