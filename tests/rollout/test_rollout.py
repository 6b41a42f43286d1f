"""Rollout: sampling log-probs equal a teacher-forced forward under the same precision and warpers.

Tolerance: 1e-4 nats per token. The teacher-forced forward uses the trainer's batch layout
(left-padded prompts, right-padded completions, the whole batch at once): then generation with a
KV cache and the full forward differ only by attention summation order, ~5e-7 on the tiny models in
FP32, FP8 and NVFP4 alike. (Scoring one row alone instead can land a value on the other side of an
FP8 rounding boundary and move a log-prob by ~1e-3: quantized forwards are discontinuous, which is
why the trainer scores the batch as it was generated.) A recorder that skipped the temperature or
the truncation would be off by > 1e-1.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from jetrl_trainer.quant import PrecisionPhases, count_quant_gemms, quantize_model
from jetrl_trainer.rollout import (
    HFGenerateBackend,
    SampledLogprobRecorder,
    generate_batch_with_logprobs,
    left_pad,
    processed_logprobs,
    split_sampling_config,
    truncate_after_eos,
)
from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

TOL = 1e-4
WARP = dict(temperature=0.7, top_k=12, top_p=0.9)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _model(tok, precision: str):
    torch.manual_seed(0)
    model = build_tiny_qwen3(tok).eval()
    if precision != "none":
        quantize_model(model, train="bf16", rollout=precision)  # the two phases differ on purpose
    return model


def _gen_config(tok, max_new_tokens=10, **warp):
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, **{**WARP, **warp},
    )  # fmt: skip


def _hf(tok) -> HFGenerateBackend:
    return HFGenerateBackend(pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])


def _teacher_forced(model, prompts, completions, pad_token_id=0, **warp):
    """Log-probs of ``completions`` scored in one forward, laid out as the trainer lays them out."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    width = max(len(c) for c in completions)
    comp_ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    comp_mask = torch.zeros_like(comp_ids)
    for row, c in enumerate(completions):
        comp_ids[row, : len(c)], comp_mask[row, : len(c)] = torch.tensor(c), 1
    input_ids, mask = torch.cat([prompt_ids, comp_ids], 1), torch.cat([prompt_mask, comp_mask], 1)
    logits = model(input_ids, attention_mask=mask).logits[:, prompt_ids.size(1) - 1 : -1]
    logps = processed_logprobs(logits, comp_ids, **warp)
    return [logps[row, : len(c)] for row, c in enumerate(completions)]


def test_recorder_picks_each_sampled_token_one_step_late():
    rec = SampledLogprobRecorder()
    s0 = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0]])
    s1 = torch.tensor([[1.0, 1.0, 1.0], [0.0, 3.0, 0.0]])
    assert rec(torch.tensor([[7], [7]]), s0) is s0  # scores pass through untouched
    rec(torch.tensor([[7, 2], [7, 0]]), s1)  # step 0 sampled tokens 2 and 0
    seqs = torch.tensor([[7, 2, 1], [7, 0, 1]])  # step 1 sampled tokens 1 and 1
    got = rec.finish(seqs, 2)
    want = torch.stack(
        [torch.log_softmax(s0, -1)[[0, 1], [2, 0]], torch.log_softmax(s1, -1)[[0, 1], [1, 1]]], dim=1
    )
    torch.testing.assert_close(got, want)
    assert rec.finish(seqs[:, :1], 0).shape == (2, 0)  # reset after finish


def test_recorder_refuses_when_steps_are_missing():
    with pytest.raises(RuntimeError, match="last logits processor"):
        SampledLogprobRecorder().finish(torch.zeros(1, 3, dtype=torch.long), 2)


def test_split_moves_warpers_out_and_neutralises_the_config(tok):
    stripped, warpers = split_sampling_config(_gen_config(tok, temperature=0.5, top_k=4, top_p=0.8, min_p=0.05))
    assert [type(w).__name__ for w in warpers] == [
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    ]  # fmt: skip
    assert (stripped.temperature, stripped.top_k, stripped.top_p, stripped.min_p) == (1.0, 0, 1.0, None)
    _, none = split_sampling_config(_gen_config(tok, temperature=1.0, top_k=0, top_p=1.0))
    assert len(none) == 0


@pytest.mark.parametrize(
    "bad, fragment",
    [(dict(do_sample=False), "do_sample=True"), (dict(typical_p=0.5), "typical_p"), (dict(num_beams=2), "num_beams")],
)
def test_split_refuses_what_it_cannot_record(tok, bad, fragment):
    config = _gen_config(tok)
    for key, value in bad.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=fragment):
        split_sampling_config(config)


def test_left_pad_and_truncate_after_eos():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0, pad_to_multiple_of=4)
    assert ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    comp = torch.tensor([[3, 1, 4, 1], [2, 2, 2, 2]])
    lps = torch.tensor([[-0.1, -0.2, -0.3, -0.4], [-1.0, -2.0, -3.0, -4.0]])
    ids_out, lps_out = truncate_after_eos(comp, lps, eos_token_ids=[1, 9])
    assert ids_out == [[3, 1], [2, 2, 2, 2]]
    assert lps_out[0] == pytest.approx([-0.1, -0.2])
    assert lps_out[1] == pytest.approx([-1.0, -2.0, -3.0, -4.0])


@pytest.mark.parametrize("precision", ["none", "fp8", "nvfp4"])
def test_generate_logprobs_match_teacher_forced_forward(tok, precision):
    model = _model(tok, precision)
    prompts = [tok.encode("12+7="), tok.encode("3*45="), tok.encode("100-1="), tok.encode("9=")]  # ragged
    torch.manual_seed(1)
    with PrecisionPhases(model).rollout(), count_quant_gemms() as counts:
        rollout = _hf(tok).generate(model, prompts, _gen_config(tok))
        ids, lps = rollout.completion_ids, rollout.logprobs
    if precision != "none":
        assert set(counts) == {("rollout", precision)}
    assert [len(x) for x in ids] == [len(x) for x in lps] and all(len(x) > 0 for x in ids)
    with torch.no_grad(), PrecisionPhases(model).rollout():
        ref = _teacher_forced(model, prompts, ids, tok.pad_token_id, **WARP)
        raw = _teacher_forced(model, prompts, ids, tok.pad_token_id)  # no warpers: a recorder that skipped them
    for got, want, unwarped in zip(lps, ref, raw):
        assert (torch.tensor(got) - want).abs().max().item() < TOL
        assert (torch.tensor(got) - unwarped).abs().max().item() > 0.1
    if precision != "none":  # the same tokens under the other phase's precision really differ
        with torch.no_grad(), PrecisionPhases(model).train():
            train = _teacher_forced(model, prompts, ids, tok.pad_token_id, **WARP)
        assert max((torch.tensor(g) - t).abs().max().item() for g, t in zip(lps, train)) > 10 * TOL


def test_top_k_one_is_greedy_with_zero_logprob(tok):
    model = _model(tok, "none")
    prompts = [tok.encode("7-2=")]
    lps = _hf(tok).generate(model, prompts, _gen_config(tok, top_k=1)).logprobs
    assert lps[0] == pytest.approx([0.0] * len(lps[0]), abs=1e-6)


def test_continuous_batching_logprobs_in_rollout_precision(tok):
    from transformers.generation import ContinuousBatchingConfig

    model = _model(tok, "fp8")
    prompts = [tok.encode("1+1="), tok.encode("20/4=")]
    cb = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64)
    torch.manual_seed(0)
    # The engine runs the model in its own thread: the phase is the model's, so the caller's block reaches it.
    with PrecisionPhases(model).rollout(), count_quant_gemms() as counts:
        ids, lps = generate_batch_with_logprobs(model, prompts, _gen_config(tok, max_new_tokens=6), cb)
    assert cb.return_logprobs is False  # the caller's config is not mutated
    assert counts[("rollout", "fp8")] > 0 and not any(phase == "train" for phase, _ in counts)
    with torch.no_grad(), PrecisionPhases(model).rollout():
        ref = _teacher_forced(model, prompts, ids, tok.pad_token_id, **WARP)
    for got, want in zip(lps, ref):
        assert len(got) == len(want) > 0
        assert (torch.tensor(got) - want).abs().max().item() < TOL
