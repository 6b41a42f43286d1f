"""hub: master_state_dict filtering and the jetrl model card (no trainer, no network)."""

from __future__ import annotations

import torch
import yaml
from torch import nn

from jetrl_trainer.config import JetGRPOConfig
from jetrl_trainer.hub import jetrl_card_metadata, jetrl_card_section, master_state_dict, update_model_card
from jetrl_trainer.quant import QuantLinear, quantize_model


def _args(**kw):
    return JetGRPOConfig(output_dir="/tmp/jetrl-test-hub", report_to="none", bf16=False, use_cpu=True, **kw)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2, bias=False)


def test_quantized_model_state_dict_is_already_plain():
    model = quantize_model(Tiny(), train="fp8", rollout="fp8")
    assert isinstance(model.body, QuantLinear)
    assert master_state_dict(model) is None  # nothing to drop: let save_pretrained build its own


def test_extra_entries_of_quantized_layers_are_dropped():
    model = quantize_model(Tiny(), train="fp8", rollout="fp8")
    model.body.register_buffer("weight_scale_inv", torch.ones(1, 1))  # as a cached FP8 copy would
    model.body.register_buffer("weight_fp8", torch.zeros(4, 4))
    sd = master_state_dict(model)
    assert set(sd) == {"body.weight", "body.bias", "head.weight"}
    assert torch.equal(sd["body.weight"], model.body.weight)
    # A state dict from a wrapper (DDP "module." prefix) is filtered by suffix.
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    assert set(master_state_dict(model, wrapped)) == {"module.body.weight", "module.body.bias", "module.head.weight"}


def test_card_metadata_and_section():
    unified = _args(train_precision="nvfp4", rollout_precision="nvfp4", nvfp4_backward="high_precision")
    meta = jetrl_card_metadata(unified)
    assert meta == {
        "train_precision": "nvfp4", "rollout_precision": "nvfp4", "unified_precision": True, "corrector": "none",
        "nvfp4_backward": "high_precision",
    }  # fmt: skip
    assert "unified precision flow" in jetrl_card_section(unified)
    baseline = _args(train_precision="bf16", rollout_precision="fp8", keep_last_n_layers_bf16=2)
    section = jetrl_card_section(baseline)
    assert "the mismatch between them not corrected" in section and "keep_last_n_layers_bf16: `2`" in section


def test_update_model_card_creates_then_refreshes(tmp_path):
    path = tmp_path / "README.md"
    update_model_card(path, _args(corrector="tis", corrector_clip=4.0))
    update_model_card(path, _args(corrector="ais"))  # refresh: one section, latest settings
    text = path.read_text()
    meta = yaml.safe_load(text.split("---")[1])
    assert meta["tags"] == ["jetrl"] and meta["jetrl"]["corrector"] == "ais" and meta["library_name"] == "transformers"
    assert text.count("## Low-precision RL (jetrl-trainer)") == 1 and "clip=4.0" not in text


def test_update_model_card_keeps_an_existing_card(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("---\ntags:\n- trl\n- grpo\n---\n# My model\n\nSome text.\n")
    update_model_card(path, _args())
    text = path.read_text()
    meta = yaml.safe_load(text.split("---")[1])
    assert meta["tags"] == ["trl", "grpo", "jetrl"]
    assert "# My model" in text and "Some text." in text and "## Low-precision RL" in text
