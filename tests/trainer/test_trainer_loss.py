"""Corrector weights reach TRL's per-token surrogate, for every TRL loss_type, without copying the loss.

A constant-weight corrector makes the check exact: with plain SGD the parameter update is linear in
the per-token loss, so weights 0 freeze the model and weights 2 double the update of weights 1.
VESPO folds the ratio into its gamma weights in log space (as TRL does for vLLM), so for it we check
the logged gamma weight instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from _trainer_utils import changed, make_trainer, snapshot, tiny_model, train

from jetrl_trainer.correctors import Corrector

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@dataclass(frozen=True)
class ConstantCorrector(Corrector):
    """Every valid token gets the same weight."""

    name: ClassVar[str] = "constant"
    value: float = 1.0

    def compute_weights(self, batch):
        return torch.full_like(batch.log_ratio, self.value), {}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_runs_with_a_corrector(tmp_path, loss_type):
    trainer = make_trainer(
        tmp_path, train_precision="bf16", rollout_precision="fp8", corrector="ais", loss_type=loss_type
    )
    before = snapshot(trainer.model)
    logs, _ = train(trainer)
    assert torch.isfinite(torch.tensor(logs["loss"]))
    assert changed(trainer.model, before)
    assert "corrector/alpha" in logs and logs["jetrl/skipped_steps"] == 0


def _sgd_update(tmp_path, weight, loss_type, model=None, **kw):
    trainer = make_trainer(
        tmp_path, model, train_precision="bf16", rollout_precision="fp8", corrector=ConstantCorrector(weight),
        loss_type=loss_type, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, **kw,
    )  # fmt: skip
    before = snapshot(trainer.model)
    logs, _ = train(trainer)
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}, logs


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "vespo"])
def test_zero_weights_stop_every_update(tmp_path, loss_type):
    zero, _ = _sgd_update(tmp_path, 0.0, loss_type)
    assert all(torch.count_nonzero(d) == 0 for d in zero.values()), "weight 0 must stop every update"


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])  # token-sum, sequence-mean, clipped-IS forms
def test_weights_scale_the_surrogate(tmp_path, loss_type):
    one, _ = _sgd_update(tmp_path / "w1", 1.0, loss_type)
    two, _ = _sgd_update(tmp_path / "w2", 2.0, loss_type)
    assert any(torch.count_nonzero(d) > 0 for d in one.values())
    for name in one:
        # atol: p_after - p_before rounds at ~1e-7 for O(1) weights; updates are ~1e-2
        torch.testing.assert_close(two[name], 2 * one[name], rtol=1e-4, atol=1e-6)


def test_weights_enter_vespo_gamma_weights(tmp_path):
    _, ones = _sgd_update(tmp_path / "w1", 1.0, "vespo")
    _, zeros = _sgd_update(tmp_path / "w0", 0.0, "vespo")
    assert ones["vespo/phi_seq_mean"] > 1e-3
    assert zeros["vespo/phi_seq_mean"] < 1e-6  # log(0) clamps to log(1e-8): the gamma weight vanishes


def test_weights_apply_before_the_kl_term(tmp_path):
    """With beta > 0 the weights multiply the surrogate only, not the KL term (zero at step 0).

    The model is given by path, so TRL loads the policy and the reference from it (with
    ``model_init_kwargs``); the reference is quantized with the training recipe.
    """
    tiny_model().save_pretrained(tmp_path / "tiny")
    zero, logs = _sgd_update(
        tmp_path, 0.0, "dapo", beta=0.1, model=str(tmp_path / "tiny"), model_init_kwargs={"dtype": "float32"}
    )
    assert "kl" in logs and logs["kl"] == pytest.approx(0.0, abs=1e-6)  # reference = policy at step 0
    assert all(torch.count_nonzero(d) == 0 for d in zero.values())


def test_flags_are_restored_after_the_loss(tmp_path):
    trainer = make_trainer(tmp_path, train_precision="bf16", rollout_precision="fp8", corrector="tis")
    train(trainer)
    assert trainer.use_vllm is False
    assert trainer.vllm_importance_sampling_correction is trainer.args.vllm_importance_sampling_correction
