"""PrecisionPhases (quant/phase.py): the phase is the model's, switched only by named context managers."""

import threading

import pytest
import torch
from torch import nn

from jetrl_trainer.quant import PrecisionPhases, QuantLinear, count_quant_gemms, quantize_model

BASELINE = {"train": "bf16", "rollout": "fp8"}


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    quantize_model(model, train="bf16", rollout="fp8")
    return model


def _phases(model: nn.Module) -> list[str]:
    return [m.phase for m in model.modules() if isinstance(m, QuantLinear)]


def test_a_converted_module_starts_in_train_and_says_so():
    model = _model()
    assert _phases(model) == ["train", "train"] and PrecisionPhases(model).phase == "train"
    assert "phase=train" in repr(model[0])
    assert PrecisionPhases(nn.Linear(4, 4)).phase == "train"  # nothing phase-aware: both phases compute the same


def test_rollout_switches_every_module_and_restores_them():
    model, x = _model(), torch.randn(3, 128)
    phases = PrecisionPhases(model)
    with count_quant_gemms() as counts:
        with phases.rollout():
            assert _phases(model) == ["rollout", "rollout"] and phases.phase == "rollout"
            model(x)
            with phases.train():  # blocks nest
                model(x)
            assert phases.phase == "rollout"
        model(x)
    assert _phases(model) == ["train", "train"]
    assert counts == {("rollout", "fp8"): 2, ("train", "bf16"): 4}


def test_the_phase_is_restored_when_the_block_raises():
    model = _model()
    with pytest.raises(RuntimeError, match="boom"):
        with PrecisionPhases(model).use("rollout"):
            raise RuntimeError("boom")
    assert _phases(model) == ["train", "train"]


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="train, rollout"):
        with PrecisionPhases(_model()).use("eval"):
            pass


def test_two_models_keep_their_own_phase():
    policy, reference = _model(0), _model(1)
    with PrecisionPhases(policy).rollout():
        assert _phases(reference) == ["train", "train"]
        assert PrecisionPhases(reference).phase == "train"


def test_a_worker_thread_sees_the_models_phase():
    # A continuous-batching engine runs the model in its own thread: the caller's block must reach it.
    model, x, seen = _model(), torch.randn(3, 128), []

    def worker():
        with torch.no_grad(), count_quant_gemms() as counts:
            model(x)
        seen.append(dict(counts))

    with PrecisionPhases(model).rollout():
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert seen == [{("rollout", "fp8"): 2}]


def test_a_module_converted_after_the_object_was_built_is_switched_too():
    model = nn.Sequential(nn.Linear(128, 64))
    phases = PrecisionPhases(model)
    quantize_model(model, train="bf16", rollout="fp8")
    with phases.rollout():
        assert _phases(model) == ["rollout"]


def test_the_rollout_recipe_runs_only_inside_the_block():
    model, x = _model(), torch.randn(3, 128)
    with torch.no_grad():
        train = model(x)
        with PrecisionPhases(model).rollout():
            rollout = model(x)
        assert torch.equal(model(x), train)
    assert not torch.equal(rollout, train)
