"""Rollout backends as objects: the choice (`rollout_backend`), and log-probs where none can be recorded.

When a backend cannot record what its sampler drew from (beam search, greedy decoding, a stub or
wrapper of ``generate`` that drops our recorder), the trainer scores the completions with a
rollout-phase forward under the same warpers. That must mean the same as a recorded log-prob: on a
batch where both exist they agree to the tolerance of tests/rollout/test_rollout.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _trainer_utils import make_args, make_trainer, tiny_model, tokenizer, train
from transformers import GenerationConfig

from jetrl_trainer import JetGRPOConfig
from jetrl_trainer._composition import resolve_rollout_backend
from jetrl_trainer.quant import quantize_model
from jetrl_trainer.rollout import ROLLOUT_BACKENDS, ContinuousBatchingBackend, HFGenerateBackend, left_pad
from jetrl_trainer.scoring import AutoregressiveScorer

TOL = 1e-4


# ------------------------------------------------------------------ choosing a backend


@pytest.mark.parametrize(
    "requested, diffusion, cb, cuda, expected",
    [
        ("auto", False, False, False, "hf"),
        ("auto", False, False, True, "engine"),
        ("auto", False, True, True, "continuous"),
        ("hf", False, False, True, "hf"),
        ("engine", False, False, False, "engine"),
        ("continuous", False, True, False, "continuous"),
        ("auto", True, False, True, "diffusion"),
        ("diffusion", True, False, False, "diffusion"),
    ],
)
def test_auto_and_explicit_choices(requested, diffusion, cb, cuda, expected):
    name, why = resolve_rollout_backend(requested, diffusion=diffusion, continuous_batching=cb, cuda=cuda)
    assert name == expected and why


@pytest.mark.parametrize(
    "requested, diffusion, cb, message",
    [
        ("diffusion", False, False, "needs a masked-diffusion LM"),
        ("hf", True, False, "cannot sample a diffusion LM"),
        ("engine", True, False, "cannot sample a diffusion LM"),
        ("continuous", True, True, "autoregressive models only"),
        ("auto", True, True, "autoregressive models only"),
    ],
)
def test_a_backend_that_cannot_serve_the_model_is_refused(requested, diffusion, cb, message):
    with pytest.raises(ValueError, match=message):
        resolve_rollout_backend(requested, diffusion=diffusion, continuous_batching=cb)


def test_config_field_validates_once(tmp_path):
    assert ROLLOUT_BACKENDS == ("auto", "hf", "continuous", "engine", "vllm", "diffusion")
    assert make_args(tmp_path).rollout_backend == "auto"
    assert make_args(tmp_path, rollout_backend=" HF ").rollout_backend == "hf"
    assert make_args(tmp_path, rollout_backend="continuous").use_transformers_continuous_batching
    with pytest.raises(ValueError, match="rollout_backend must be one of"):
        make_args(tmp_path, rollout_backend="sglang")
    assert make_args(tmp_path, rollout_backend="vllm", rollout_precision="bf16").use_vllm  # tests/rollout/test_vllm*.py
    assert make_args(tmp_path, rollout_backend="engine", rollout_kv_cache_tokens=64).rollout_kv_cache_tokens == 64
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="rollout_kv_cache_tokens must be a positive integer"):
            make_args(tmp_path, rollout_backend="engine", rollout_kv_cache_tokens=bad)
    assert make_args(tmp_path, rollout_backend="engine", rollout_kv_cache_gib=40).rollout_kv_cache_gib == 40
    for bad in (0, -1.5, float("inf"), float("nan"), True, "40"):
        with pytest.raises(ValueError, match="rollout_kv_cache_gib must be a positive number of GiB"):
            make_args(tmp_path, rollout_backend="engine", rollout_kv_cache_gib=bad)
    with pytest.raises(ValueError, match="contradicts rollout_backend='hf'"):
        make_args(tmp_path, rollout_backend="hf", use_transformers_continuous_batching=True)


def test_trainer_logs_its_choice_once(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="jetrl_trainer"):
        trainer = make_trainer(tmp_path)
    choices = [r.getMessage() for r in caplog.records if "rollout backend" in r.getMessage()]
    assert choices == ["jetrl: rollout backend 'hf' (transformers generate off CUDA (the engine's CPU path is plain "
                       "torch, for checking; rollout_backend='engine' opts in))"]  # fmt: skip
    assert isinstance(trainer.rollout_backend, HFGenerateBackend)
    cb = make_trainer(tmp_path, rollout_backend="continuous")
    assert isinstance(cb.rollout_backend, ContinuousBatchingBackend)


# ------------------------------------------------------------------ when nothing can be recorded


def _gen_config(**overrides) -> GenerationConfig:
    tok = tokenizer()
    base = dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=12, top_p=0.9,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    return GenerationConfig(**{**base, **overrides})


def _backend() -> HFGenerateBackend:
    return HFGenerateBackend(pad_token_id=tokenizer().pad_token_id, eos_token_ids=[tokenizer().eos_token_id])


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.mark.parametrize(
    "overrides, reason",
    [(dict(num_beams=2), "beam search"), (dict(do_sample=False, top_k=None, top_p=None, temperature=None), "greedy")],
)
def test_decoding_modes_without_a_sampling_distribution_return_no_logprobs(overrides, reason):
    torch.manual_seed(0)
    rollout = _backend().generate(tiny_model().eval(), PROMPTS, _gen_config(**overrides))
    assert rollout.logprobs is None and reason in rollout.logprob_source
    assert len(rollout.completion_ids) == len(PROMPTS) and all(rollout.completion_ids)


def test_a_generate_that_drops_the_recorder_is_detected(monkeypatch):
    model = tiny_model().eval()

    def stub(input_ids, **kwargs):  # as TRL's tests patch generate: ignores logits_processor
        return torch.cat([input_ids, torch.full((input_ids.shape[0], 3), 20, dtype=torch.long)], dim=1)

    monkeypatch.setattr(model, "generate", stub)
    rollout = _backend().generate(model, PROMPTS, _gen_config())
    assert rollout.logprobs is None and "did not run the recording logits processor" in rollout.logprob_source
    assert rollout.completion_ids == [[20, 20, 20]] * 3


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_scored_rollout_logprobs_mean_what_recorded_ones_mean(precision):
    """The fallback (teacher-forced, rollout phase, same warpers) equals the recorder on the same tokens."""
    torch.manual_seed(0)
    model = tiny_model().eval()
    quantize_model(model, train="bf16", rollout=precision)
    config = _gen_config()
    torch.manual_seed(1)
    from jetrl_trainer.quant import PrecisionPhases

    with PrecisionPhases(model).rollout():
        recorded = _backend().generate(model, PROMPTS, config)
    assert recorded.logprobs is not None
    prompt_ids, prompt_mask = left_pad(PROMPTS, tokenizer().pad_token_id)
    width = max(len(c) for c in recorded.completion_ids)
    comp = torch.full((len(PROMPTS), width), tokenizer().pad_token_id)
    comp_mask = torch.zeros_like(comp)
    for row, ids in enumerate(recorded.completion_ids):
        comp[row, : len(ids)], comp_mask[row, : len(ids)] = torch.tensor(ids), 1
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=comp, completion_mask=comp_mask)
    scorer = AutoregressiveScorer(lambda *a, **k: None, config)
    scored = scorer.rollout_logps(model, batch, batch_size=2)[:, 0]
    for row, lps in enumerate(recorded.logprobs):
        assert torch.allclose(scored[row, : len(lps)], torch.tensor(lps), atol=TOL, rtol=0), row
    # ...and the comparison can fail: without the truncation warpers the values move well past TOL.
    plain = AutoregressiveScorer(lambda *a, **k: None, _gen_config(top_k=0, top_p=1.0)).rollout_logps(
        model, batch, batch_size=2
    )[:, 0]
    assert (plain - scored)[comp_mask.bool()].abs().max() > 10 * TOL


@pytest.mark.parametrize("strategy", [("fp8", "fp8", "none"), ("bf16", "fp8", "tis")], ids=["unified", "baseline"])
def test_trainer_trains_when_generate_is_replaced(tmp_path, monkeypatch, caplog, strategy):
    """TRL's own tests patch GenerationMixin.generate with a stub: rollouts are scored instead."""
    from transformers.generation.utils import GenerationMixin

    def stub(self, input_ids, **kwargs):
        eos = tokenizer().eos_token_id
        tail = torch.tensor([[30, 31, eos, 0], [32, 33, 34, 35]] * (input_ids.shape[0] // 2), device=input_ids.device)
        return torch.cat([input_ids, tail], dim=1)

    monkeypatch.setattr(GenerationMixin, "generate", stub)
    tp, rp, corrector = strategy
    trainer = make_trainer(tmp_path, train_precision=tp, rollout_precision=rp, corrector=corrector)
    with caplog.at_level(logging.INFO, logger="jetrl_trainer"):
        logs, _ = train(trainer)
    assert [r.getMessage() for r in caplog.records if "log-probs" in r.getMessage()] == [
        "jetrl: hf rollout log-probs scored by a rollout-phase forward: generate did not run the recording logits "
        "processor (a stub or wrapper of generate?)"
    ]
    assert logs["mismatch/nonfinite_tokens"] == 0 and "corrector/weight_mean" in logs
    if tp == rp:  # scored in the same precision as the old log-probs: the same full forward
        assert logs["mismatch/logp_abs_diff_max"] < 1e-5
    else:
        assert logs["mismatch/logp_abs_diff_mean"] > 1e-3


def test_trainer_trains_with_beam_search_generation_kwargs(tmp_path):
    """TRL's test_train_with_generation_kwargs: num_beams=2 with sampling."""
    trainer = make_trainer(
        tmp_path, train_precision="bf16", rollout_precision="fp8", corrector="tis",
        generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1},
    )  # fmt: skip
    logs, _ = train(trainer)
    assert trainer._logprob_sources == {"scored by a rollout-phase forward: beam search (num_beams=2) has no "
                                        "per-token sampling distribution"}  # fmt: skip
    assert logs["mismatch/logp_abs_diff_mean"] > 1e-3 and logs["jetrl/skipped_steps"] == 0


def test_config_without_sampling_params_is_valid(tmp_path):
    JetGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, rollout_backend="auto")
