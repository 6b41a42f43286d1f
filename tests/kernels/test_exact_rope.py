"""The fused exact RoPE (`kernels/triton_exact_rope.py`, what the Llama / Qwen2 / Qwen3 modeling modules'
``apply_rotary_pos_emb`` runs under `ExactOps` where Triton runs).

In the interpreter: transformers' eager function's bits (``torch.equal``) in BF16 and FP32, GQA head counts,
head_dim 64 and 128, the transposed layouts HF passes, and a position's bits the same in a launch of one
position and of many; through the mode, the attention modules' RoPE runs the kernel and its gradient is the
eager function's. On sm_90: it compiles, the FP32 variant without fused multiply-adds. On the GPU: the eager
bits, and a position's bits in launches of 1, 100 and 300 positions."""

from __future__ import annotations

import pytest
import torch
from _tensors import seeded_randn as _rand
from transformers.models.qwen3 import modeling_qwen3

HEADS = [(8, 2), (4, 4), (6, 1)]  # (query heads, key heads): GQA, MHA, MQA


def _cos_sin(b: int, t: int, d: int, dtype, device="cpu", start=0):
    """HF's rotary output ``(B, T, D)`` at positions ``start ..``: both halves the same angles."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    positions = torch.arange(start, start + t, dtype=torch.float32)[None, :, None] + torch.arange(b)[:, None, None] * 7
    angles = positions * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def _qk(b: int, t: int, heads: tuple[int, int], d: int, dtype, device="cpu"):
    """q and k as the attention modules pass them: ``(B, T, H, D)`` projections transposed to ``(B, H, T, D)``."""
    q = _rand(b, t, heads[0], d, dtype=dtype, device=device, seed=1) * 3
    k = _rand(b, t, heads[1], d, dtype=dtype, device=device, seed=2) * 3
    return q.transpose(1, 2), k.transpose(1, 2)


def _assert_eager_bits(q, k, cos, sin, unsqueeze_dim=1):
    from jetrl_trainer.kernels.triton_exact_rope import exact_rope

    got = exact_rope(q, k, cos, sin, unsqueeze_dim)
    expected = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)  # outside the mode: eager
    for out, want in zip(got, expected):
        assert out.dtype == want.dtype and out.shape == want.shape
        assert torch.equal(out, want), f"{int((out != want).sum())} of {out.numel()} elements differ"
    return got


def _assert_a_positions_bits_in_any_launch(q, k, cos, sin, counts):
    """Position ``t`` of every batch row rotated alone, and in launches of ``counts`` positions, alike."""
    from jetrl_trainer.kernels.triton_exact_rope import exact_rope

    full_q, full_k = exact_rope(q, k, cos, sin)
    for count in counts:
        for start in (0, q.shape[2] - count):
            part = slice(start, start + count)
            q_part, k_part = exact_rope(q[:, :, part], k[:, :, part], cos[:, part], sin[:, part])
            assert torch.equal(q_part, full_q[:, :, part]) and torch.equal(k_part, full_k[:, :, part]), (count, start)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS)
def test_it_gives_the_eager_functions_bits(dtype, head_dim, heads):
    for b, t in ((1, 1), (3, 5), (2, 19)):
        q, k = _qk(b, t, heads, head_dim, dtype)
        cos, sin = _cos_sin(b, t, head_dim, dtype, start=t * 11)
        q_out, _ = _assert_eager_bits(q, k, cos, sin)
        assert q_out.stride() == q.stride()  # eager's layout: the projections' (B, T, H, D) memory, transposed


@pytest.mark.interpreter
def test_it_takes_the_other_layouts_hf_passes():
    """cos / sin of one batch row broadcast over the batch, heads at dim 2 (``unsqueeze_dim=2``), contiguous
    and strided inputs, a head_dim that is not a power of two, and FP32 cos / sin with BF16 q / k (an FP32
    model under BF16 autocast: eager promotes to FP32)."""
    q, k = _qk(3, 9, (4, 2), 64, torch.bfloat16)
    cos, sin = _cos_sin(1, 9, 64, torch.bfloat16)
    _assert_eager_bits(q, k, cos, sin)
    _assert_eager_bits(q.contiguous(), k.contiguous(), cos, sin)
    _assert_eager_bits(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    _assert_eager_bits(q[..., :48], k[..., :48], cos[..., :48], sin[..., :48])  # D 48: a masked block
    cos32, sin32 = _cos_sin(1, 9, 64, torch.float32)
    q_out, k_out = _assert_eager_bits(q, k, cos32, sin32)
    assert q_out.dtype == k_out.dtype == torch.float32


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_positions_bits_do_not_depend_on_the_launch(dtype):
    q, k = _qk(2, 24, (4, 1), 128, dtype)
    cos, sin = _cos_sin(2, 24, 128, dtype)
    _assert_a_positions_bits_in_any_launch(q, k, cos, sin, counts=(1, 5, 24))


@pytest.mark.interpreter
def test_the_mode_runs_it_for_the_attention_and_differentiates_it(monkeypatch):
    """Inside `ExactOps` the modeling module's ``apply_rotary_pos_emb`` is one kernel call with the eager
    bits and the eager gradients; outside it the eager function runs."""
    from jetrl_trainer.exact import ExactOps, ops

    calls = []
    fused = ops._FusedRotary.apply
    monkeypatch.setattr(ops._FusedRotary, "apply", lambda *a: calls.append(a[0].shape) or fused(*a))
    q, k = (x.requires_grad_() for x in _qk(2, 6, (4, 2), 64, torch.float32))
    cos, sin = (x.requires_grad_() for x in _cos_sin(2, 6, 64, torch.float32))
    weights = torch.arange(64.0)
    with ExactOps.entered():
        got = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
        sum(((x * weights).sum() for x in got), torch.zeros(())).backward()
    assert calls == [q.shape]
    grads = [x.grad for x in (q, k, cos, sin)]
    for x in (q, k, cos, sin):
        x.grad = None
    expected = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    sum(((x * weights).sum() for x in expected), torch.zeros(())).backward()
    assert len(calls) == 1  # the eager function outside the mode
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.allclose(g, x.grad, rtol=1e-5, atol=1e-5) for g, x in zip(grads, (q, k, cos, sin)))


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpreter),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_its_gradient_for_q_and_k_keeps_only_cos_and_sin(dtype, device):
    """With tables that want no gradient (every model's case), the backward is the formula's transpose:
    it packs cos and sin for backward, not q and k, and its gradients match the eager formula's."""
    from jetrl_trainer.exact import ExactOps

    q, k = (x.requires_grad_() for x in _qk(2, 6, (4, 2), 64, dtype, device))
    cos, sin = _cos_sin(2, 6, 64, dtype, device)
    weights = torch.linspace(-1.0, 1.0, 64, dtype=dtype, device=device)
    packed = []
    with ExactOps.entered(), torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        got = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    assert len(packed) == 2 and all(any(p is t for t in (cos, sin)) for p in packed)
    sum(((x * weights).sum() for x in got), torch.zeros((), dtype=dtype, device=device)).backward()
    grads = [q.grad, k.grad]
    q.grad = k.grad = None
    expected = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    sum(((x * weights).sum() for x in expected), torch.zeros((), dtype=dtype, device=device)).backward()
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert all(g.dtype == dtype and torch.allclose(g, x.grad, rtol=tolerance, atol=tolerance)
               for g, x in zip(grads, (q, k)))


@pytest.mark.sm90
def test_it_compiles_for_sm90():
    from _sm90 import compile_sm90

    from jetrl_trainer.kernels._triton_exact_rope_jit import exact_rope_kernel

    for x, c in (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32")):
        out = "fp32" if "fp32" in (x, c) else x
        ptx = compile_sm90(exact_rope_kernel, dict(q_ptr=f"*{x}", k_ptr=f"*{x}", cos_ptr=f"*{c}", sin_ptr=f"*{c}",
                                                   q_out_ptr=f"*{out}", k_out_ptr=f"*{out}"),
                           dict(HALF=64, BLOCK_D=128), launch=dict(num_warps=1, enable_fp_fusion=False),
                           odd=("T",))  # fmt: skip
        assert ".entry" in ptx and "fma" not in ptx  # eager's separate roundings: no fused multiply-add


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_eager_bits_and_a_positions_bits_in_any_launch_on_the_gpu(dtype):
    for head_dim, heads in ((128, (32, 8)), (64, (14, 2))):
        q, k = _qk(3, 300, heads, head_dim, dtype, device="cuda")
        cos, sin = _cos_sin(3, 300, head_dim, dtype, device="cuda", start=4000)
        _assert_eager_bits(q, k, cos, sin)
        _assert_a_positions_bits_in_any_launch(q, k, cos, sin, counts=(1, 100, 300))
