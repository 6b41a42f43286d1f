"""quant/_handoff.py: an activation carries its own FP8 quantization to the QuantLinear that consumes it."""

import gc
import weakref

import pytest
import torch
from torch import nn

from jetrl_trainer.kernels import triton_available
from jetrl_trainer.quant import QuantLinear, quantize_fp8_groups
from jetrl_trainer.quant._dispatch import act_quant_fp8
from jetrl_trainer.quant._handoff import offer_prequantized, take_prequantized
from jetrl_trainer.quant.testing import assert_bits_equal


def _offered(shape=(4, 3, 256)):
    """A producer's output (a view of the tensor it wrote, as the fused norm returns) and its pair."""
    out = torch.randn(shape[0] * shape[1], shape[2])
    y = out.view(*shape)
    q, s = quantize_fp8_groups(out)
    offer_prequantized(y, q, s, "fp32")
    return y, q, s


def test_the_flattened_activation_is_served_its_pair():
    y, q, s = _offered()
    x2d = y.reshape(-1, 256)  # what QuantLinear and the grouped projections flatten it to
    served = take_prequantized(x2d, "fp32")
    assert served[0] is q and served[1] is s
    assert act_quant_fp8(x2d, "fp32")[0] is q


def test_only_the_same_whole_unmodified_activation_in_the_same_format():
    y, q, s = _offered()
    x2d = y.reshape(-1, 256)
    assert take_prequantized(x2d, "ue8m0") is None  # another scale format
    assert take_prequantized(y.reshape(-1, 128), "fp32") is None  # other rows
    assert take_prequantized(x2d[1:], "fp32") is None  # a part of it
    assert take_prequantized(y.reshape(-1, 512)[:, :256], "fp32") is None  # not contiguous
    assert take_prequantized(x2d.clone(), "fp32") is None  # the same values elsewhere
    y.add_(1.0)  # an in-place write bumps the version counter
    assert take_prequantized(x2d, "fp32") is None


def test_the_pair_lives_as_long_as_the_activation():
    y, q, s = _offered()
    pair_ref = weakref.ref(q)
    del q, s
    gc.collect()
    assert pair_ref() is not None  # held by the activation
    del y
    gc.collect()
    assert pair_ref() is None  # and by nothing else: no table outlives it


def test_another_activation_is_never_served_the_pair():
    y, _, _ = _offered()
    fresh = torch.randn(12, 256)
    assert take_prequantized(fresh, "fp32") is None
    del y
    assert take_prequantized(torch.randn(12, 256), "fp32") is None


def test_inference_tensors_carry_nothing():
    # They track no version, so an in-place write could not be noticed: the consumer quantizes again.
    with torch.inference_mode():
        y, _, _ = _offered()
        assert take_prequantized(y.reshape(-1, 256), "fp32") is None


def test_quantlinear_runs_on_the_carried_pair():
    # A deliberately wrong pair (all zeros) proves the consumer used it rather than quantizing again.
    layer = QuantLinear.from_linear(nn.Linear(256, 64), {"train": "fp8", "rollout": "fp8"})
    out = torch.randn(12, 256, requires_grad=True) * 1.0  # an autograd output, as the fused norm's
    y = out.view(4, 3, 256)
    q, s = quantize_fp8_groups(out.detach())
    offer_prequantized(y, torch.zeros_like(q), s, "fp32")
    with torch.no_grad():
        expected = layer.bias.expand(4, 3, 64)
        assert torch.equal(layer(y), expected)
    assert torch.equal(layer(y), expected)  # also on the training path (autograd)
    plain = torch.randn(4, 3, 256)
    assert not torch.equal(layer(plain), layer.bias.expand(4, 3, 64))


def test_the_hand_off_is_a_no_op_while_tracing():
    torch._dynamo.reset()

    def offer_then_take(y):
        q, s = quantize_fp8_groups(y)
        offer_prequantized(y, q, s, "fp32")
        return take_prequantized(y, "fp32") is None

    y = torch.randn(4, 256)
    assert torch.compile(offer_then_take, backend="aot_eager", fullgraph=True)(y)
    assert not offer_then_take(y)  # eager: the pair is served


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton")
def test_a_fused_norm_hands_its_quantization_to_the_next_quantlinear_on_gpu(monkeypatch):
    from jetrl_trainer.kernels import triton_quant
    from jetrl_trainer.quant.fused import FusedRMSNorm
    from jetrl_trainer.quant.reference import rmsnorm_reference

    torch.manual_seed(0)
    layer = QuantLinear(512, 256, bias=False).to("cuda", torch.bfloat16)  # rows above the recipe's decode_gemm.max_m: the general path
    weight = nn.Parameter(torch.rand(512, device="cuda", dtype=torch.bfloat16) + 0.5)
    norm = FusedRMSNorm(weight, 1e-6, layer)
    x = torch.randn(2, 65, 512, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = triton_quant.act_quant_fp8
    monkeypatch.setattr(triton_quant, "act_quant_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fused = layer(norm(x))
        assert calls == []  # the norm's pair was served
        unfused = layer(rmsnorm_reference(x, weight, 1e-6))
        assert calls == [1]
    assert_bits_equal(fused, unfused, "y")
    x.requires_grad_(True)
    layer(norm(x)).float().sum().backward()  # the training path takes it too (backward quantizes dY only)
    assert len(calls) == 1 + 2
