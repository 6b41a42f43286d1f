"""The exact on-policy contract on the decode engine: every recorded log-prob is the training forward's, bit for bit.

The engine (``EngineSettings(exact=True)``) samples completions and records their log-probs; the
training forward (`training_logprobs`, as the trainer runs it) then scores the left-padded
``[prompt | completion]`` batch, with and without grad, in micro-batches of several sizes. The two
must be ``torch.equal`` on every completion token, for tiny Llama (llama3 RoPE), Qwen2 and Qwen3, the
FP8 and BF16 recipes, FP32 and BF16 master weights, under BF16 autocast or not, with LoRA, ragged
left-padded prompts, an EOS inside the batch, and any number of slots (refill). The same tests run
on CUDA (``gpu``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import GenerationConfig

from jetrl_trainer.exact import training_logprobs
from jetrl_trainer.quant import PrecisionPhases, quantize_model
from jetrl_trainer.rollout import left_pad
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings
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

_tokenizer = build_tiny_tokenizer()


def _model(arch, recipe, master, device, lora=False):
    model = BUILDERS[arch](_tokenizer, dtype=master).to(device)
    if lora:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
            model = get_peft_model(model, config)
    quantize_model(model, train=recipe, rollout=recipe)
    return model.eval()


def _rollout(model, *, autocast, slots=None, eos=(-1,)):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                              pad_token_id=_tokenizer.pad_token_id)  # fmt: skip
    engine = DecodeEngine(model, settings=EngineSettings(exact=True))
    with PrecisionPhases(model).rollout(), torch.no_grad(), autocast():
        return engine.generate(PROMPTS, config, eos_token_ids=list(eos), seed=3, pad_token_id=_tokenizer.pad_token_id,
                               max_batch_size=slots)  # fmt: skip


def _eos_inside(model, autocast):
    """A token the free-running rollout samples early in some rows and not in others: as EOS it stops
    some rows mid-way and leaves others to run to the budget."""
    tokens, _ = _rollout(model, autocast=autocast)
    for candidate in (t for row in tokens for t in row[1:8]):
        stops = [candidate in row for row in tokens]
        if any(stops) and not all(stops):
            return [candidate]
    raise AssertionError("no token stops some rows and not others")


def _training_batch(tokens, recorded, device):
    prompt_ids, prompt_mask = left_pad(PROMPTS, _tokenizer.pad_token_id)
    width = max(map(len, tokens))
    ids = torch.full((len(tokens), width), _tokenizer.pad_token_id)
    mask, expected = torch.zeros_like(ids), torch.zeros(len(tokens), width)
    for row, (t, lp) in enumerate(zip(tokens, recorded)):
        ids[row, : len(t)], mask[row, : len(t)], expected[row, : len(t)] = torch.tensor(t), 1, torch.tensor(lp)
    inputs = torch.cat([prompt_ids, ids], 1).to(device), torch.cat([prompt_mask, mask], 1).to(device)
    return inputs, mask.bool(), expected, width


def _assert_exact(model, tokens, recorded, *, autocast, device):
    (ids, attention), mask, expected, width = _training_batch(tokens, recorded, device)
    for grad, batch_size in ((False, len(tokens)), (False, 2), (True, 3)):
        with torch.set_grad_enabled(grad), generation_positions(model):
            logps, _, _ = training_logprobs(model, ids, attention, width, temperature=TEMPERATURE,
                                            batch_size=batch_size, autocast=autocast)  # fmt: skip
        got = logps.detach().float().cpu()
        assert torch.equal(got[mask], expected[mask]), (
            f"grad={grad} batch_size={batch_size}: {int((got[mask] != expected[mask]).sum())} of {int(mask.sum())} "
            f"tokens differ, largest {float((got[mask] - expected[mask]).abs().max()):.3g}"
        )


def _autocast(device, on):
    return (lambda: torch.autocast(device, dtype=torch.bfloat16)) if on else contextlib.nullcontext


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(BUILDERS))
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize(("master", "autocast"), [(torch.float32, False), (torch.bfloat16, False),
                                                  (torch.float32, True)])  # fmt: skip
def test_recorded_logprobs_are_the_training_forwards_bits(device, arch, recipe, master, autocast):
    model = _model(arch, recipe, master, device)
    ac = _autocast(device, autocast)
    eos = _eos_inside(model, ac)
    tokens, recorded = _rollout(model, autocast=ac, eos=eos)
    lengths = [len(t) for t in tokens]
    assert min(lengths) < NEW_TOKENS == max(lengths), "EOS must stop some rows and not others"
    _assert_exact(model, tokens, recorded, autocast=ac, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_with_lora_adapters(device, recipe):
    model = _model("qwen3", recipe, torch.float32, device, lora=True)
    tokens, recorded = _rollout(model, autocast=contextlib.nullcontext)
    _assert_exact(model, tokens, recorded, autocast=contextlib.nullcontext, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [1, 3])
def test_refill_with_fewer_slots_than_sequences(device, slots):
    """1 slot (one sequence at a time) and 3 slots (refilled as sequences finish) record the same
    bits as all slots at once, and those are the training forward's."""
    model = _model("qwen3", "fp8", torch.float32, device)
    none = contextlib.nullcontext
    eos = _eos_inside(model, none)
    everything = _rollout(model, autocast=none, eos=eos)
    tokens, recorded = _rollout(model, autocast=none, eos=eos, slots=slots)
    assert (tokens, recorded) == everything
    _assert_exact(model, tokens, recorded, autocast=none, device=device)


def test_without_the_exact_ops_the_bits_differ():
    """The check can fail: the same rollout scored by the plain forward (SDPA, BLAS) is not equal."""
    model = _model("qwen3", "fp8", torch.float32, "cpu")
    tokens, recorded = _rollout(model, autocast=contextlib.nullcontext)
    (ids, attention), mask, expected, width = _training_batch(tokens, recorded, "cpu")
    with torch.no_grad(), generation_positions(model):
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=width + 1).logits[:, :-1].float()
    plain = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, ids[:, -width:, None])[..., 0]
    assert not torch.equal(plain[mask], expected[mask])
    assert torch.allclose(plain[mask], expected[mask], atol=1e-3)  # the same policy, other rounding
