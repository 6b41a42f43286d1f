"""hub: a quantized model saves its master weights as is, and the jetrl model card (no trainer, no network)."""

from __future__ import annotations

import pytest
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

    from jetrl_trainer.quant import PrecisionPhases
    from jetrl_trainer.quant.fused import fuse_norm_and_swiglu
    from jetrl_trainer.tiny import build_tiny_qwen3

    model = build_tiny_qwen3()
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    fuse_norm_and_swiglu(quantize_model(model, train="fp8", rollout="nvfp4"))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with PrecisionPhases(model).rollout(), torch.no_grad():
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


# ---------------------------------------------------------------- FP8-block export


def _fp8_policy(intermediate_size: int = 160, **quant):
    from jetrl_trainer.tiny import build_tiny_qwen3

    torch.manual_seed(0)
    # Ragged blocks: 96 fills part of one 128-block, 160 one full block and part of another.
    model = build_tiny_qwen3(dtype=torch.bfloat16, hidden_size=96, intermediate_size=intermediate_size, head_dim=24)
    return quantize_model(model, **{"train": "fp8", "rollout": "fp8", **quant})


def _rollout_logits(model, ids):
    from jetrl_trainer.quant import PrecisionPhases

    with PrecisionPhases(model).rollout(), torch.no_grad():
        return model(ids).logits.float()


def test_fp8_export_stores_the_rollout_weights_bit_for_bit(tmp_path):
    import json

    from safetensors.torch import load_file

    from jetrl_trainer.hub import export_fp8_checkpoint, load_fp8_checkpoint
    from jetrl_trainer.quant.testing import assert_bits_equal

    model = _fp8_policy(keep_last_n_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    _rollout_logits(model, ids)  # fill the rollout's FP8 cache: the export must reuse it, not re-quantize
    quant_config = export_fp8_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config == quant_config
    assert {k: config[k] for k in ("quant_method", "weight_block_size", "activation_scheme")} == {
        "quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}  # fmt: skip
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    assert "lm_head" in config["modules_to_not_convert"]
    assert any(m.startswith(last) for m in config["modules_to_not_convert"])  # keep_last_n_layers stayed BF16
    state = load_file(tmp_path / "model.safetensors")
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.recipes["rollout"].quantized}
    assert fp8 and not any(n.startswith(last) for n in fp8)
    for name, module in fp8.items():
        q, s_inv = module.quantized_weight(module.recipes["rollout"])
        assert state[f"{name}.weight"].dtype == torch.float8_e4m3fn
        n, k = module.weight.shape
        assert state[f"{name}.weight_scale_inv"].shape == (-(-n // 128), -(-k // 128))
        assert_bits_equal(state[f"{name}.weight"], q)
        assert_bits_equal(state[f"{name}.weight_scale_inv"], s_inv)
    for name in config["modules_to_not_convert"]:  # BF16 master weights, untouched
        assert_bits_equal(state[f"{name}.weight"], model.get_submodule(name).weight.detach())
    assert_bits_equal(state["model.embed_tokens.weight"], model.model.embed_tokens.weight.detach())
    _, pairs = load_fp8_checkpoint(tmp_path)  # our loader hands back the same pairs
    assert pairs.keys() == fp8.keys()
    for name, (q, s_inv) in pairs.items():
        assert_bits_equal(q, state[f"{name}.weight"])
        assert_bits_equal(s_inv, state[f"{name}.weight_scale_inv"])
    card = (tmp_path / "README.md").read_text()
    assert "FP8-block checkpoint" in card and "fp8" in card and "weight_block_size: [128, 128]" in card


def test_fp8_export_loads_in_transformers_dequantized_on_cpu(tmp_path):
    # Without an FP8 GEMM, transformers' FineGrainedFP8 dequantizes the checkpoint to BF16: the
    # same weights as our loader's, and logits within the activation-quantization gap of the rollout's.
    # transformers 5.24 derives the block from the scale grid (rows // scale_rows), which misreads a
    # dimension with a partial block after full ones (160 = 128 + 32): sizes here avoid that (docs/vllm.md).
    from transformers import AutoModelForCausalLM

    from jetrl_trainer.hub import export_fp8_checkpoint, load_fp8_checkpoint

    model = _fp8_policy(intermediate_size=256)
    export_fp8_checkpoint(model, tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    rollout = _rollout_logits(model, ids)
    ours, _ = load_fp8_checkpoint(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        ours_logits, theirs_logits = ours(ids).logits.float(), theirs(ids).logits.float()
    assert torch.equal(ours_logits, theirs_logits)
    gap = (theirs_logits - rollout).abs().max().item()
    assert 0 < gap < 0.25, gap  # BF16 activations here, 1x128 FP8 activations in the rollout
    bf16 = _rollout_logits(_fp8_policy(intermediate_size=256, rollout="bf16"), ids)  # the master weights, unquantized
    assert (theirs_logits - bf16).abs().max() > 0  # it really holds the FP8 weights


def test_fp8_export_refuses_what_it_cannot_write(tmp_path):
    from jetrl_trainer.hub import export_fp8_checkpoint
    from jetrl_trainer.tiny import build_tiny_qwen3

    with pytest.raises(ValueError, match="NVFP4 export is not supported"):
        export_fp8_checkpoint(_fp8_policy(rollout="nvfp4"), tmp_path)
    with pytest.raises(ValueError, match="no FP8 rollout layers.*quantize_model"):
        export_fp8_checkpoint(build_tiny_qwen3(), tmp_path)
    with pytest.raises(ValueError, match="no FP8 rollout layers"):
        export_fp8_checkpoint(_fp8_policy(rollout="bf16"), tmp_path)


def test_fp8_export_warns_when_vllm_cannot_fuse_its_projections(tmp_path):
    import warnings

    from jetrl_trainer.hub import export_fp8_checkpoint
    from jetrl_trainer.tiny import build_tiny_qwen3

    def policy(**sizes):
        return quantize_model(build_tiny_qwen3(dtype=torch.bfloat16, **sizes), train="fp8", rollout="fp8")

    # The tiny default: k/v are 2 x 32 = 64 wide, off vLLM's 128-row grid of the fused qkv weight.
    with pytest.warns(UserWarning, match=r"vLLM cannot load.*k_proj \(64\)"):
        export_fp8_checkpoint(policy(), tmp_path / "off")
    with warnings.catch_warnings():  # q 256, k/v 128, gate/up 256: every shard on the grid
        warnings.simplefilter("error")
        export_fp8_checkpoint(policy(head_dim=64), tmp_path / "on")


def test_fp8_export_refuses_a_peft_model(tmp_path):
    from peft import LoraConfig, get_peft_model

    from jetrl_trainer.hub import export_fp8_checkpoint

    model = get_peft_model(_fp8_policy(), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="merge_and_unload"):
        export_fp8_checkpoint(model, tmp_path)


def test_push_to_hub_fp8_uploads_the_exported_folder(tmp_path, monkeypatch):
    import huggingface_hub

    from jetrl_trainer.hub import push_to_hub

    uploads = []

    class FakeApi:  # no network: record what would be uploaded
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            pass

        def upload_folder(self, repo_id, folder_path, commit_message):
            import os

            uploads.append((repo_id, sorted(os.listdir(folder_path)), commit_message,
                            open(os.path.join(folder_path, "config.json")).read()))  # fmt: skip

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    push_to_hub(_fp8_policy(), "me/tiny-fp8", fp8=True, args=_args(rollout_precision="fp8"))
    push_to_hub(_fp8_policy(), "me/tiny", fp8=False)
    (repo, files, message, config), (_, plain_files, _, plain_config) = uploads
    assert repo == "me/tiny-fp8" and "FP8" in message
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert '"quant_method": "fp8"' in config and "quantization_config" not in plain_config
    assert "model.safetensors" in plain_files


def _gpu_export(tmp_path):
    from jetrl_trainer.hub import export_fp8_checkpoint
    from jetrl_trainer.tiny import build_tiny_qwen3

    torch.manual_seed(0)
    model = quantize_model(build_tiny_qwen3(dtype=torch.bfloat16).cuda(), train="fp8", rollout="fp8")
    export_fp8_checkpoint(model, tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), device="cuda")
    return model, ids, _rollout_logits(model, ids)  # our rollout phase: real FP8 GEMMs on the GPU


@pytest.mark.gpu
def test_fp8_export_loads_in_transformers_finegrained_fp8_on_gpu_dequantized(tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    _, ids, rollout = _gpu_export(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path, device_map="cuda", quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    with torch.no_grad():
        logits = theirs(ids).logits.float()
    gap = (logits - rollout).abs().max().item()
    print(f"transformers FineGrainedFP8 (dequantized, GPU) vs rollout phase: max |dlogit| = {gap:.4g}")
    assert 0 < gap < 0.1, gap  # BF16 activations there, 1x128 FP8 activations in our rollout


@pytest.mark.gpu
def test_fp8_export_runs_in_transformers_finegrained_fp8_on_gpu(tmp_path):
    # Kept in FP8 (FP8Linear): transformers takes its FP8 GEMM from the `kernels` package, which
    # fetches the kernel from the Hub at run time; skipped where that package is missing (offline).
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("transformers' FP8 GEMM needs the `kernels` package (it downloads the kernel from the Hub)")
    model, ids, rollout = _gpu_export(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda")
    fp8_layers = [m for m in theirs.modules() if getattr(getattr(m, "weight", None), "dtype", None) == torch.float8_e4m3fn]
    assert len(fp8_layers) == sum(isinstance(m, QuantLinear) for m in model.modules())  # not dequantized
    with torch.no_grad():
        logits = theirs(ids).logits.float()
    gap = (logits - rollout).abs().max().item()
    print(f"transformers FineGrainedFP8 (FP8 GEMMs) vs rollout phase: max |dlogit| = {gap:.4g}")
    assert gap < 0.1, gap
