"""JetGRPOTrainer end to end on a tiny Qwen3: every strategy trains, runs in the precision it claims,
logs its mismatch, and the mismatch is where the strategy says it should be."""

from __future__ import annotations

import pytest
from _trainer_utils import changed, make_trainer, snapshot, strategy_runs, train

from jetrl_trainer.correctors import MISMATCH_METRICS

# (train precision, rollout precision, corrector) -> the corrector-specific metrics it must log.
STRATEGIES = {
    ("bf16", "bf16", "none"): (),
    ("bf16", "fp8", "none"): (),
    ("bf16", "fp8", "is"): (),
    ("bf16", "fp8", "tis"): ("corrector/clipped_frac",),
    ("bf16", "fp8", "mis"): ("corrector/masked_frac",),
    ("bf16", "fp8", "ais"): ("corrector/alpha", "corrector/alpha_ess", "corrector/alpha_mis", "corrector/alpha_var"),
    ("fp8", "fp8", "none"): (),
    ("nvfp4", "nvfp4", "none"): (),
}
LINEARS_PER_FORWARD = 2 * 7  # tiny Qwen3: 2 layers x (q, k, v, o, gate, up, down); lm_head stays nn.Linear


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One training step per strategy, run once and shared by the tests below."""
    return strategy_runs(tmp_path_factory, make_trainer)


@pytest.mark.parametrize("strategy", list(STRATEGIES), ids=lambda s: "-".join(s))
def test_strategy_trains_and_logs(runs, strategy):
    run = runs(strategy)
    params = dict(run["trainer"].model.named_parameters())
    assert sorted(run["changed"]) == sorted(params), "every parameter gets a non-zero Adam update"
    logs = run["logs"]
    expected = (*MISMATCH_METRICS, "corrector/weight_mean", "corrector/weight_min", "corrector/weight_max")
    for key in (*expected, *STRATEGIES[strategy], "jetrl/skipped_steps", "reward", "loss"):
        assert key in logs, key
    assert logs["jetrl/skipped_steps"] == 0
    assert logs["mismatch/nonfinite_tokens"] == 0


@pytest.mark.parametrize("strategy", list(STRATEGIES), ids=lambda s: "-".join(s))
def test_each_phase_runs_in_its_precision(runs, strategy):
    tp, rp, _ = strategy
    counts = runs(strategy)["counts"]
    assert set(counts) == {("rollout", rp), ("train", tp)}
    # Training: the old log-probs forward plus the loss forward, each through every linear once.
    assert counts[("train", tp)] == 2 * LINEARS_PER_FORWARD
    # Rollout: one prefill and at most max_completion_length - 1 decode steps, never more.
    assert LINEARS_PER_FORWARD <= counts[("rollout", rp)] <= 4 * LINEARS_PER_FORWARD


def test_unified_flow_is_at_the_bf16_floor_and_the_baseline_is_not(runs):
    floor = runs(("bf16", "bf16", "none"))["logs"]["mismatch/logp_abs_diff_mean"]
    unified = runs(("fp8", "fp8", "none"))["logs"]["mismatch/logp_abs_diff_mean"]
    unified_nvfp4 = runs(("nvfp4", "nvfp4", "none"))["logs"]["mismatch/logp_abs_diff_mean"]
    baseline = runs(("bf16", "fp8", "none"))["logs"]["mismatch/logp_abs_diff_mean"]
    # The floor is the KV-cache vs full-forward summation order (~1e-7 in FP32 here).
    assert floor < 1e-5
    assert unified < max(1e-5, 10 * floor) and unified_nvfp4 < max(1e-5, 10 * floor)
    assert baseline > 1e-3 and baseline > 100 * max(unified, floor)
    baseline_logs = runs(("bf16", "fp8", "none"))["logs"]
    assert baseline_logs["mismatch/kl_k3"] > 0 and baseline_logs["mismatch/ess_ratio"] < 1


def test_corrector_metrics_describe_the_weights(runs):
    none = runs(("bf16", "fp8", "none"))["logs"]
    assert none["corrector/weight_min"] == none["corrector/weight_max"] == 1.0  # logged, not applied
    tis = runs(("bf16", "fp8", "tis"))["logs"]
    assert tis["corrector/weight_max"] <= 2.0 and tis["corrector/weight_min"] < 1.0 < tis["corrector/weight_max"]
    ais = runs(("bf16", "fp8", "ais"))["logs"]
    assert 0.0 <= ais["corrector/alpha"] <= 1.0


@pytest.mark.parametrize("log_mismatch", [True, False])
def test_train_logps_forward_only_when_needed(tmp_path, log_mismatch):
    """Unified flow, no corrector: the extra old-log-prob forward runs only to log the mismatch."""
    trainer = make_trainer(tmp_path, train_precision="bf16", rollout_precision="bf16", log_mismatch=log_mismatch)
    logs, counts = train(trainer)
    assert counts[("train", "bf16")] == (2 if log_mismatch else 1) * LINEARS_PER_FORWARD
    assert ("mismatch/logp_abs_diff_mean" in logs) is log_mismatch


def test_continuous_batching_rollout(tmp_path):
    trainer = make_trainer(
        tmp_path, train_precision="bf16", rollout_precision="fp8", corrector="tis",
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config={"num_blocks": 16, "max_batch_tokens": 64},
    )  # fmt: skip
    before = snapshot(trainer.model)
    logs, counts = train(trainer)
    assert counts[("rollout", "fp8")] > 0 and ("rollout", "bf16") not in counts
    assert logs["mismatch/logp_abs_diff_mean"] > 1e-3 and "corrector/clipped_frac" in logs
    assert changed(trainer.model, before)


def test_plain_grpo_config_is_refused(tmp_path):
    from trl import GRPOConfig

    from _trainer_utils import FAST, byte_reward, prompts, tiny_model, tokenizer
    from jetrl_trainer import JetGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), **FAST)
    with pytest.raises(ValueError, match="needs a JetGRPOConfig"):
        JetGRPOTrainer(tiny_model(), byte_reward, args=args, train_dataset=prompts(), processing_class=tokenizer())


def test_model_id_is_loaded_with_model_init_kwargs_and_quantized(tmp_path):
    import torch

    from _trainer_utils import tiny_model
    from jetrl_trainer.quant import QuantLinear

    tiny_model().save_pretrained(tmp_path / "tiny")
    trainer = make_trainer(
        tmp_path / "run", str(tmp_path / "tiny"), model_init_kwargs={"dtype": "bfloat16"},
        train_precision="fp8", rollout_precision="fp8",
    )  # fmt: skip
    quantized = [m for m in trainer.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == LINEARS_PER_FORWARD and trainer.model.dtype == torch.bfloat16
    assert type(trainer.model.lm_head) is torch.nn.Linear  # the head stays un-quantized
    before = snapshot(trainer.model)
    logs, counts = train(trainer)
    assert changed(trainer.model, before) and set(counts) == {("rollout", "fp8"), ("train", "fp8")}
    assert logs["mismatch/logp_abs_diff_mean"] < 1e-2


def test_sampling_logprobs_follow_the_temperature_and_truncation(tmp_path):
    """Recorded log-probs use the sampling temperature, like TRL's training log-probs, so the unified
    flow stays at the floor at T=0.7; with top-k the sampler's renormalised distribution differs
    from the full softmax TRL scores, and that gap shows up as mismatch (docs/trainer.md)."""
    warm = make_trainer(tmp_path / "t", train_precision="bf16", rollout_precision="bf16", temperature=0.7)
    assert train(warm)[0]["mismatch/logp_abs_diff_mean"] < 1e-5
    topk = make_trainer(tmp_path / "k", train_precision="bf16", rollout_precision="bf16", top_k=5)
    logs = train(topk)[0]
    # k1 = mean(logp_rollout - logp_train) > 0: the truncated sampler gives its tokens more mass
    assert logs["mismatch/logp_abs_diff_mean"] > 0.1 and logs["mismatch/kl_k1"] > 0
