"""quant/reference.py: the pure-torch RMSNorm and SwiGLU that the fused kernels reproduce."""

from __future__ import annotations

import torch

from jetrl_trainer.quant.reference import _pairwise_sum, rmsnorm_reference, swiglu_reference


def test_pairwise_sum_order_is_the_kernels_tree():
    v = torch.tensor([1.0, 2.0, 3.0])
    assert _pairwise_sum(v).item() == 6.0
    # In FP32, 1e8 + 1 == 1e8: a left-to-right sum gives 1, the adjacent-pair tree gives 0.
    w = torch.tensor([1e8, 1.0, -1e8, 1.0])
    assert ((w[0] + w[1]) + w[2]) + w[3] == 1.0
    assert _pairwise_sum(w).item() == 0.0


def test_rmsnorm_reference_is_close_to_transformers():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    norm = Qwen3RMSNorm(1000, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
        x = (torch.randn(64, 1000) * 3).to(torch.bfloat16)
        expected = norm(x)
        got = rmsnorm_reference(x, norm.weight, 1e-6)
    assert got.dtype == torch.bfloat16
    diff = (got.float() - expected.float()).abs()
    assert bool((diff <= expected.float().abs() * 2.0**-6).all())  # ≤ 2 BF16 ulps (transformers rounds twice)
    assert (diff == 0).float().mean().item() > 0.95


def test_rmsnorm_reference_hand_computed():
    x = torch.tensor([[3.0, 4.0]])  # mean(x²) = 12.5
    y = rmsnorm_reference(x, torch.tensor([1.0, 2.0]), 0.0)
    want = torch.tensor([[3.0, 8.0]]) / torch.tensor(12.5).sqrt()
    assert torch.allclose(y, want, rtol=0, atol=1e-7)


def test_swiglu_reference_is_silu_times_up():
    g = torch.tensor([0.0, 1.0, -2.0])
    u = torch.tensor([5.0, 2.0, 1.0])
    want = torch.tensor([0.0, 2.0 / (1.0 + torch.exp(torch.tensor(-1.0)).item()), -2.0 / (1.0 + torch.exp(torch.tensor(2.0)).item())])
    assert torch.allclose(swiglu_reference(g, u), want, rtol=1e-6)
