"""The engine's settings (settings.py) and its per-layer plan (plan.py): no model run needed."""

from __future__ import annotations

import dataclasses

import pytest
from _trainer_utils import tokenizer
from torch.nn.attention import SDPBackend

from jetrl_trainer.kernels.settings import DecodeAttentionSettings
from jetrl_trainer.quant import quantize_model
from jetrl_trainer.quant.fused import fuse_norm_and_swiglu
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings
from jetrl_trainer.tiny import build_tiny_llama, build_tiny_qwen3

FUSED = ("input_norm=kernel+add qkv=grouped+sums_to_rope qk_norms={qk} attention=kernel o=sums_to_norm "
         "post_attention_norm=kernel+add gate_up=grouped mlp=swiglu_kernel down={down}")  # fmt: skip


def _fp8(build, **overrides):
    return fuse_norm_and_swiglu(quantize_model(build(tokenizer(), **overrides), train="fp8", rollout="fp8")).eval()


@pytest.fixture
def kernels_here(monkeypatch):
    """The kernel path allowed on CPU, with the norm and SwiGLU kernels counted as loaded (a plan needs
    no launch, and CI's core suite runs without Triton)."""
    from jetrl_trainer.rollout.engine import engine, plan

    monkeypatch.setattr(engine, "cuda_graphs_available", lambda device: True)
    monkeypatch.setattr(plan, "_kernel_loaded", lambda name: True)


def test_settings_are_frozen_and_refuse_unknown_choices():
    settings = EngineSettings()
    assert settings.decode_path is None and settings.attention_order is None
    assert settings.attention == DecodeAttentionSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.decode_path = "torch"
    assert dataclasses.replace(settings, decode_path="kernels").decode_path == "kernels"
    with pytest.raises(ValueError, match="decode_path must be one of graphs, kernels, torch, torch_graphs; got 'cuda'"):
        EngineSettings(decode_path="cuda")
    with pytest.raises(ValueError, match="attention_order must be None or one of CUDNN_ATTENTION, FLASH_ATTENTION"):
        EngineSettings(attention_order=SDPBackend.MATH)
    with pytest.raises(ValueError, match="must be a DecodeAttentionSettings"):
        EngineSettings(attention={"num_warps": 8})
    with pytest.raises(ValueError, match="decode_path='torch_graphs' captures the exact decode"):
        EngineSettings(decode_path="torch_graphs")
    for bad in (0, -64, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk must be a positive number of positions"):
            EngineSettings(prefill_chunk=bad)


def test_the_decode_path_resolves_for_the_device_and_the_kernels_are_refused_off_cuda():
    model = build_tiny_qwen3(tokenizer()).eval()
    assert DecodeEngine(model).settings.decode_path == "torch"  # CPU
    flash = EngineSettings(attention_order=SDPBackend.FLASH_ATTENTION)
    assert DecodeEngine(model, settings=flash).settings == dataclasses.replace(flash, decode_path="torch")
    for path in ("graphs", "kernels"):
        with pytest.raises(ValueError, match=f"decode_path='{path}' runs the engine's Triton kernels, which need CUDA"):
            DecodeEngine(model, settings=EngineSettings(decode_path=path))


def test_attention_order_names_the_tiles_of_another_backend():
    model = build_tiny_qwen3(tokenizer()).eval()
    assert DecodeEngine(model).attention_arithmetic == {}  # CPU: no training-forward backend to match
    engine = DecodeEngine(model, settings=EngineSettings(attention_order=SDPBackend.FLASH_ATTENTION))
    assert engine.attention_arithmetic == dict(block_n=64, flash_order=True)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_fp8_plan_of_a_tiny_model(arch, kernels_here):
    """FP8 with fused norms: every fusion on; the first layer's norm has no add to take, the last
    layer's down projection reduces its own sums (the final norm is HF's module)."""
    model = _fp8(build_tiny_qwen3 if arch == "qwen3" else build_tiny_llama)
    plan = DecodeEngine(model, settings=EngineSettings(decode_path="graphs")).plan
    qk = "rope" if arch == "qwen3" else "none"
    first = FUSED.format(qk=qk, down="sums_to_norm").replace("input_norm=kernel+add", "input_norm=kernel")
    assert [str(p) for p in plan.layers] == [first, FUSED.format(qk=qk, down="module")]
    assert str(plan) == f"layer 0: {first}\nlayer 1: {FUSED.format(qk=qk, down='module')}\nfinal norm: module"
    assert plan.summary() == {first: 1, FUSED.format(qk=qk, down="module"): 1}


def test_heads_of_128_let_the_attention_kernel_write_o_projections_fp8_input(kernels_here):
    plan = DecodeEngine(_fp8(build_tiny_qwen3, head_dim=128), settings=EngineSettings(decode_path="kernels")).plan
    assert {p.attention for p in plan.layers} == {"kernel+fp8"}


def test_lora_wrapped_projections_run_their_own_calls(kernels_here):
    """A LoRA layer adds adapters the grouped launch does not: q/k/v (q, v wrapped) run one by one and
    reduce their own sums, down reduces its own; gate/up, unwrapped, keep their grouped launch."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    model = _fp8(lambda tok, **kw: get_peft_model(build_tiny_qwen3(tok, head_dim=128), lora))
    plan = DecodeEngine(model, settings=EngineSettings(decode_path="kernels")).plan.layers[0]
    assert not (plan.grouped_qkv or plan.qkv_sums_to_rope or plan.down_sums_to_norm)
    assert plan.grouped_gate_up and plan.o_sums_to_norm and plan.attention == "kernel+fp8"


def test_models_without_the_fused_modules_plan_the_modules(kernels_here):
    """HF's own norms keep the module calls and reduce q/k/v before them; a BF16 model has nothing to
    group; the torch path plans the modules and SDPA everywhere."""
    hf_norms = quantize_model(build_tiny_qwen3(tokenizer()), train="fp8", rollout="fp8").eval()
    plan = DecodeEngine(hf_norms, settings=EngineSettings(decode_path="kernels")).plan.layers[0]
    assert (plan.input_norm, plan.qk_norms, plan.qkv_sums_to_rope, plan.o_sums_to_norm) == ("module", "modules", False, False)
    assert (plan.grouped_qkv, plan.grouped_gate_up, plan.mlp) == (True, True, "gated")  # HF's MLP, after grouped gate/up
    bf16 = DecodeEngine(build_tiny_llama(tokenizer()).eval(), settings=EngineSettings(decode_path="kernels")).plan
    assert str(bf16.layers[0]) == ("input_norm=module qkv=modules qk_norms=none attention=kernel o=module "
                                   "post_attention_norm=module gate_up=modules mlp=module down=module")  # fmt: skip
    torch_path = DecodeEngine(_fp8(build_tiny_qwen3), settings=EngineSettings(decode_path="torch")).plan
    assert {str(p) for p in torch_path.layers} == {
        "input_norm=module qkv=modules qk_norms=modules attention=torch o=module post_attention_norm=module "
        "gate_up=modules mlp=module down=module"
    }


def test_the_plan_is_in_every_calls_stats():
    from transformers import GenerationConfig

    engine = DecodeEngine(build_tiny_qwen3(tokenizer()).eval())
    config = GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0)
    engine.generate([[5, 6, 7]], config, eos_token_ids=[-1], seed=0)
    assert engine.last_stats["decode_path"] == "torch"
    assert engine.last_stats["layer_plans"] == engine.plan.summary() and sum(engine.plan.summary().values()) == 2
