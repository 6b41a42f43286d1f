"""The exact on-policy contract on the decode engine: every recorded log-prob is the training forward's, bit for bit.

The engine (``EngineSettings(exact=True)``) samples completions and records their log-probs; the
training forward (`training_logprobs`, as the trainer runs it) then scores the left-padded
``[prompt | completion]`` batch, with and without grad, in micro-batches of several sizes. The two
must be ``torch.equal`` on every completion token, for tiny Llama (llama3 RoPE), Qwen2 and Qwen3, the
FP8 and BF16 recipes, FP32 and BF16 master weights, under BF16 autocast or not, with LoRA, ragged
left-padded prompts, an EOS inside the batch, and any number of slots (refill). The same tests run
on CUDA (``gpu``). The FP8 KV cache: test_exact_fp8_kv.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _engine_contract import (
    BUILDERS,
    DEVICES,
    NEW_TOKENS,
    TEMPERATURE,
    assert_exact,
    autocast_for,
    eos_inside,
    rollout,
    tiny_model,
    training_batch,
)

from jetrl_trainer.scoring import generation_positions


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(BUILDERS))
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize(("master", "autocast"), [(torch.float32, False), (torch.bfloat16, False),
                                                  (torch.float32, True)])  # fmt: skip
def test_recorded_logprobs_are_the_training_forwards_bits(device, arch, recipe, master, autocast):
    model = tiny_model(arch, recipe, master, device)
    ac = autocast_for(device, autocast)
    eos = eos_inside(model, ac)
    tokens, recorded = rollout(model, autocast=ac, eos=eos)
    lengths = [len(t) for t in tokens]
    assert min(lengths) < NEW_TOKENS == max(lengths), "EOS must stop some rows and not others"
    assert_exact(model, tokens, recorded, autocast=ac, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_with_lora_adapters(device, recipe):
    model = tiny_model("qwen3", recipe, torch.float32, device, lora=True)
    tokens, recorded = rollout(model, autocast=contextlib.nullcontext)
    assert_exact(model, tokens, recorded, autocast=contextlib.nullcontext, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [1, 3])
def test_refill_with_fewer_slots_than_sequences(device, slots):
    """1 slot (one sequence at a time) and 3 slots (refilled as sequences finish) record the same
    bits as all slots at once, and those are the training forward's."""
    model = tiny_model("qwen3", "fp8", torch.float32, device)
    none = contextlib.nullcontext
    eos = eos_inside(model, none)
    everything = rollout(model, autocast=none, eos=eos)
    tokens, recorded = rollout(model, autocast=none, eos=eos, slots=slots)
    assert (tokens, recorded) == everything
    assert_exact(model, tokens, recorded, autocast=none, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize(("master", "autocast"), [(torch.bfloat16, False), (torch.float32, True)])
def test_the_tensor_core_attention_keeps_the_contract(kv_cache_dtype, master, autocast, monkeypatch):
    """``ExactAttentionSettings(dot="bf16")`` (the exact attention's products on tensor cores), set where
    both phases read it: the decode over the cache, the prefill and the training forward stay equal."""
    from jetrl_trainer.exact import ops
    from jetrl_trainer.kernels.settings import ExactAttentionSettings

    monkeypatch.setattr(ops, "ATTENTION", ExactAttentionSettings(dot="bf16"))
    model = tiny_model("qwen3", "fp8", master, "cuda")
    ac = autocast_for("cuda", autocast)
    tokens, recorded = rollout(model, autocast=ac, kv_cache_dtype=kv_cache_dtype)
    assert_exact(model, tokens, recorded, autocast=ac, device="cuda", kv_cache_dtype=kv_cache_dtype)


def test_without_the_exact_ops_the_bits_differ():
    """The check can fail: the same rollout scored by the plain forward (SDPA, BLAS) is not equal."""
    model = tiny_model("qwen3", "fp8", torch.float32, "cpu")
    tokens, recorded = rollout(model, autocast=contextlib.nullcontext)
    (ids, attention), mask, expected, width = training_batch(tokens, recorded, "cpu")
    with torch.no_grad(), generation_positions(model):
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=width + 1).logits[:, :-1].float()
    plain = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, ids[:, -width:, None])[..., 0]
    assert not torch.equal(plain[mask], expected[mask])
    assert torch.allclose(plain[mask], expected[mask], atol=1e-3)  # the same policy, other rounding
