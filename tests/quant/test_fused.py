"""quant/fused.py: the swap (Qwen3, Llama, LLaDA), numerics on CPU and GPU (the hand-off:
tests/quant/test_handoff.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetrl_trainer.kernels import triton_available
from jetrl_trainer.quant import QuantLinear, dequantize_model, quantize_fp8_groups, quantize_model
from jetrl_trainer.quant.fused import FusedRMSNorm, FusedSwiGLUMLP, fuse_norm_and_swiglu
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


class _SavesSharedPair(torch.autograd.Function):
    """A layer that saves a quantized input pair it shares with its siblings (as q/k/v save the fused
    norm's hand-off) and asks for the WGrad operand in backward."""

    @staticmethod
    def forward(ctx, x, q, s, results):
        ctx.save_for_backward(q, s)
        ctx.results = results
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        from jetrl_trainer.quant._dispatch import requant_transpose_fp8

        ctx.results.append(requant_transpose_fp8(*ctx.saved_tensors))
        return grad * 2, None, None, None


def test_wgrad_operand_is_computed_once_for_layers_that_share_an_input(monkeypatch):
    from jetrl_trainer.quant import _dispatch

    calls = []
    monkeypatch.setattr(_dispatch, "dequantize_fp8_groups",
                        lambda q, s, _f=_dispatch.dequantize_fp8_groups: calls.append(1) or _f(q, s))  # fmt: skip
    x = torch.randn(256, 384, requires_grad=True)
    q, s = quantize_fp8_groups(x.detach(), 128)
    before = set(_dispatch._requant_table())
    results = []
    outputs = [_SavesSharedPair.apply(x, q, s, results) for _ in range(3)]
    del q, s  # only the saved copies hold the pair now, as in a decoder layer
    sum(o.sum() for o in outputs).backward()
    assert len(calls) == 1 and len(results) == 3
    assert all(r[0] is results[0][0] and r[1] is results[0][1] for r in results)
    fresh = quantize_fp8_groups(_dispatch.dequantize_fp8_groups(*quantize_fp8_groups(x.detach(), 128)).t().contiguous(), 128)
    assert_bits_equal(results[0][0], fresh[0], "qt")
    assert_bits_equal(results[0][1], fresh[1], "st")
    assert set(_dispatch._requant_table()) <= before  # freed with the saved pair: nothing held after backward


def test_wgrad_operand_is_recomputed_for_a_modified_or_different_input():
    from jetrl_trainer.quant._dispatch import requant_transpose_fp8

    q, s = quantize_fp8_groups(torch.randn(128, 256), 128)
    first = requant_transpose_fp8(q, s)
    assert requant_transpose_fp8(q, s)[0] is first[0]
    s.mul_(2)  # same storage, new values: the scales' version moved
    second = requant_transpose_fp8(q, s)
    assert second[0] is not first[0] and torch.equal(second[1], first[1] * 2)
    assert requant_transpose_fp8(q[:64], s[:64])[0].shape == (256, 64)  # same pointer, another layout
    assert requant_transpose_fp8(q, s, "ue8m0")[0] is not second[0]


def test_wgrad_operand_memo_keeps_only_the_newest_entries():
    """A retained graph keeps every saved input alive; the memo still holds two operands, not one per layer."""
    from jetrl_trainer.quant import _dispatch

    pairs = [quantize_fp8_groups(torch.randn(128, 128), 128) for _ in range(4)]
    firsts = [_dispatch.requant_transpose_fp8(q, s)[0] for q, s in pairs]
    assert len(_dispatch._requant_table()) == 2
    assert _dispatch.requant_transpose_fp8(*pairs[3])[0] is firsts[3]  # the newest is still served
    assert _dispatch.requant_transpose_fp8(*pairs[0])[0] is not firsts[0]  # the oldest was dropped


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_qkv_backward_requant_transposes_the_shared_input_once_on_gpu(monkeypatch):
    """q/k/v behind one fused norm: one requant-transpose launch in backward, gradients bit for bit as
    with one launch per layer."""
    from jetrl_trainer.kernels import triton_quant
    from jetrl_trainer.quant import _dispatch

    torch.manual_seed(0)
    linears = [QuantLinear(512, n, bias=False).to("cuda", torch.bfloat16) for n in (512, 128, 128)]
    norm = FusedRMSNorm(torch.nn.Parameter(torch.ones(512, device="cuda", dtype=torch.bfloat16)), 1e-6, linears[0])
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def grads():
        for p in [x, norm.weight, *[lin.weight for lin in linears]]:
            p.grad = None
        h = norm(x)
        sum(lin(h).float().square().sum() for lin in linears).backward()
        return [p.grad.clone() for p in [x, norm.weight, *[lin.weight for lin in linears]]]

    calls = []
    real = triton_quant.requant_transpose_fp8
    monkeypatch.setattr(triton_quant, "requant_transpose_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
    shared = grads()
    assert len(calls) == 1
    monkeypatch.setattr(_dispatch, "_requant_table", lambda: None)  # one launch per layer, as before
    for got, want in zip(shared, grads()):
        assert_bits_equal(got, want, "grad")
    assert len(calls) == 4


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
@pytest.mark.parametrize("shape", [(64, 512), (8192, 128), (1037, 128), (33, 4096), (5, 100)])
def test_fused_rmsnorm_backward_matches_autograd_of_reference(shape):
    """Wide rows (one per tile) and narrow ones (Qwen3's per-head norms: 32 rows of 128 per tile, ragged
    last tile), against FP64 autograd through the reference: off by the BF16 rounding of dx and dw only."""
    m, k = shape
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = torch.nn.Parameter((torch.randn(k, device="cuda", generator=g) * 0.1 + 1).to(torch.bfloat16))
    dy = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    FusedRMSNorm(w, 1e-6)(x).backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rmsnorm_reference(x64, w64, 1e-6).backward(dy.double())
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad)):
        assert got.dtype == torch.bfloat16
        assert float((got.double() - want).norm() / want.norm()) < 4e-3  # BF16 rounding: <= 2^-9 per element


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
