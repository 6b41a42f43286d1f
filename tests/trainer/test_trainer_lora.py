"""LoRA end to end: the frozen base is quantized, the adapters stay plain and are the only thing trained."""

from __future__ import annotations

import pytest
import torch
from _trainer_utils import changed, make_trainer, snapshot, tiny_model, train
from peft import LoraConfig, get_peft_model
from torch import nn

from jetrl_trainer.quant import QuantLinear

TARGETS = ["q_proj", "v_proj", "up_proj"]


def _lora_config():
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")


def _check_layout(model, precision):
    lora_layers = [m for n, m in model.named_modules() if n.endswith(tuple(TARGETS)) and hasattr(m, "base_layer")]
    assert len(lora_layers) == 2 * len(TARGETS)
    for layer in lora_layers:
        assert isinstance(layer.base_layer, QuantLinear)
        assert layer.base_layer.recipes["train"].name == precision and not layer.base_layer.weight.requires_grad
        adapters = [*layer.lora_A.values(), *layer.lora_B.values()]
        assert adapters and all(type(a) is nn.Linear for a in adapters)  # adapters are never quantized
    k_proj = [m for n, m in model.named_modules() if n.endswith("k_proj")]
    assert k_proj and all(isinstance(m, QuantLinear) for m in k_proj)  # non-targeted layers too


@pytest.mark.parametrize(
    "how, train_precision, rollout_precision, corrector",
    [("peft_config", "fp8", "fp8", "none"), ("peft_model", "bf16", "fp8", "tis")],
)
def test_lora_trains_adapters_over_a_quantized_base(tmp_path, how, train_precision, rollout_precision, corrector):
    if how == "peft_config":
        trainer = make_trainer(
            tmp_path, trainer_kwargs={"peft_config": _lora_config()},
            train_precision=train_precision, rollout_precision=rollout_precision, corrector=corrector,
        )  # fmt: skip
    else:
        model = get_peft_model(tiny_model(), _lora_config())
        trainer = make_trainer(
            tmp_path, model, train_precision=train_precision, rollout_precision=rollout_precision, corrector=corrector
        )
    _check_layout(trainer.model, train_precision)
    before = snapshot(trainer.model)
    logs, counts = train(trainer)
    moved = changed(trainer.model, before)
    assert moved and all("lora_" in n for n in moved), moved
    assert any("lora_B" in n for n in moved)
    assert set(counts) == {("rollout", rollout_precision), ("train", train_precision)}
    assert "mismatch/logp_abs_diff_mean" in logs and logs["jetrl/skipped_steps"] == 0
    frozen = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    assert frozen and not any(p.requires_grad for p in frozen)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
