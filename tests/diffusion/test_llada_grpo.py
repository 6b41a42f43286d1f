"""JetGRPOTrainer on a tiny LLaDA: diffusion rollouts, estimated log-probs, one mask seed per inner
iteration, every strategy, LoRA, KL, saving (jetrl_trainer/diffusion/rollout.py, scoring.py)."""

from __future__ import annotations

import types

import pytest
import torch
from _trainer_utils import (
    byte_reward,
    changed,
    prompts,
    save_published_layout,
    snapshot,
    strategy_runs,
    tiny_llada,
    tokenizer,
    train,
)
from torch import nn

from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
from jetrl_trainer.correctors import MISMATCH_METRICS
from jetrl_trainer.diffusion import DiffusionBackend, DiffusionSampling, DiffusionScorer
from jetrl_trainer.diffusion import elbo_logps, mask_seeds_for_step, mean_field_logps, register_estimator
from jetrl_trainer.diffusion import rollout as diffusion_rollout
from jetrl_trainer.diffusion.scoring import select_iteration
from jetrl_trainer.quant import PrecisionPhases, QuantLinear

GEN_LENGTH, STEPS = 8, 4
FAST = dict(
    per_device_train_batch_size=4, num_generations=4, max_completion_length=GEN_LENGTH, diffusion_steps=STEPS,
    max_steps=1, logging_steps=1, learning_rate=1e-2, report_to="none", bf16=False, use_cpu=True,
    gradient_checkpointing=False, save_strategy="no", disable_tqdm=True, seed=0,
)  # fmt: skip
LINEARS = 2 * 7  # tiny LLaDA: 2 blocks x (q, k, v, attn_out, ff_proj, up_proj, ff_out); the LM head stays nn.Linear


def make_trainer(tmp_path, model=None, trainer_kwargs=None, **overrides):
    args = JetGRPOConfig(output_dir=str(tmp_path), **{**FAST, **overrides})
    return JetGRPOTrainer(
        tiny_llada() if model is None else model, byte_reward, args=args, train_dataset=prompts(),
        processing_class=tokenizer(), **(trainer_kwargs or {}),
    )  # fmt: skip


# ------------------------------------------------------------------ every strategy, one step each

STRATEGIES = {
    ("bf16", "bf16", "none"): (),
    ("bf16", "fp8", "ais"): ("corrector/alpha", "corrector/alpha_ess", "corrector/alpha_mis", "corrector/alpha_var"),
    ("fp8", "fp8", "none"): (),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One training step per strategy, run once and shared by the tests below."""
    return strategy_runs(tmp_path_factory, make_trainer)


@pytest.mark.parametrize("strategy", list(STRATEGIES), ids=lambda s: "-".join(s))
def test_strategy_trains_and_logs(runs, strategy):
    run = runs(strategy)
    trainer = run["trainer"]
    assert type(trainer) is JetGRPOTrainer  # one trainer class: a diffusion LM is another backend + scorer
    assert isinstance(trainer.rollout_backend, DiffusionBackend) and isinstance(trainer.policy_scorer, DiffusionScorer)
    assert sorted(run["changed"]) == sorted(n for n, _ in trainer.model.named_parameters())
    logs = run["logs"]
    expected = (*MISMATCH_METRICS, "corrector/weight_mean", "corrector/weight_min", "corrector/weight_max")
    for key in (*expected, *STRATEGIES[strategy], "jetrl/skipped_steps", "reward", "loss", "entropy"):
        assert key in logs, key
    assert logs["jetrl/skipped_steps"] == 0 and logs["mismatch/nonfinite_tokens"] == 0
    assert 0 < logs["entropy"] <= torch.log(torch.tensor(float(len(tokenizer())))).item() + 1e-4


@pytest.mark.parametrize("strategy", list(STRATEGIES), ids=lambda s: "-".join(s))
def test_each_phase_runs_in_its_precision(runs, strategy):
    tp, rp, _ = strategy
    counts = runs(strategy)["counts"]
    assert set(counts) == {("rollout", rp), ("train", tp)}
    # Rollout: one forward per denoising step, plus the rollout-precision log-prob estimate.
    assert counts[("rollout", rp)] == (STEPS + 1) * LINEARS
    # Train: the old log-prob estimate, plus the loss forward.
    assert counts[("train", tp)] == 2 * LINEARS


def test_unified_flow_has_no_mismatch_and_the_baseline_does(runs):
    """Rollout and old log-probs score the same masked input; only the precision can tell them apart."""
    floor = runs(("bf16", "bf16", "none"))["logs"]
    unified = runs(("fp8", "fp8", "none"))["logs"]
    baseline = runs(("bf16", "fp8", "ais"))["logs"]
    assert floor["mismatch/logp_abs_diff_max"] == 0.0  # same mask, same arithmetic: bit for bit
    assert unified["mismatch/logp_abs_diff_max"] == 0.0  # same FP8 modules in both phases
    assert baseline["mismatch/logp_abs_diff_mean"] > 1e-3
    assert baseline["mismatch/kl_k3"] > 0 and baseline["mismatch/ess_ratio"] < 1
    assert 0.0 <= baseline["corrector/alpha"] <= 1.0
    assert baseline["corrector/weight_min"] < 1.0 < baseline["corrector/weight_max"]


def test_saved_checkpoint_reloads_as_plain_llada(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = runs(("fp8", "fp8", "none"))["trainer"]
    trainer.save_model(str(tmp_path))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded).__name__ == "LLaDAModelLM"
    assert not any(isinstance(m, QuantLinear) for m in reloaded.modules())
    trained = dict(trainer.model.named_parameters())
    for name, param in reloaded.named_parameters():
        assert torch.equal(param, trained[name].detach()), name


# ------------------------------------------------------------------ mask seeds per inner iteration

RECORD: list[dict] = []


@register_estimator("recording_mean_field")
def recording_mean_field(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, mask_seed, **kw):
    logps = mean_field_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, mask_seed=mask_seed, **kw)
    for r in range(prompt_ids.shape[0]):
        key = (tuple(prompt_ids[r][prompt_mask[r].bool()].tolist()), tuple(completion_ids[r].tolist()))
        RECORD.append(dict(
            phase=PrecisionPhases(model).phase, grad=torch.is_grad_enabled(), key=key, seed=int(mask_seed[r]),
            width=completion_ids.shape[1], logps=logps[r].detach().clone(),
        ))  # fmt: skip
    return logps


def test_one_mask_seed_per_iteration_shared_by_old_rollout_and_current(tmp_path):
    """num_iterations=2 over one generation batch of 8 rows, trained as 2 shuffled micro-batches of 4,
    learning rate 0: at iteration i the loss must score each row with the seed (hence the mask) its
    old and rollout log-probs of iteration i used."""
    RECORD.clear()
    trainer = make_trainer(
        tmp_path, train_precision="bf16", rollout_precision="bf16", corrector="tis", num_iterations=2, max_steps=2,
        gradient_accumulation_steps=2, learning_rate=0.0, likelihood_estimator="recording_mean_field",
        p_mask_prompt=0.5,
    )  # fmt: skip
    train(trainer)
    old = [c for c in RECORD if c["phase"] == "train" and not c["grad"]]
    rollout = [c for c in RECORD if c["phase"] == "rollout"]
    current = [c for c in RECORD if c["grad"]]
    assert len(old) == len(rollout) == len(current) == 2 * 8  # 2 iterations x 8 rows
    seeds = mask_seeds_for_step(0, 0, 2)
    assert seeds[0] != seeds[1]
    for calls in (old, rollout, current):  # the loss: two micro-steps of iteration 0, then two of iteration 1
        assert [c["seed"] for c in calls] == [seeds[0]] * 8 + [seeds[1]] * 8
    assert {c["key"] for c in current[:8]} == {c["key"] for c in old[:8]}  # every row, once per iteration
    old_by = {(c["key"], c["seed"]): c["logps"] for c in old}
    for c in current + rollout:
        assert torch.allclose(c["logps"], old_by[(c["key"], c["seed"])], atol=1e-6, rtol=0)
    # ...and the check can fail: the two iterations' masks give clearly different log-probs.
    gap = max((old_by[(k, seeds[0])] - old_by[(k, seeds[1])]).abs().max().item() for k, _ in old_by)
    assert gap > 1e-3


ELBO_CALLS: list[dict] = []


@register_estimator("recording_elbo")
def recording_elbo(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, mask_seed, **kw):
    kw.pop("p_mask_prompt")  # a **kwargs estimator gets every option; the ELBO never masks the prompt
    inputs = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(kwargs.get("input_ids", args[0] if args else None)), with_kwargs=True)
    try:
        logps = elbo_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, mask_seed=mask_seed, **kw)
    finally:
        handle.remove()
    ELBO_CALLS.append(dict(phase=PrecisionPhases(model).phase, grad=torch.is_grad_enabled(), options=kw,
                           inputs=[x.clone() for x in inputs], logps=logps.detach().clone()))  # fmt: skip
    return logps


recording_elbo.forward_weights = elbo_logps.forward_weights


def test_elbo_trains_with_shared_masks_across_old_rollout_reference_and_current(tmp_path):
    """likelihood_estimator='elbo' end to end: 2 antithetic samples, beta > 0 (a reference pass), one
    micro-batch; the old, rollout, reference and current passes see the same masked inputs."""
    ELBO_CALLS.clear()
    trainer = make_trainer(
        tmp_path, save_published_layout(tmp_path / "tiny"), train_precision="bf16", rollout_precision="bf16",
        corrector="tis", max_steps=1, beta=0.04, likelihood_estimator="recording_elbo", likelihood_mc_samples=2,
        likelihood_antithetic=True,
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    logs, _ = train(trainer)
    assert all(c["options"]["n_mc"] == 2 and c["options"]["antithetic"] for c in ELBO_CALLS)  # the config's
    no_grad = [c for c in ELBO_CALLS if not c["grad"]]
    current = [c for c in ELBO_CALLS if c["grad"]]
    assert len(current) == 1 and len(no_grad) >= 3  # old (train phase), rollout, reference
    def by_row(call):  # TRL shuffles rows between the scoring passes and the loss: match rows by content
        return {tuple(torch.cat([x[r] for x in call["inputs"]]).tolist()): call["logps"][r] for r in range(len(call["logps"]))}

    loss_rows = by_row(current[0])
    for call in no_grad:
        assert len(call["inputs"]) == 2  # n_mc forwards
        rows = by_row(call)
        assert rows.keys() == loss_rows.keys(), call["phase"]  # the same masked inputs, row for row
        for key, logps in rows.items():  # same parameters before the step: same values
            torch.testing.assert_close(logps, loss_rows[key], rtol=0, atol=1e-5)
    assert not torch.equal(current[0]["inputs"][0], current[0]["inputs"][1])  # an antithetic pair differs
    assert logs["mismatch/logp_abs_diff_max"] == 0.0 and logs["kl"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert "entropy" in logs and logs["entropy"] > 0


def test_per_iteration_tensors_are_batch_first_and_completions_stop_at_eos(tmp_path, monkeypatch):
    """Completions are cut after the first EOS, yet the estimator still sees the whole canvas."""
    eos, pad = tokenizer().eos_token_id, tokenizer().pad_token_id
    eos_at = {0: 0, 1: 2, 3: 4}  # row -> position of its first EOS; row 2 has none
    ends = [1, 3, GEN_LENGTH, 5]  # hence the completion lengths, EOS included

    def fake_generate(model, prompt_ids, attention_mask, *, gen_length, **kwargs):
        canvas = torch.full((prompt_ids.shape[0], gen_length), ord("a") + 8)  # a byte symbol, not special
        for row, position in eos_at.items():
            canvas[row, position:] = eos  # LLaDA fills the rest of the canvas with EOS
        return torch.cat([prompt_ids, canvas], dim=1)

    monkeypatch.setattr(diffusion_rollout, "generate", fake_generate)
    RECORD.clear()
    trainer = make_trainer(
        tmp_path, train_precision="bf16", rollout_precision="fp8", corrector="mis", num_iterations=3,
        likelihood_estimator="recording_mean_field",
    )  # fmt: skip
    trainer.model.train()
    batch = trainer._generate_and_score_completions([prompts(1)[0]] * 4)
    T = max(ends)
    assert batch["completion_mask"].tolist() == [[1] * n + [0] * (T - n) for n in ends]
    assert batch["completion_ids"][0, 1:].eq(pad).all()
    for key in ("old_per_token_logps", "sampling_per_token_logps", "importance_sampling_ratio"):
        assert batch[key].shape == (4, 3, T), key
    assert batch["mask_seeds"].shape == (4, 3) and batch["mask_seeds"].dtype == torch.int64
    assert batch["mask_seeds"].eq(batch["mask_seeds"][:1]).all()  # one seed per iteration, for every row
    assert batch["mask_seeds"][0].unique().numel() == 3
    assert {c["width"] for c in RECORD} == {GEN_LENGTH}  # the sampler's full canvas, whatever T is
    one = select_iteration(batch, 1)
    assert one["old_per_token_logps"].shape == (4, T) and one["mask_seeds"].shape == (4,)
    assert torch.equal(one["sampling_per_token_logps"], batch["sampling_per_token_logps"][:, 1])
    assert one["completion_ids"] is batch["completion_ids"] and batch["mask_seeds"].shape == (4, 3)


# ------------------------------------------------------------------ KL, LoRA, loss types


def test_kl_to_a_reference_loaded_from_a_published_layout_checkpoint(tmp_path):
    path = save_published_layout(tmp_path / "tiny")
    trainer = JetGRPOTrainer(
        path, byte_reward, processing_class=tokenizer(), train_dataset=prompts(),
        args=JetGRPOConfig(output_dir=str(tmp_path / "out"), **{**FAST, "max_steps": 2}, beta=0.1,
                           train_precision="bf16", rollout_precision="fp8", corrector="tis",
                           model_init_kwargs={"dtype": "float32"}),
    )  # fmt: skip
    assert isinstance(trainer.policy_scorer, DiffusionScorer) and trainer.ref_model is not None
    logs, counts = train(trainer)
    later = [log for log in trainer.state.log_history if "loss" in log][1]
    assert logs["kl"] == 0.0  # the reference is the policy before the first update, in the train precision
    assert later["kl"] > 0.0
    assert counts[("train", "bf16")] == 2 * 3 * LINEARS  # per step: old, reference, loss


def test_lora_trains_adapters_and_never_the_lm_head(tmp_path):
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all_linear", task_type="CAUSAL_LM")
    trainer = make_trainer(
        tmp_path, trainer_kwargs={"peft_config": config}, train_precision="fp8", rollout_precision="fp8", beta=0.1,
        max_steps=2,
    )  # fmt: skip
    base = trainer.model.get_base_model()
    head = base.model.transformer.ff_out
    assert type(head) is nn.Linear  # no adapter, not quantized
    adapted = [n for n, m in base.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == LINEARS and all(".blocks." in n for n in adapted)
    assert all(isinstance(m.base_layer, QuantLinear) for n, m in base.named_modules() if hasattr(m, "lora_A"))
    before = snapshot(trainer.model)
    logs, counts = train(trainer)
    moved = changed(trainer.model, before)
    assert moved and all("lora_" in n for n in moved) and any("lora_B" in n for n in moved)
    assert logs["kl"] == 0.0  # reference = adapters disabled = the policy before its first update
    assert "mismatch/logp_abs_diff_mean" in logs and logs["jetrl/skipped_steps"] == 0
    assert set(counts) == {("rollout", "fp8"), ("train", "fp8")}


def test_lora_targets_that_would_catch_the_lm_head_are_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    naive = LoraConfig(r=4, target_modules=["q_proj", "ff_out"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="LM head 'model.transformer.ff_out'"):
        make_trainer(tmp_path, trainer_kwargs={"peft_config": naive})
    wrapped = get_peft_model(tiny_llada(), naive)  # already adapted: TRL's own check refuses it
    with pytest.raises(ValueError, match="lm_head"):
        make_trainer(tmp_path, wrapped)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_every_loss_type_runs_with_a_corrector(tmp_path, loss_type):
    trainer = make_trainer(
        tmp_path, train_precision="bf16", rollout_precision="fp8", corrector="ais", loss_type=loss_type,
        max_completion_length=4, diffusion_steps=2,
    )  # fmt: skip
    before = snapshot(trainer.model)
    logs, _ = train(trainer)
    assert torch.isfinite(torch.tensor(logs["loss"])) and changed(trainer.model, before)
    assert "corrector/alpha" in logs and logs["jetrl/skipped_steps"] == 0


# ------------------------------------------------------------------ settings and errors


def _args(**overrides):
    base = dict(max_completion_length=256, diffusion_block_length=None, diffusion_steps=None, temperature=1.0,
                diffusion_remasking="low_confidence")  # fmt: skip
    return types.SimpleNamespace(**{**base, **overrides})


def test_sampler_defaults_follow_llada():
    assert DiffusionSampling.from_args(_args()) == DiffusionSampling(128, 256, 32, 1.0)  # d1's setting
    assert DiffusionSampling.from_args(_args(max_completion_length=8)) == DiffusionSampling(4, 8, 8, 1.0)
    assert DiffusionSampling.from_args(_args(max_completion_length=48)).block_length == 48  # 32 does not divide
    assert DiffusionSampling.from_args(_args(max_completion_length=64, diffusion_block_length=16)).steps == 32
    with pytest.raises(ValueError, match="temperature must be > 0"):
        DiffusionSampling.from_args(_args(temperature=0.0))
    with pytest.raises(ValueError, match="multiple of the number of blocks"):
        DiffusionSampling.from_args(_args(diffusion_steps=100))


def test_unknown_estimator_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Unknown likelihood estimator 'elbo_42'"):
        make_trainer(tmp_path, likelihood_estimator="elbo_42")


def test_autoregressive_models_get_the_autoregressive_backend_and_scorer(tmp_path):
    from _trainer_utils import tiny_model

    from jetrl_trainer.rollout import HFGenerateBackend
    from jetrl_trainer.scoring import AutoregressiveScorer

    # refused for an AR model (tests/trainer/test_inputs.py)
    trainer = make_trainer(tmp_path, tiny_model(), diffusion_steps=None)
    assert type(trainer) is JetGRPOTrainer
    assert isinstance(trainer.rollout_backend, HFGenerateBackend)
    assert isinstance(trainer.policy_scorer, AutoregressiveScorer) and not trainer.policy_scorer.sliced


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(max_completion_length=8, diffusion_block_length=3), "must divide max_completion_length=8"),
        (dict(max_completion_length=8, diffusion_block_length=4, diffusion_steps=3), "multiple of the number of blocks"),
        (dict(diffusion_steps=0), "diffusion_steps must be a positive integer"),
        (dict(diffusion_remasking="top_k"), "diffusion_remasking must be one of low_confidence, random"),
        (dict(p_mask_prompt=1.5), r"p_mask_prompt must be in \[0, 1\]"),
        (dict(likelihood_mc_samples=4), "options of likelihood_estimator='elbo'"),
        (dict(likelihood_antithetic=True), "options of likelihood_estimator='elbo'"),
        (dict(likelihood_estimator="elbo", likelihood_mc_samples=0), "likelihood_mc_samples must be a positive"),
        (dict(likelihood_estimator="elbo", likelihood_mc_samples=3, likelihood_antithetic=True), "must be even"),
    ],
)
def test_config_validates_the_diffusion_fields(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        JetGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, **fields)
    ok = JetGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, max_completion_length=64,
                       diffusion_block_length=16, diffusion_steps=8, diffusion_remasking="RANDOM")  # fmt: skip
    assert (ok.diffusion_block_length, ok.diffusion_steps, ok.diffusion_remasking) == (16, 8, "random")
