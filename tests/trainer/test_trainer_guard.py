"""The non-finite guard inside the trainer: a NaN step is skipped, counted, and touches no weight."""

from __future__ import annotations

import math

import torch
from _trainer_utils import changed, make_trainer, snapshot, train
from transformers import TrainerCallback

from jetrl_trainer import JetGRPOTrainer
from jetrl_trainer.quant import QuantLinear


class NaNAdvantageTrainer(JetGRPOTrainer):
    """Poisons one advantage of the first ``poison_batches`` generation batches (a NaN reaching the loss)."""

    poison_batches = 1

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.poison_batches > 0:
            self.poison_batches -= 1
            batch["advantages"] = batch["advantages"].clone()
            batch["advantages"][0] = math.nan
        return batch


class Snapshots(TrainerCallback):
    def __init__(self):
        self.params = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append(snapshot(model))


def test_nan_step_is_skipped_and_the_next_one_trains(tmp_path):
    spy = Snapshots()
    trainer = make_trainer(
        tmp_path, trainer_cls=NaNAdvantageTrainer, trainer_kwargs={"callbacks": [spy]},
        train_precision="fp8", rollout_precision="fp8", max_steps=2,
    )  # fmt: skip
    before = snapshot(trainer.model)
    train(trainer)
    first, second = [log for log in trainer.state.log_history if "loss" in log]
    # Trainer's logging_nan_inf_filter hides the NaN loss in "loss"; the gradient norm shows it.
    assert math.isnan(first["grad_norm"]) and first["jetrl/skipped_steps"] == 1
    assert all(torch.equal(before[n], p) for n, p in spy.params[0].items()), "a NaN step must not move any weight"
    assert math.isfinite(second["grad_norm"]) and second["jetrl/skipped_steps"] == 1  # cumulative
    assert changed(trainer.model, before), "the finite step after it trains normally"
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    state = trainer.optimizer.state  # Adam moments were created by the good step only, and are finite
    assert state and all(int(s["step"]) == 1 and torch.isfinite(s["exp_avg"]).all() for s in state.values())
    layers = [m for m in trainer.model.modules() if isinstance(m, QuantLinear)]
    assert {m._weight_generation for m in layers} == {1}, "the skipped step must not refresh the quantized weights"


def test_nan_gradient_from_a_finite_loss_is_caught(tmp_path):
    """A hook that turns gradients into NaN while the loss stays finite."""

    class NaNGradTrainer(JetGRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            next(model.parameters()).grad.fill_(math.nan)
            return loss

    trainer = make_trainer(tmp_path, trainer_cls=NaNGradTrainer, train_precision="bf16", rollout_precision="bf16")
    before = snapshot(trainer.model)
    logs, _ = train(trainer)
    assert math.isfinite(logs["loss"]) and logs["jetrl/skipped_steps"] == 1
    assert not changed(trainer.model, before)
