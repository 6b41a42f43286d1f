"""The RMSNorm and RoPE wrappers `ExactOps` installs (jetrl_trainer/exact/fused_modules.py), on CPU without
Triton's interpreter: the original runs outside the mode, and inside it where the fused kernels do not
run (CPU tensors), with the original's bits; installing twice wraps once. The kernels' own tests, and
the wrappers running them, are in tests/kernels/test_exact_rope.py and test_exact_rmsnorm.py."""

from __future__ import annotations

import pytest
import torch
from _tensors import seeded_randn as _rand
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from jetrl_trainer.exact import ExactOps, fused_modules, ops

MODELING = (modeling_llama, modeling_qwen2, modeling_qwen3)
NORMS = (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm, modeling_qwen3.Qwen3RMSNorm)


@pytest.fixture
def no_interpreter(monkeypatch):
    """CPU tensors are not the kernels' device (`ops._on_kernel_device`) and the kernels are never called."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for fused in (ops._FusedRotary, ops._FusedRMSNorm):
        monkeypatch.setattr(fused, "apply", lambda *a: pytest.fail(f"a kernel ran on CPU: {a[0].shape}"))


def _rope_inputs(dtype):
    q = _rand(2, 5, 4, 64, dtype=dtype, seed=1).transpose(1, 2)
    k = _rand(2, 5, 2, 64, dtype=dtype, seed=2).transpose(1, 2)
    angles = _rand(2, 5, 64, seed=3) * 20
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_rope_wrapper_runs_the_original_outside_the_mode_and_off_the_kernels_device(dtype, no_interpreter):
    with ExactOps.entered():  # installs the wrappers
        pass
    for module in MODELING:
        wrapper = module.apply_rotary_pos_emb
        assert wrapper._jetrl_fused_rope
        inputs = _rope_inputs(dtype)
        expected = wrapper.__wrapped__(*inputs)
        with ExactOps.entered():
            inside = wrapper(*inputs)
        outside = wrapper(*inputs)
        for got in (inside, outside):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_installing_twice_wraps_once(monkeypatch, no_interpreter):
    fused_modules.install_fused_modules()
    wrapped = [m.apply_rotary_pos_emb for m in MODELING]
    norms = [cls.forward for cls in NORMS]
    monkeypatch.setattr(fused_modules, "_installed", False)  # the marks alone must keep a second wrapper off
    fused_modules.install_fused_modules()
    assert [m.apply_rotary_pos_emb for m in MODELING] == wrapped
    assert [cls.forward for cls in NORMS] == norms
    for rope in wrapped:
        assert rope._jetrl_fused_rope and not getattr(rope.__wrapped__, "_jetrl_fused_rope", False)
    for forward in norms:
        assert forward._jetrl_fused_norm and not getattr(forward.__wrapped__, "_jetrl_fused_norm", False)
