"""hub: a quantized model saves its master weights as is, and the jetrl model card (no trainer, no network)."""

from __future__ import annotations

import torch
import yaml

from jetrl_trainer.config import JetGRPOConfig
from jetrl_trainer.hub import jetrl_card_metadata, jetrl_card_section, update_model_card
from jetrl_trainer.quant import QuantLinear, quantize_model


def _args(**kw):
    return JetGRPOConfig(output_dir="/tmp/jetrl-test-hub", report_to="none", bf16=False, use_cpu=True, **kw)


def test_quantized_model_state_dict_holds_only_the_master_weights(tmp_path):
    # Why save needs no filter: after quantize + fuse, rollout and training forwards (which fill
    # the FP8 / NVFP4 weight caches) and a backward, the state dict is the original one, same
    # keys and same storage, and a checkpoint reloads into a plain transformers model.
    from transformers import AutoModelForCausalLM

    from jetrl_trainer.quant import precision_phase
    from jetrl_trainer.quant.fused import fuse_norm_and_swiglu
    from jetrl_trainer.tiny import build_tiny_qwen3

    model = build_tiny_qwen3()
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    fuse_norm_and_swiglu(quantize_model(model, train="fp8", rollout="nvfp4"))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with precision_phase("rollout"), torch.no_grad():
        model(ids)
    model(ids).logits.float().pow(2).mean().backward()
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(len(m._weight_cache) == 2 for m in layers)  # fp8 and nvfp4 weights cached
    state = model.state_dict()
    assert {k: v.data_ptr() for k, v in state.items()} == before
    model.save_pretrained(tmp_path)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, state[key]), key


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
