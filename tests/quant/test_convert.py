"""quantize_model / dequantize_model (quant/convert.py) on a tiny Qwen3, with and without LoRA."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jetrl_trainer.quant import (
    NVFP4Recipe,
    PrecisionPhases,
    QuantLinear,
    count_quant_gemms,
    dequantize_model,
    quantize_model,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

N_LAYERS = 3
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def tiny_qwen3(seed=0):
    # hidden 144 and intermediate 200 are not multiples of 128: ragged groups and blocks everywhere.
    config = transformers.Qwen3Config(
        vocab_size=96, hidden_size=144, intermediate_size=200, num_hidden_layers=N_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(model, ids, phase="train"):
    with torch.no_grad(), PrecisionPhases(model).use(phase):
        return model(ids).logits


def _cos(a, b):
    return F.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


def _quant_names(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear))


def test_quantizes_decoder_linears_and_skips_head_and_embeddings(ids, caplog):
    model = tiny_qwen3()
    ref = _logits(model, ids)
    params = {n: p for n, p in model.named_parameters()}
    state = {k: (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="jetrl_trainer.quant.convert"):
        assert quantize_model(model) is model
    assert f"{N_LAYERS * LINEARS_PER_LAYER} Linear layers -> QuantLinear" in caplog.text
    assert len(_quant_names(model)) == N_LAYERS * LINEARS_PER_LAYER
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert all(p is params[n] for n, p in model.named_parameters())  # no copies
    assert {k: (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()} == state
    out = _logits(model, ids)
    assert not torch.equal(out, ref) and _cos(out, ref) > 0.99


def test_unified_flow_and_baseline_on_a_model(ids):
    model = quantize_model(tiny_qwen3())
    assert torch.equal(_logits(model, ids, "rollout"), _logits(model, ids, "train"))
    quantize_model(model, train="bf16", rollout="fp8")
    baseline_train = _logits(model, ids, "train")
    assert torch.equal(baseline_train, _logits(tiny_qwen3(), ids))
    assert not torch.equal(_logits(model, ids, "rollout"), baseline_train)


def test_count_quant_gemms_per_phase(ids):
    model = quantize_model(tiny_qwen3(), train="bf16", rollout="fp8")
    n = N_LAYERS * LINEARS_PER_LAYER
    with count_quant_gemms() as counts:
        _logits(model, ids, "train")
        _logits(model, ids, "rollout")
    assert counts == {("train", "bf16"): n, ("rollout", "fp8"): n}


def test_nvfp4_model_logits_close_and_ordered(ids):
    ref = _logits(tiny_qwen3(), ids)
    cos = {}
    for name, recipe in [("fp8", "fp8"), ("nvfp4", "nvfp4"), ("nvfp4_no46", NVFP4Recipe(four_over_six=False))]:
        model = quantize_model(tiny_qwen3(), train=recipe, rollout=recipe)
        cos[name] = _cos(_logits(model, ids), ref)
    # 4-bit is coarser than 8-bit; four-over-six recovers part of the gap (random tiny model).
    assert cos["fp8"] > 0.99 and cos["nvfp4"] > 0.93
    assert cos["fp8"] > cos["nvfp4"] > cos["nvfp4_no46"]


def test_dequantize_round_trip_is_bit_exact(ids):
    model = tiny_qwen3()
    ref = _logits(model, ids)
    quantize_model(model)
    assert dequantize_model(model) is model
    assert not _quant_names(model)
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if isinstance(m, nn.Linear))
    assert torch.equal(_logits(model, ids), ref)


def test_state_dict_loads_into_a_fresh_unquantized_model(ids):
    model = quantize_model(tiny_qwen3(seed=1))
    with torch.no_grad():  # stand-in for training: the quantized model's weights move
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    fresh = tiny_qwen3(seed=2)
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(_logits(fresh, ids), _logits(dequantize_model(model), ids))


def test_keep_last_n_layers(ids):
    model = quantize_model(tiny_qwen3(), keep_last_n_layers=1)
    names = _quant_names(model)
    assert len(names) == (N_LAYERS - 1) * LINEARS_PER_LAYER
    assert not any(n.startswith(f"model.layers.{N_LAYERS - 1}.") for n in names)
    with pytest.raises(ValueError, match=r"allowed: 0..3"):
        quantize_model(tiny_qwen3(), keep_last_n_layers=4)
    with pytest.raises(ValueError, match="keep_modules"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), keep_last_n_layers=1)


@pytest.mark.parametrize(
    "patterns,kept_per_layer,only_layer",
    [
        (["mlp"], 3, None),
        (["self_attn.o_proj"], 1, None),
        (["re:self_attn\\.(q|k)_proj$"], 2, None),
        (["model.layers.0.*"], 7, 0),
        ("down_proj", 1, None),
    ],
)
def test_keep_modules(patterns, kept_per_layer, only_layer):
    model = quantize_model(tiny_qwen3(), keep_modules=patterns)
    expected = N_LAYERS * LINEARS_PER_LAYER - (kept_per_layer if only_layer is not None else N_LAYERS * kept_per_layer)
    assert len(_quant_names(model)) == expected


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("q_projj", "keep_modules (keep_bf16_modules) pattern 'q_projj' matches no Linear layer of "
                    "Qwen3ForCausalLM; close names: q_proj, v_proj, o_proj, k_proj."),
        ("model.layer.0.*", "keep_modules (keep_bf16_modules) pattern 'model.layer.0.*' matches no Linear layer of "
                            "Qwen3ForCausalLM; close names: model.layers.0.mlp, model.layers.2.mlp, "
                            "model.layers.1.mlp, model.layers.0.self_attn."),
        ("re:shared_expert", "keep_modules (keep_bf16_modules) pattern 're:shared_expert' matches no Linear layer of "
                             "Qwen3ForCausalLM; Linear names look like 'model.layers.0.self_attn.q_proj'."),
    ],
)
def test_a_keep_pattern_that_matches_nothing_is_refused_with_close_names(pattern, message):
    model = tiny_qwen3()
    with pytest.raises(ValueError) as err:
        quantize_model(model, keep_modules=["mlp", pattern])
    assert str(err.value) == message
    assert not _quant_names(model), "refused before anything was swapped"
    quantize_model(model, keep_modules=["lm_head"])  # matches the head, which is kept anyway: accepted


def test_module_filter_fn_can_exclude_more():
    seen = []

    def only_square(module, fqn):
        seen.append(fqn)
        return module.in_features == module.out_features

    model = quantize_model(tiny_qwen3(), module_filter_fn=only_square)
    assert _quant_names(model) == []  # no square Linear in this config
    assert "lm_head" not in seen and "model.layers.0.self_attn.q_proj" in seen


def test_calling_twice_is_harmless_and_follows_the_latest_call(ids):
    model = quantize_model(tiny_qwen3())
    first = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    once = _logits(model, ids)
    quantize_model(model)
    assert {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)} == first
    assert torch.equal(_logits(model, ids), once)
    quantize_model(model, rollout="nvfp4", keep_modules=["mlp"])
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj is first["model.layers.0.self_attn.q_proj"] and q_proj.recipes["rollout"].name == "nvfp4"
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    assert model.model.layers[0].mlp.up_proj.weight is first["model.layers.0.mlp.up_proj"].weight


def test_generic_module_skips_lm_head_by_name():
    model = nn.Sequential()
    model.add_module("body", nn.Linear(8, 8))
    model.add_module("lm_head", nn.Linear(8, 5))
    quantize_model(model)
    assert isinstance(model.body, QuantLinear) and type(model.lm_head) is nn.Linear


def _lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def test_lora_quantizes_frozen_base_layers_only(ids):
    model = _lora(tiny_qwen3())
    ref = _logits(model, ids)
    quantize_model(model)
    layer = model.base_model.model.model.layers[0]
    q_proj = layer.self_attn.q_proj
    assert isinstance(q_proj.base_layer, QuantLinear) and not q_proj.base_layer.weight.requires_grad
    assert isinstance(layer.self_attn.k_proj, QuantLinear)  # not a LoRA target: quantized directly
    lora_linears = [m for n, m in model.named_modules() if ".lora_A." in n or ".lora_B." in n]
    assert lora_linears and all(type(m) is nn.Linear for m in lora_linears)
    assert len(_quant_names(model)) == N_LAYERS * LINEARS_PER_LAYER
    assert type(model.base_model.model.lm_head) is nn.Linear
    assert _cos(_logits(model, ids), ref) > 0.99
    # Training: gradients reach the adapters (through the FP8 dgrad) and only them.
    model.train()
    with torch.no_grad():  # lora_B starts at zero; make the adapters matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model(ids, labels=ids).loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_lora_patterns_use_model_names_and_round_trip(ids):
    model = _lora(tiny_qwen3())
    ref = _logits(model, ids)
    quantize_model(model, keep_modules=["model.layers.0.*"], keep_last_n_layers=1)
    names = _quant_names(model)
    assert len(names) == LINEARS_PER_LAYER  # only layer 1 of 0..2
    assert all(".layers.1." in n for n in names)
    quantize_model(model, keep_modules=["model.layers.0.*"], keep_last_n_layers=1)
    assert _quant_names(model) == names
    dequantize_model(model)
    assert torch.equal(_logits(model, ids), ref)


def test_lora_wrapped_head_is_not_quantized():
    config = peft.LoraConfig(r=2, target_modules=["lm_head", "o_proj"])
    model = quantize_model(peft.get_peft_model(tiny_qwen3(), config))
    assert type(model.base_model.model.lm_head.base_layer) is nn.Linear


def test_bad_arguments_raise_value_error():
    model = tiny_qwen3()
    with pytest.raises(ValueError, match="bf16, fp8, nvfp4"):
        quantize_model(model, train="fp16")
    with pytest.raises(ValueError, match="fp32, ue8m0"):
        quantize_model(model, scale_format="e8m0")
    with pytest.raises(ValueError, match="dequantized, high_precision"):
        quantize_model(model, rollout="nvfp4", nvfp4_backward="straight_through")
    with pytest.raises(ValueError, match="regular expression"):
        quantize_model(model, keep_modules=["re:("])
    with pytest.raises(ValueError, match="int >= 0"):
        quantize_model(model, keep_last_n_layers=-1)
    with pytest.raises(ValueError, match="nn.Module"):
        quantize_model("Qwen/Qwen3-0.6B")
    with pytest.raises(TypeError):
        quantize_model(model, "fp8")  # keyword-only
    assert not _quant_names(model)  # failed calls changed nothing
