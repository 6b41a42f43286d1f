"""The state JetGRPOTrainer owns: its PrecisionPhases and its WeightCacheRefresh."""

from __future__ import annotations

import pytest
import torch
from _trainer_utils import make_trainer, tiny_model, train

from jetrl_trainer.quant import PrecisionPhases, QuantLinear, WeightCacheRefresh
from jetrl_trainer.rollout import Rollout, RolloutBackend


class _PhaseRecordingBackend(RolloutBackend):
    """Fixed completions; records the phase of the model it is handed."""

    name = "fixed"

    def __init__(self) -> None:
        self.phases: list[str] = []

    def generate(self, model, prompt_ids, sampling):
        self.phases.append(PrecisionPhases(model).phase)
        n = len(prompt_ids)
        return Rollout([[40, 41 + i % 3, 42] for i in range(n)], None, "scored")


def _generations(model) -> set[int]:
    return {m._weight_generation for m in model.modules() if isinstance(m, QuantLinear)}


def test_rollouts_run_in_the_trainers_rollout_block_and_the_rest_in_train(tmp_path):
    trainer = make_trainer(tmp_path, train_precision="bf16", rollout_precision="fp8", corrector="tis")
    assert isinstance(trainer.precision_phases, PrecisionPhases) and trainer.precision_phases.model is trainer.model
    backend = trainer.rollout_backend = _PhaseRecordingBackend()
    _, counts = train(trainer)
    assert backend.phases == ["rollout"]
    assert trainer.precision_phases.phase == "train"
    assert counts[("rollout", "fp8")] > 0 and counts[("train", "bf16")] > 0  # the sampling log-probs were scored
    assert set(phase for phase, _ in counts) == {"rollout", "train"}


def test_every_optimizer_step_refreshes_the_policys_quantized_weights(tmp_path):
    trainer = make_trainer(tmp_path, train_precision="fp8", rollout_precision="fp8", max_steps=2)
    assert trainer.weight_cache_refresh is None  # registered once the optimizer is final
    train(trainer)
    refresh = trainer.weight_cache_refresh
    assert isinstance(refresh, WeightCacheRefresh) and refresh.model is trainer.model
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer" and refresh.follows(trainer.optimizer)
    assert refresh.optimizer is trainer.optimizer.optimizer  # the torch optimizer under accelerate's wrapper
    assert _generations(trainer.model) == {2}  # one refresh per optimizer step
    assert trainer._ref_cache_refresh is None


@pytest.mark.parametrize("sync", [False, True])
def test_a_reference_model_is_refreshed_only_when_trl_syncs_it(tmp_path, sync):
    # TRL's SyncRefModelCallback writes the reference through .data (no _version bump) after the step.
    tiny_model().save_pretrained(tmp_path / "tiny")  # TRL loads the reference by path
    trainer = make_trainer(tmp_path, str(tmp_path / "tiny"), train_precision="fp8", rollout_precision="fp8",
                           beta=0.1, model_init_kwargs={"dtype": "float32"}, sync_ref_model=sync,
                           ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)  # fmt: skip
    ref = trainer.accelerator.unwrap_model(trainer.ref_model)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    train(trainer)
    assert _generations(ref) == ({1} if sync else {0})
    moved = any(not torch.equal(before[n], p) for n, p in ref.named_parameters())
    assert moved == sync
