"""The fused exact RMSNorm (`kernels/triton_exact_rmsnorm.py`, what the Llama / Qwen2 / Qwen3 norms run
under `ExactOps` where Triton runs).

In the interpreter (FP32: its BF16 casts do not round to nearest): the module's output, and a row's bits
the same alone, among other rows and at any M; through the mode, the module's forward runs the kernel
and its gradient is the module's. On sm_90: it compiles. On the GPU: BF16 rows keep their bits across
M and match the module to rounding."""

from __future__ import annotations

import pytest
import torch
from _tensors import seeded_randn as _rand


def _module(k: int, dtype=torch.float32, device="cpu"):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(k, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(_rand(k, dtype=dtype, device=device, seed=7) + 1)
    return norm


def _assert_rows_keep_their_bits(x, weight, out):
    from jetrl_trainer.kernels.triton_exact_rmsnorm import exact_rmsnorm

    for start, stop in ((0, 1), (3, 4), (0, 7), (5, x.shape[0])):
        assert torch.equal(exact_rmsnorm(x[start:stop], weight, 1e-6), out[start:stop]), (start, stop)
    other = torch.cat([x[2:3], _rand(9, x.shape[1], dtype=x.dtype, device=x.device, seed=5)])
    assert torch.equal(exact_rmsnorm(other, weight, 1e-6)[0], out[2])


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [16, 100, 128, 1500])
def test_it_computes_the_module_and_a_row_keeps_its_bits_across_m(k):
    from jetrl_trainer.kernels.triton_exact_rmsnorm import exact_rmsnorm

    norm = _module(k)
    x = _rand(12, k)
    out = exact_rmsnorm(x, norm.weight.detach(), 1e-6)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.allclose(out, norm(x), rtol=1e-5, atol=1e-5)
    _assert_rows_keep_their_bits(x, norm.weight.detach(), out)
    # a weight of another dtype: the module's promoted output dtype
    assert exact_rmsnorm(x, norm.weight.detach().double(), 1e-6).dtype == torch.float64


@pytest.mark.interpreter
def test_the_mode_runs_it_for_the_module_and_differentiates_it(monkeypatch):
    """Inside `ExactOps` the Qwen3 norm's forward is one kernel call (no row_mean), with the module's
    output and gradients; outside it the module's own forward runs."""
    from jetrl_trainer.exact import ExactOps, ops

    calls = []
    fused = ops._FusedRMSNorm.apply
    monkeypatch.setattr(ops._FusedRMSNorm, "apply", lambda *a: calls.append(a[0].shape) or fused(*a))
    means = []
    row_mean = ops.row_mean
    monkeypatch.setattr(ops, "row_mean", lambda x: means.append(x.shape) or row_mean(x))
    norm = _module(64)
    x = _rand(2, 5, 64).requires_grad_()
    with ExactOps.entered():
        out = norm(x)
        (out * torch.arange(64.0)).sum().backward()
    assert calls == [x.shape] and means == []
    grads = x.grad, norm.weight.grad
    x.grad = norm.weight.grad = None
    expected = norm(x)
    (expected * torch.arange(64.0)).sum().backward()
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert all(torch.allclose(g, e, rtol=1e-4, atol=1e-5) for g, e in zip(grads, (x.grad, norm.weight.grad)))
    assert len(calls) == 1  # the module's own forward outside the mode


@pytest.mark.sm90
def test_it_compiles_for_sm90():
    from _sm90 import compile_sm90

    from jetrl_trainer.kernels._triton_exact_rmsnorm_jit import exact_rmsnorm_kernel

    for x, w, out in (("fp32", "fp32", "fp32"), ("bf16", "bf16", "bf16"), ("bf16", "fp32", "fp32")):
        ptx = compile_sm90(exact_rmsnorm_kernel, dict(x_ptr=f"*{x}", w_ptr=f"*{w}", out_ptr=f"*{out}"),
                           dict(BLOCK_K=1024), floats=("eps",), launch=dict(num_warps=4), odd=("M",))  # fmt: skip
        assert ".entry" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("k", [128, 4096])
def test_bf16_rows_keep_their_bits_across_m_on_the_gpu(k):
    from jetrl_trainer.kernels.triton_exact_rmsnorm import exact_rmsnorm

    norm = _module(k, dtype=torch.bfloat16, device="cuda")
    x = _rand(300, k, dtype=torch.bfloat16, device="cuda")
    out = exact_rmsnorm(x, norm.weight.detach(), 1e-6)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), norm(x).float(), rtol=2e-2, atol=2e-2)
    _assert_rows_keep_their_bits(x, norm.weight.detach(), out)
