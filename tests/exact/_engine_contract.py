"""The exact contract's cases, shared by this folder's tests: tiny models, the engine's rollout, and the
check that the training forward's log-probs equal the recorded ones bit for bit.

``kv_cache_dtype="fp8"``: the engine stores keys and values in FP8, and the training forward reads
them through the same rounding (`fp8_kv_roundtrip`, `ExactOps`' ``kv_roundtrip``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import GenerationConfig

from jetrl_trainer.exact import training_logprobs
from jetrl_trainer.quant import PrecisionPhases, quantize_model
from jetrl_trainer.rollout import left_pad
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings, kv_roundtrip
from jetrl_trainer.scoring import generation_positions
from jetrl_trainer.tiny import build_tiny_llama, build_tiny_qwen2, build_tiny_qwen3, build_tiny_tokenizer

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # fmt: skip
BUILDERS = {
    "llama3-rope": lambda tok, **kw: build_tiny_llama(tok, rope_parameters=LLAMA3_ROPE, **kw),
    "qwen2": build_tiny_qwen2,
    "qwen3": build_tiny_qwen3,
}
# Ragged prompts; repeated ones (GRPO's generations) and one longer than an attention tile (64 keys).
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [5, 6, 7, 8, 9], [10, 11], list(range(20, 90)), [30, 31, 32]]
TEMPERATURE = 0.7
NEW_TOKENS = 24
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

TOKENIZER = build_tiny_tokenizer()


def tiny_model(arch, recipe, master, device, lora=False, **overrides):
    model = BUILDERS[arch](TOKENIZER, dtype=master, **overrides).to(device)
    if lora:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
            model = get_peft_model(model, config)
    quantize_model(model, train=recipe, rollout=recipe)
    return model.eval()


def rollout(model, *, autocast, slots=None, eos=(-1,), prompts=PROMPTS, new_tokens=NEW_TOKENS, budgets=None,
            kv_cache_dtype="auto", prefill_chunk=1024):  # fmt: skip
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                              pad_token_id=TOKENIZER.pad_token_id)  # fmt: skip
    settings = EngineSettings(exact=True, prefill_chunk=prefill_chunk)
    engine = DecodeEngine(model, settings=settings, kv_cache_dtype=kv_cache_dtype)
    with PrecisionPhases(model).rollout(), torch.no_grad(), autocast():
        return engine.generate(prompts, config, eos_token_ids=list(eos), seed=3, pad_token_id=TOKENIZER.pad_token_id,
                               max_batch_size=slots, row_budgets=budgets)  # fmt: skip


def eos_inside(model, autocast):
    """A token the free-running rollout samples early in some rows and not in others: as EOS it stops
    some rows mid-way and leaves others to run to the budget."""
    tokens, _ = rollout(model, autocast=autocast)
    for candidate in (t for row in tokens for t in row[1:8]):
        stops = [candidate in row for row in tokens]
        if any(stops) and not all(stops):
            return [candidate]
    raise AssertionError("no token stops some rows and not others")


def training_batch(tokens, recorded, device, prompts=PROMPTS):
    prompt_ids, prompt_mask = left_pad(prompts, TOKENIZER.pad_token_id)
    width = max(map(len, tokens))
    ids = torch.full((len(tokens), width), TOKENIZER.pad_token_id)
    mask, expected = torch.zeros_like(ids), torch.zeros(len(tokens), width)
    for row, (t, lp) in enumerate(zip(tokens, recorded)):
        ids[row, : len(t)], mask[row, : len(t)], expected[row, : len(t)] = torch.tensor(t), 1, torch.tensor(lp)
    inputs = torch.cat([prompt_ids, ids], 1).to(device), torch.cat([prompt_mask, mask], 1).to(device)
    return inputs, mask.bool(), expected, width


def training_forward(model, tokens, recorded, *, autocast, device, grad, batch_size, prompts=PROMPTS,
                     kv_cache_dtype="auto", prefill_chunk=1024):  # fmt: skip
    """The training forward's log-probs of the rollout ``(B, T)`` on CPU, the completion mask and the recorded ones."""
    (ids, attention), mask, expected, width = training_batch(tokens, recorded, device, prompts)
    with torch.set_grad_enabled(grad), generation_positions(model):
        logps, _, _ = training_logprobs(model, ids, attention, width, temperature=TEMPERATURE, batch_size=batch_size,
                                        autocast=autocast, kv_roundtrip=kv_roundtrip(kv_cache_dtype))  # fmt: skip
    return logps.detach().float().cpu(), mask, expected


def assert_exact(model, tokens, recorded, *, autocast, device, prompts=PROMPTS, kv_cache_dtype="auto",
                 micro_batches=None):  # fmt: skip
    """Equal bits with and without grad, the whole batch at once and in micro-batches."""
    for grad, batch_size in micro_batches or ((False, len(tokens)), (False, 2), (True, 3)):
        got, mask, expected = training_forward(model, tokens, recorded, autocast=autocast, device=device, grad=grad,
                                               batch_size=batch_size, prompts=prompts, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        assert torch.equal(got[mask], expected[mask]), (
            f"grad={grad} batch_size={batch_size}: {int((got[mask] != expected[mask]).sum())} of {int(mask.sum())} "
            f"tokens differ, largest {float((got[mask] - expected[mask]).abs().max()):.3g}"
        )


def autocast_for(device, on):
    return (lambda: torch.autocast(device, dtype=torch.bfloat16)) if on else contextlib.nullcontext
