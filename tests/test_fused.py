"""quant/fused.py: the swap (Qwen3, Llama, LLaDA), the pre-quantized hand-off, numerics on CPU and GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetrl_trainer.kernels import triton_available
from jetrl_trainer.quant import QuantLinear, dequantize_model, quantize_fp8_groups, quantize_model
from jetrl_trainer.quant.fused import (
    FusedRMSNorm,
    FusedSwiGLUMLP,
    fuse_norm_and_swiglu,
    offer_prequantized,
    take_prequantized,
)
from jetrl_trainer.quant.reference import rmsnorm_reference
from jetrl_trainer.quant.testing import assert_bits_equal


def _qwen3(dtype=torch.float32):
    from jetrl_trainer.tiny import build_tiny_qwen3

    return build_tiny_qwen3(dtype=dtype)


def _cos(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def test_swap_on_qwen3_keeps_parameters_and_state_dict():
    model = quantize_model(_qwen3())
    keys = list(model.state_dict())
    weights = {k: v.data_ptr() for k, v in model.state_dict().items()}
    fuse_norm_and_swiglu(model)
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm)
    assert isinstance(layer.post_attention_layernorm, FusedRMSNorm)
    assert isinstance(layer.mlp, FusedSwiGLUMLP)
    # Per-head q/k norms: no consumer to hand a quantization to, but the engine fuses them into RoPE.
    assert isinstance(layer.self_attn.q_norm, FusedRMSNorm) and layer.self_attn.q_norm._consumer() is None
    assert isinstance(layer.self_attn.k_norm, FusedRMSNorm)
    assert not isinstance(model.model.norm, FusedRMSNorm)
    assert list(model.state_dict()) == keys
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == weights
    again = {name: id(m) for name, m in model.named_modules()}
    fuse_norm_and_swiglu(model)  # idempotent
    assert {name: id(m) for name, m in model.named_modules()} == again


def test_swap_on_llada_fuses_norms_only():
    from jetrl_trainer.diffusion.tiny import build_tiny_llada

    model = fuse_norm_and_swiglu(quantize_model(build_tiny_llada(vocab_size=64, mask_token_id=63)))
    block = model.model.transformer.blocks[0] if hasattr(model, "model") else next(
        m for m in model.modules() if type(m).__name__ == "LLaDALlamaBlock"
    )
    assert isinstance(block.attn_norm, FusedRMSNorm) and isinstance(block.ff_norm, FusedRMSNorm)
    assert not any(isinstance(m, FusedSwiGLUMLP) for m in model.modules())  # inline SwiGLU: left as is


def test_fused_model_matches_unfused_on_cpu():
    torch.manual_seed(0)
    ref = quantize_model(_qwen3())
    fused = fuse_norm_and_swiglu(quantize_model(_qwen3()))
    ids = torch.randint(0, ref.config.vocab_size, (2, 24))
    out_ref, out = ref(ids).logits, fused(ids).logits
    assert _cos(out, out_ref) > 0.999
    out.float().pow(2).mean().backward()
    out_ref.float().pow(2).mean().backward()
    for (name, p), q in zip(fused.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        assert _cos(p.grad, q.grad) > 0.98, name


def test_handoff_is_valid_only_for_the_same_unmodified_tensor():
    y = torch.randn(4, 3, 256)
    q, s = quantize_fp8_groups(y.reshape(-1, 256))
    offer_prequantized(y, q, s, "fp32")
    x2d = y.reshape(-1, 256)
    assert take_prequantized(x2d, "fp32")[0] is q
    assert take_prequantized(x2d, "ue8m0") is None
    assert take_prequantized(y.reshape(-1, 128), "fp32") is None
    y.add_(1.0)  # in-place change: version bump
    assert take_prequantized(x2d, "fp32") is None
    offer_prequantized(y, q, s, "fp32")
    del y, x2d  # the entry dies with the tensor (its storage may be reused)
    from jetrl_trainer.quant import _handoff

    assert not _handoff._table()


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_fused_kernels_in_a_bf16_qwen3_on_gpu():
    torch.manual_seed(0)
    ref = quantize_model(_qwen3(torch.bfloat16)).cuda()
    fused = fuse_norm_and_swiglu(quantize_model(_qwen3(torch.bfloat16))).cuda()
    ids = torch.randint(0, ref.config.vocab_size, (2, 64), device="cuda")
    out_ref, out = ref(ids).logits, fused(ids).logits
    assert _cos(out, out_ref) > 0.999
    out.float().pow(2).mean().backward()
    out_ref.float().pow(2).mean().backward()
    for (name, p), q in zip(fused.named_parameters(), ref.parameters()):
        assert _cos(p.grad, q.grad) > 0.97, name


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_fused_rmsnorm_backward_matches_autograd_of_reference():
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(512, device="cuda", dtype=torch.bfloat16) * 0.1 + 1)
    dy = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    FusedRMSNorm(w, 1e-6)(x).backward(dy)
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    rmsnorm_reference(x32, w32, 1e-6).backward(dy.float())
    assert _cos(dx, x32.grad) > 0.999 and _cos(dw, w32.grad) > 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_fused_swiglu_backward_is_autograds_bit_for_bit():
    from jetrl_trainer.quant.fused import _SwiGLUQuantFunction

    gate = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dh = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16)
    h, _, _ = _SwiGLUQuantFunction.apply(gate, up, "fp32")
    h.backward(dh)
    got = (gate.grad.clone(), up.grad.clone())
    gate.grad = up.grad = None
    (F.silu(gate) * up).backward(dh)
    assert_bits_equal(h, F.silu(gate) * up, "h")
    assert_bits_equal(got[0], gate.grad, "d_gate")
    assert_bits_equal(got[1], up.grad, "d_up")


def test_quantize_model_fuses_on_request_and_dequantize_model_undoes_it():
    torch.manual_seed(0)
    original = _qwen3()
    ids = torch.randint(0, original.config.vocab_size, (2, 16))
    with torch.no_grad():
        before = original(ids).logits.clone()
    norm_type = type(original.model.layers[0].input_layernorm)
    model = quantize_model(original, fuse_norms=True)
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(layer.mlp, FusedSwiGLUMLP)
    dequantize_model(model)
    layer = model.model.layers[0]
    assert type(layer.input_layernorm) is norm_type and not isinstance(layer.mlp, FusedSwiGLUMLP)
    assert isinstance(layer.mlp.gate_proj, torch.nn.Linear) and not isinstance(layer.mlp.gate_proj, QuantLinear)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # bit-identical: same modules, same Parameters


def test_quantize_model_fuses_by_default_only_on_cuda_with_triton():
    model = quantize_model(_qwen3())
    fused = isinstance(model.model.layers[0].input_layernorm, FusedRMSNorm)
    assert fused == (torch.cuda.is_available() and triton_available())
    bf16_only = quantize_model(_qwen3(), train="bf16", rollout="bf16")
    assert not isinstance(bf16_only.model.layers[0].input_layernorm, FusedRMSNorm)
