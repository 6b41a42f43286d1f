"""Saving, checkpoints, resume and push_to_hub: master weights under normal names, and a jetrl card."""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import torch
import yaml
from _trainer_utils import make_trainer, snapshot, tiny_model, train
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

from jetrl_trainer.quant import QuantLinear


def _card(folder) -> tuple[dict, str]:
    text = open(os.path.join(folder, "README.md")).read()
    _, header, body = text.split("---", 2)
    return yaml.safe_load(header), body


def _assert_plain_checkpoint(folder, model):
    """Loads into a plain AutoModelForCausalLM, with exactly the trained master weights."""
    saved = load_file(os.path.join(folder, "model.safetensors"))
    expected = {n: p for n, p in model.named_parameters()}
    assert set(saved) == set(expected)  # normal names only: no FP8 copies, scales or caches
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert not any(isinstance(m, QuantLinear) for m in reloaded.modules())
    for name, param in expected.items():
        assert saved[name].dtype == param.dtype, name
        assert torch.equal(reloaded.get_parameter(name).to(param.dtype), param.detach()), name


def test_save_model_writes_bf16_master_weights(tmp_path):
    model = tiny_model().to(torch.bfloat16)
    trainer = make_trainer(tmp_path / "run", model, train_precision="fp8", rollout_precision="fp8", corrector="ais")
    train(trainer)
    assert any(isinstance(m, QuantLinear) for m in trainer.model.modules())
    trainer.save_model(str(tmp_path / "saved"))
    _assert_plain_checkpoint(tmp_path / "saved", trainer.model)
    assert all(p.dtype == torch.bfloat16 for p in load_file(tmp_path / "saved" / "model.safetensors").values())
    meta, body = _card(tmp_path / "saved")
    assert "jetrl" in meta["tags"]
    assert meta["jetrl"]["train_precision"] == meta["jetrl"]["rollout_precision"] == "fp8"
    assert meta["jetrl"]["corrector"] == "ais" and "unified precision flow" in body


class _AtTrainBegin(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = snapshot(model)


def test_checkpoints_and_resume(tmp_path):
    run = tmp_path / "run"
    # A constant LR: the scheduler restored from checkpoint-2 was built for max_steps=2.
    common = dict(train_precision="bf16", rollout_precision="fp8", corrector="tis", lr_scheduler_type="constant")
    trainer = make_trainer(run, max_steps=2, save_strategy="steps", save_steps=1, **common)
    train(trainer)
    ckpt = run / "checkpoint-2"
    assert (run / "checkpoint-1").is_dir() and ckpt.is_dir()
    _assert_plain_checkpoint(ckpt, trainer.model)
    meta, body = _card(ckpt)
    assert "jetrl" in meta["tags"] and meta["jetrl"]["corrector"] == "tis" and "`tis` corrector" in body
    meta_top, _ = _card(run)  # TRL's own card in output_dir gets the section too
    assert {"trl", "grpo", "jetrl"} <= set(meta_top["tags"]) and meta_top["jetrl"]["rollout_precision"] == "fp8"

    spy = _AtTrainBegin()
    resumed = make_trainer(run, max_steps=3, trainer_kwargs={"callbacks": [spy]}, **common)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 3
    saved = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(spy.params[n], saved[n]) for n in saved), "resume starts from the checkpoint weights"
    assert any(not torch.equal(p.detach(), saved[n]) for n, p in resumed.model.named_parameters())
    assert any(isinstance(m, QuantLinear) for m in resumed.model.modules())
    steps = {int(s["step"]) for s in resumed.optimizer.state.values()}
    assert steps == {3}, "Adam state was restored from the checkpoint, then stepped once"


def test_push_to_hub_uploads_master_weights_and_card(tmp_path):
    trainer = make_trainer(
        tmp_path / "run", train_precision="bf16", rollout_precision="fp8", corrector="mis",
        corrector_low=0.25, corrector_high=4.0, hub_model_id="someone/tiny-jet",
    )  # fmt: skip
    train(trainer)
    uploaded = {}

    def upload_folder(**kwargs):
        folder = kwargs["folder_path"]
        uploaded.update(kwargs, files=sorted(os.listdir(folder)), card=_card(folder))
        _assert_plain_checkpoint(folder, trainer.model)
        return "https://example.invalid/commit"

    api = mock.MagicMock()
    api.create_repo.return_value = SimpleNamespace(repo_id="someone/tiny-jet")
    api.upload_folder.side_effect = upload_folder
    with mock.patch("transformers.trainer.hf_api", return_value=api):
        trainer.push_to_hub()
    assert uploaded["repo_id"] == "someone/tiny-jet" and "model.safetensors" in uploaded["files"]
    meta, body = uploaded["card"]
    assert {"jetrl", "trl", "grpo"} <= set(meta["tags"])
    assert meta["jetrl"] == {
        "train_precision": "bf16", "rollout_precision": "fp8", "unified_precision": False, "corrector": "mis",
        "corrector_params": {"low": 0.25, "high": 4.0}, "fp8_scale_format": "fp32",
    }  # fmt: skip
    assert "rollouts in **fp8**, training in **bf16**" in body


def test_lora_save_keeps_adapters_only(tmp_path):
    from peft import LoraConfig, PeftModel

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tmp_path / "run", trainer_kwargs={"peft_config": config})
    train(trainer)
    trainer.save_model(str(tmp_path / "adapter"))
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    reloaded = PeftModel.from_pretrained(tiny_model(), tmp_path / "adapter")
    assert not any(isinstance(m, QuantLinear) for m in reloaded.modules())
    trained = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    for name, param in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(param, trained[name]), name
