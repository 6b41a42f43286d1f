"""``exact_logprobs`` through `JetGRPOTrainer`: the recorded log-probs serve as the old ones, bit for bit.

On CPU with the engine and the unified flow it is on by default. A GRPO step then logs
``mismatch/logp_abs_diff_max == 0``, every token's bits equal, and ``clip_ratio/region_mean == 0``
with ``num_iterations=1`` (the loss's own forward, with grad, equals the recording), in FP8 and BF16,
with FP32 master weights under ``bf16=True`` autocast, with LoRA, and with gradient checkpointing.
The no-grad training forward runs only on check steps (``exact_check_every``); a forward that departs
from the rollout (a user's hook) is caught there and warned about.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _trainer_utils import make_trainer, tiny_model, train
from peft import LoraConfig

from jetrl_trainer.quant import QuantLinear

EXACT = dict(rollout_backend="engine", max_completion_length=12)


def _assert_exact(logs):
    assert logs["mismatch/logp_abs_diff_max"] == 0.0
    assert logs["mismatch/logp_bits_equal_share"] == 1.0
    assert logs["clip_ratio/region_mean"] == 0.0
    assert logs["jetrl/skipped_steps"] == 0


@pytest.mark.parametrize(
    "overrides",
    [
        dict(train_precision="fp8", rollout_precision="fp8"),
        dict(train_precision="bf16", rollout_precision="bf16"),
        dict(train_precision="fp8", rollout_precision="fp8", bf16=True),  # FP32 master weights under autocast
        dict(train_precision="fp8", rollout_precision="fp8", gradient_checkpointing=True, num_iterations=2),
    ],
    ids=["fp8", "bf16", "fp8-autocast", "fp8-checkpointing"],
)
def test_a_grpo_step_is_exactly_on_policy(tmp_path, overrides):
    trainer = make_trainer(tmp_path, exact_check_every=1, **EXACT, **overrides)
    assert trainer.exact_logprobs
    logs, _ = train(trainer)
    _assert_exact(logs)


@pytest.mark.parametrize("overrides", [dict(), dict(gradient_checkpointing=True, num_iterations=2)],
                         ids=["plain", "checkpointing"])  # fmt: skip
def test_the_fp8_kv_cache_in_the_unified_flow_is_exactly_on_policy(tmp_path, overrides):
    """``rollout_kv_cache_dtype='fp8'`` in ``fp8/fp8``: the training forward reads keys and values as the
    cache stores them (also where gradient checkpointing recomputes it), so the contract holds."""
    trainer = make_trainer(tmp_path, exact_check_every=1, train_precision="fp8", rollout_precision="fp8",
                           rollout_kv_cache_dtype="fp8", **EXACT, **overrides)  # fmt: skip
    assert trainer.exact_logprobs and trainer.exact_kv_roundtrip is not None
    assert trainer.rollout_backend.kv_cache_dtype == "fp8"
    logs, _ = train(trainer)
    _assert_exact(logs)


def test_with_lora(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"],
                      task_type="CAUSAL_LM")  # fmt: skip
    trainer = make_trainer(tmp_path, trainer_kwargs={"peft_config": lora}, exact_check_every=1, **EXACT)
    logs, _ = train(trainer)
    _assert_exact(logs)


def test_unchecked_steps_skip_the_old_logprob_forward(tmp_path):
    """``exact_check_every=0``: no train-phase no-grad forward, so one forward's worth fewer train-phase
    GEMMs than a checked step, and no mismatch figures (nothing was compared)."""
    checked, unchecked = (make_trainer(tmp_path / str(n), exact_check_every=n, **EXACT) for n in (1, 0))
    checked_logs, checked_counts = train(checked)
    unchecked_logs, unchecked_counts = train(unchecked)
    assert "mismatch/logp_abs_diff_max" in checked_logs
    assert "mismatch/logp_abs_diff_max" not in unchecked_logs
    assert unchecked_logs["clip_ratio/region_mean"] == 0.0
    layers = sum(isinstance(m, QuantLinear) for m in checked.model.modules())
    assert unchecked_counts["rollout", "fp8"] == checked_counts["rollout", "fp8"]
    assert checked_counts["train", "fp8"] - unchecked_counts["train", "fp8"] == layers  # one batched forward


def test_a_forward_that_departs_from_the_rollout_is_reported(tmp_path, caplog):
    """A hook that nudges the LM head in the training phase only: the check finds it and says so."""
    trainer = make_trainer(tmp_path, exact_check_every=1, **EXACT)
    q_proj = next(m for m in trainer.model.modules() if isinstance(m, QuantLinear))

    def nudge(module, args, output):
        return output + 1e-3 if q_proj.phase == "train" else output

    trainer.model.lm_head.register_forward_hook(nudge)
    with caplog.at_level(logging.WARNING, logger="jetrl_trainer"):
        logs, _ = train(trainer)
    assert logs["mismatch/logp_abs_diff_max"] > 0
    assert logs["mismatch/logp_bits_equal_share"] < 1
    assert any("the contract broke" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(rollout_backend="hf"), "set rollout_backend='engine'"),
        (dict(rollout_backend="engine", train_precision="bf16", rollout_precision="fp8"), "unified flow"),
        (dict(rollout_backend="engine", exact_logprobs=False), "exact_logprobs=False"),
    ],
)
def test_where_it_does_not_apply_it_is_off_and_says_why(tmp_path, caplog, overrides, reason):
    with caplog.at_level(logging.INFO, logger="jetrl_trainer"):
        trainer = make_trainer(tmp_path, **overrides)
    assert not trainer.exact_logprobs
    assert any("exact on-policy log-probs off" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_a_model_the_engine_cannot_run_is_refused_when_asked_for(tmp_path):
    model = tiny_model()
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    with pytest.raises(ValueError, match="exact_logprobs=True: the decode engine cannot run this model"):
        make_trainer(tmp_path, model, exact_logprobs=True, rollout_backend="engine")


def test_gradients_match_the_plain_forward(tmp_path):
    """The exact forward differentiates to the plain forward's gradient, within rounding."""
    from jetrl_trainer.exact import training_logprobs

    model = tiny_model()
    ids = torch.randint(5, 60, (3, 20))
    mask = torch.ones_like(ids)
    grads = []
    for exact in (True, False):
        model.zero_grad()
        if exact:
            logps, _, _ = training_logprobs(model, ids, mask, 8, temperature=1.0)
        else:
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -9:-1].float()
            logps = torch.log_softmax(logits, -1).gather(-1, ids[:, -8:, None])[..., 0]
        logps.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-3, atol=1e-5)
    assert grads[0].abs().sum() > 0


def test_fp32_master_weights_under_autocast_run_the_engine_without_exact_too(tmp_path):
    """``bf16=True`` with FP32 master weights: the prefill's keys come out FP32 (RoPE promotes them) and
    its values BF16; the engine's cache holds both (it refused the BF16 values before)."""
    trainer = make_trainer(tmp_path, exact_logprobs=False, bf16=True, **EXACT)
    logs, _ = train(trainer)
    assert trainer.rollout_backend.last_stats["decode_path"] == "torch"
    assert logs["mismatch/logp_abs_diff_max"] < 0.1 and logs["jetrl/skipped_steps"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True], ids=["kernel-path", "exact"])
def test_fp32_master_weights_under_autocast_on_cuda(tmp_path, exact):
    """The same on CUDA: without exact log-probs the engine's kernel path (CUDA graphs) decodes after an
    autocast prefill; with them the exact decode holds the contract under autocast."""
    from jetrl_trainer.kernels import triton_available

    if not triton_available():
        pytest.skip("needs Triton (the engine's kernel path)")
    trainer = make_trainer(tmp_path, model=tiny_model().cuda(), use_cpu=False, bf16=True, exact_logprobs=exact,
                           exact_check_every=1, train_precision="fp8", rollout_precision="fp8", **EXACT)  # fmt: skip
    logs, _ = train(trainer)
    assert trainer.rollout_backend.last_stats["decode_path"] == ("torch_graphs" if exact else "graphs")
    if exact:
        _assert_exact(logs)
    else:
        assert logs["mismatch/logp_abs_diff_max"] < 0.1 and logs["jetrl/skipped_steps"] == 0


def test_with_several_inner_iterations_no_old_logprob_forward_runs(tmp_path, monkeypatch):
    """``num_iterations=2`` makes TRL compute old log-probs itself (generation and optimizer steps are
    misaligned); with exact log-probs the recorded ones serve, so no no-grad training forward runs at
    all when no check is due, and the ratios of both inner iterations' first pass stay exact."""
    trainer = make_trainer(tmp_path, exact_check_every=0, num_iterations=2, **EXACT)
    no_grad_forwards = []
    token_logps = trainer.policy_scorer.token_logps

    def counting(*args, **kwargs):
        no_grad_forwards.append(not torch.is_grad_enabled())
        return token_logps(*args, **kwargs)

    monkeypatch.setattr(trainer.policy_scorer, "token_logps", counting)
    logs, _ = train(trainer)
    assert no_grad_forwards and not any(no_grad_forwards)  # only the loss's forwards, with grad
    assert logs["clip_ratio/region_mean"] == 0.0
