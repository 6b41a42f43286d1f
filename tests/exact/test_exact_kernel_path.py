"""The exact contract through the CUDA attention kernel's wiring, in Triton's interpreter on CPU.

Under ``TRITON_INTERPRET=1`` the exact ops run `kernels/triton_exact_attention.py` (and the RMSNorms'
`kernels/triton_exact_rmsnorm.py`, RoPE's `kernels/triton_exact_rope.py`) on CPU tensors, as they do on CUDA: the training forward through the autograd Function (key runs read from the mask),
the engine's decode over its cache in place (slots, FP8 values and scales). The recorded log-probs
must still be the training forward's bits, and the gradient must flow (the backward is torch's fused
attention's, recomputed). The GPU runs the same wiring in tests/exact/test_exact_contract.py and test_exact_fp8_kv.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _engine_contract import assert_exact, rollout, tiny_model

from jetrl_trainer.exact import ExactOps, ops

NONE = contextlib.nullcontext
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 90)), [5, 6, 7, 8, 9]]


@pytest.mark.interpreter
@pytest.mark.parametrize(("recipe", "kv"), [("bf16", "auto"), ("fp8", "fp8")])
@pytest.mark.parametrize("split_keys", [0, 64], ids=["whole", "split64"])  # the 70-token prompt: two splits
def test_the_kernel_path_keeps_the_contract(recipe, kv, split_keys, monkeypatch):
    import dataclasses

    monkeypatch.setattr(ops, "ATTENTION", dataclasses.replace(ops.ATTENTION, split_keys=split_keys))
    calls = {"training": 0, "decode": 0}
    for name, key in (("_KernelAttention", "training"), ("exact_attention_over_runs", "decode")):
        original = getattr(ops, name)
        if name == "_KernelAttention":
            monkeypatch.setattr(ops._KernelAttention, "apply", _counting(original.apply, calls, key))
        else:
            import jetrl_trainer.rollout.engine.attention as attention

            monkeypatch.setattr(attention, name, _counting(original, calls, key))
    norms, ropes = {"calls": 0}, {"calls": 0}
    monkeypatch.setattr(ops._FusedRMSNorm, "apply", _counting(ops._FusedRMSNorm.apply, norms, "calls"))
    monkeypatch.setattr(ops._FusedRotary, "apply", _counting(ops._FusedRotary.apply, ropes, "calls"))
    model = tiny_model("qwen3", recipe, torch.float32, "cpu", num_hidden_layers=1)
    tokens, recorded = rollout(model, autocast=NONE, prompts=PROMPTS, new_tokens=6, kv_cache_dtype=kv)
    in_rollout, ropes_in_rollout = norms["calls"], ropes["calls"]
    assert_exact(model, tokens, recorded, autocast=NONE, device="cpu", prompts=PROMPTS, kv_cache_dtype=kv,
                 micro_batches=((True, 3),))  # fmt: skip
    assert calls["decode"] > 0 and calls["training"] > 0  # both phases ran the attention kernel
    assert 0 < in_rollout < norms["calls"]  # and the RMSNorms' fused kernel
    assert 0 < ropes_in_rollout < ropes["calls"]  # and RoPE's


@pytest.mark.interpreter
def test_gradients_flow_through_the_kernel():
    q, k, v = (torch.randn(1, 2, 20, 16, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(3))
    valid = torch.ones(20, 20, dtype=torch.bool).tril()[None]
    with ExactOps.entered():
        out = ops.exact_attention(q, k, v, valid, 0.25)
    expected = ops._torch_attention(q, k, v, valid, 0.25)
    assert torch.allclose(out, expected, atol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))))


@pytest.mark.interpreter
def test_the_backward_inside_the_mode_is_torchs_attention_not_the_exact_ops(monkeypatch):
    """The trainer's backward runs under `ExactOps` (checkpointing recomputes there): the attention's
    gradient must still be torch's fused attention, not the exact ops' invariant products (whose FP32
    path is the slowest kernel there is), and correct, padding queries included."""
    products = []
    invariant = ops._invariant_matmul
    monkeypatch.setattr(ops, "_invariant_matmul", lambda a, b: products.append(a.shape) or invariant(a, b))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 24, 16, generator=g).requires_grad_() for n in (4, 2, 2))
    valid = torch.ones(24, 24, dtype=torch.bool).tril()[None].repeat(2, 1, 1)
    valid[1, :, :5] = False  # left padding: row 1's first 5 queries read no key
    weights = torch.randn(2, 4, 24, 16, generator=g)
    weights[1, :, :5] = 0
    with ExactOps.entered():
        (ops.exact_attention(q, k, v, valid, 0.25) * weights).sum().backward()
    assert products == []
    grads = q.grad, k.grad, v.grad
    expected = torch.autograd.grad((ops._torch_attention(q, k, v, valid, 0.25) * weights).sum(), (q, k, v))
    assert all(torch.isfinite(g).all() and torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, expected))


def _counting(fn, calls, key):
    def counted(*args, **kwargs):
        calls[key] += 1
        return fn(*args, **kwargs)

    return counted
