"""LLaDA modeling: published checkpoint layout, Auto classes without remote code, attention, GQA,
gradient checkpointing, module-swap friendliness, LoRA presets, tiny builder; on CUDA, the fused SwiGLU +
FP8 quant is bit-identical to the plain expression (and actually runs)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from _llada_cuda import CUDA_MASK, cuda_prompts, model_fp8
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import jetrl_trainer.diffusion as D
from jetrl_trainer.diffusion import LLaDAConfig, LLaDAModelLM, build_tiny_llada
from jetrl_trainer.kernels import optional_module, triton_available
from jetrl_trainer.quant import PrecisionPhases

VOCAB, MASK = 48, 47

# GSAI-ML/LLaDA-8B-Instruct config.json, verbatim.
PUBLISHED_CONFIG = {
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        "AutoModel": "modeling_llada.LLaDAModelLM",
    },
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 4096,
    "embedding_dropout": 0.0,
    "embedding_size": 126464,
    "eos_token_id": 126081,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 126336,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 12288,
    "mlp_ratio": 4,
    "model_type": "llada",
    "multi_query_attention": None,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "pad_token_id": 126081,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "transformers_version": "4.46.3",
    "use_cache": False,
    "vocab_size": 126464,
    "weight_tying": False,
}
BLOCK_WEIGHTS = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out", "attn_norm", "ff_norm")
TINY = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=48, vocab_size=VOCAB,
            embedding_size=VOCAB, mask_token_id=MASK, eos_token_id=1, pad_token_id=0, rope_theta=10000.0)


def published_tiny_checkpoint(path, **overrides) -> dict[str, torch.Tensor]:
    """Write a tiny checkpoint the way the published one is laid out; return its tensors."""
    config = {**PUBLISHED_CONFIG, **TINY, **overrides}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)
    d, hd, hidden = config["d_model"], config["d_model"] // config["n_heads"], config["mlp_hidden_size"]
    kv = config["n_kv_heads"] * hd
    shapes = {"q_proj": (d, d), "k_proj": (kv, d), "v_proj": (kv, d), "attn_out": (d, d), "ff_proj": (hidden, d),
              "up_proj": (hidden, d), "ff_out": (d, hidden), "attn_norm": (d,), "ff_norm": (d,)}
    tensors = {"model.transformer.wte.weight": torch.randn(VOCAB, d, generator=g),
               "model.transformer.ln_f.weight": 1 + 0.1 * torch.randn(d, generator=g),
               "model.transformer.ff_out.weight": 0.2 * torch.randn(VOCAB, d, generator=g)}
    for i in range(config["n_layers"]):
        for name in BLOCK_WEIGHTS:
            scale = 0.1 if name.endswith("norm") else 0.2
            base = 1.0 if name.endswith("norm") else 0.0
            tensors[f"model.transformer.blocks.{i}.{name}.weight"] = base + scale * torch.randn(shapes[name], generator=g)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def reference_logits(sd: dict[str, torch.Tensor], cfg: dict, ids: torch.Tensor, mask: torch.Tensor | None):
    """The published LLaDA forward written out naively (repeat_interleave GQA, explicit softmax)."""
    H, Hkv, d = cfg["n_heads"], cfg["n_kv_heads"], cfg["d_model"]
    hd, T, eps = d // H, ids.shape[1], cfg["rms_norm_eps"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.einsum("i,j->ij", torch.arange(T).float(), inv_freq)
    pos = torch.cat((freqs, freqs), dim=-1)
    sin, cos = pos.sin(), pos.cos()

    def rope(t):
        t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
        return t * cos + torch.cat((-t2, t1), dim=-1) * sin

    x = sd["model.transformer.wte.weight"][ids]
    B = ids.shape[0]
    for i in range(cfg["n_layers"]):
        p = lambda n: sd[f"model.transformer.blocks.{i}.{n}.weight"]  # noqa: E731
        h = rms(x, p("attn_norm"))
        q = (h @ p("q_proj").T).view(B, T, H, hd).transpose(1, 2)
        k = (h @ p("k_proj").T).view(B, T, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        v = (h @ p("v_proj").T).view(B, T, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        scores = rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(hd)
        if mask is not None:
            scores = scores.masked_fill(~mask.bool()[:, None, None, :], -torch.inf)
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)
        x = x + att @ p("attn_out").T
        h = rms(x, p("ff_norm"))
        x = x + (F.silu(h @ p("ff_proj").T) * (h @ p("up_proj").T)) @ p("ff_out").T
    x = rms(x, sd["model.transformer.ln_f.weight"])
    return x @ sd["model.transformer.ff_out.weight"].T


def tiny(**overrides) -> LLaDAModelLM:
    return build_tiny_llada(vocab_size=VOCAB, mask_token_id=MASK, **overrides)


def left_padded_batch():
    ids = torch.randint(2, MASK, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


# -- config ---------------------------------------------------------------------------------------


def test_default_config_is_llada_8b_instruct():
    config = LLaDAConfig()
    skip = {"auto_map", "architectures", "model_type", "transformers_version"}
    for key, value in PUBLISHED_CONFIG.items():
        if key not in skip:
            assert getattr(config, key) == value, key
    assert config.model_type == "llada" and config.architectures == ["LLaDAModelLM"]
    # standard aliases read the LLaDA fields
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (4096, 32, 32)
    assert config.tie_word_embeddings is False and config.intermediate_size == 12288


def test_published_config_json_loads_and_keeps_unknown_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**PUBLISHED_CONFIG, "some_future_key": [1, 2]}))
    config = AutoConfig.from_pretrained(tmp_path)  # no trust_remote_code, auto_map present
    assert type(config) is LLaDAConfig
    assert config.some_future_key == [1, 2]
    assert config.auto_map["AutoModel"] == "modeling_llada.LLaDAModelLM"
    assert config.d_model == 4096 and config.mask_token_id == 126336 and config.rope_theta == 500000.0


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(block_type="sequential"), "block_type"),
        (dict(alibi=True), "alibi"),
        (dict(activation_type="swiglu"), "activation_type"),
        (dict(d_model=30, n_heads=4), "divisible"),
        (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(mask_token_id=VOCAB), "mask_token_id"),
        (dict(embedding_size=VOCAB - 1), "embedding_size"),
    ],
)
def test_config_rejects_unsupported_values(bad, match):
    with pytest.raises(ValueError, match=match):
        LLaDAConfig(**{**TINY, **bad})


# -- checkpoint compatibility -----------------------------------------------------------------------


@pytest.mark.parametrize("auto_cls", [AutoModel, AutoModelForCausalLM])
def test_published_checkpoint_loads_through_auto_class_without_remote_code(tmp_path, auto_cls):
    tensors = published_tiny_checkpoint(tmp_path)
    model, info = auto_cls.from_pretrained(tmp_path, output_loading_info=True)
    assert type(model) is LLaDAModelLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert set(model.state_dict()) == set(tensors)  # exactly the published names, no more
    for name, tensor in tensors.items():
        assert torch.equal(model.state_dict()[name], tensor), name

    in_memory = LLaDAModelLM(LLaDAConfig(**TINY))
    in_memory.load_state_dict(tensors)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        loaded = model(ids, attention_mask=mask).logits
        assert torch.equal(loaded, in_memory(ids, attention_mask=mask).logits)
        reference = reference_logits(tensors, {**PUBLISHED_CONFIG, **TINY}, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(loaded[real], reference[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_explicit_trust_remote_code_still_uses_our_class(tmp_path, trust_remote_code):
    # A registered non-transformers class counts as explicit local code; the remote files are never read.
    published_tiny_checkpoint(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=trust_remote_code)) is LLaDAModelLM


def test_save_pretrained_roundtrip_is_safetensors_and_exact(tmp_path):
    model = tiny(n_kv_heads=2)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llada" and saved["architectures"] == ["LLaDAModelLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        assert torch.equal(reloaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_bf16_load_keeps_published_dtype_semantics(tmp_path):
    published_tiny_checkpoint(tmp_path)
    model = AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.model.transformer.blocks[0].q_proj.weight.dtype == torch.bfloat16
    ids, mask = left_padded_batch()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


# -- architecture -----------------------------------------------------------------------------------


def test_gqa_shapes_and_matches_explicit_head_repetition():
    model = tiny(n_heads=4, n_kv_heads=2)
    block = model.model.transformer.blocks[0]
    assert block.k_proj.out_features == block.v_proj.out_features == 2 * 16
    assert block.q_proj.out_features == 64
    # A GQA model equals the MHA model whose k/v heads are the GQA heads repeated (repeat_interleave).
    mha = tiny(n_heads=4, n_kv_heads=4)
    sd = model.state_dict()
    for i in range(2):
        for name in ("k_proj", "v_proj"):
            w = sd[f"model.transformer.blocks.{i}.{name}.weight"].view(2, 16, 64)
            sd[f"model.transformer.blocks.{i}.{name}.weight"] = w.repeat_interleave(2, dim=0).reshape(64, 64)
    mha.load_state_dict(sd)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, mha(ids, attention_mask=mask).logits)


def test_attention_mask_hides_padded_tokens():
    model = tiny().eval()
    ids, mask = left_padded_batch()
    other = ids.clone()
    other[mask == 0] = 5  # change only what sits under padding
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = model(other, attention_mask=mask).logits
        unmasked_a, unmasked_b = model(ids).logits, model(other).logits
    real = mask.bool()
    assert torch.equal(a[real], b[real])
    # without the mask the same change is visible everywhere in rows 0 and 2: the mask is what hides it
    assert not torch.allclose(unmasked_a[0, 4:], unmasked_b[0, 4:])


def test_attention_is_bidirectional():
    model = tiny().eval()
    ids = torch.randint(2, MASK, (1, 8), generator=torch.Generator().manual_seed(3))
    later = ids.clone()
    later[0, -1] = (ids[0, -1] + 1) % MASK
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits[0, 0], model(later).logits[0, 0])


def test_all_padding_row_is_finite():
    model = tiny().eval()
    ids = torch.randint(2, MASK, (2, 5))
    mask = torch.ones_like(ids)
    mask[1] = 0
    with torch.no_grad():
        assert torch.isfinite(model(ids, attention_mask=mask).logits).all()


def test_logits_to_keep_and_inputs_embeds():
    model = tiny().eval()
    ids, mask = left_padded_batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        # same values; the LM head GEMM has fewer rows, so allow last-ulp differences
        torch.testing.assert_close(model(ids, attention_mask=mask, logits_to_keep=3).logits, full[:, -3:])
        torch.testing.assert_close(model(ids, attention_mask=mask, logits_to_keep=slice(2, 5)).logits, full[:, 2:5])
        assert model(ids, attention_mask=mask, logits_to_keep=0).logits.shape == full.shape
        embeds = model.get_input_embeddings()(ids)
        assert torch.equal(model(inputs_embeds=embeds, attention_mask=mask).logits, full)


def test_weight_tying_uses_embedding_as_head():
    model = tiny(weight_tying=True).eval()
    assert "model.transformer.ff_out.weight" not in model.state_dict()
    assert model.get_output_embeddings() is model.model.transformer.wte
    ids = torch.randint(2, MASK, (1, 6))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(model(ids).logits, hidden @ model.model.transformer.wte.weight.T)


def test_forward_rejects_labels_and_cache():
    model = tiny()
    ids = torch.randint(2, MASK, (1, 4))
    with pytest.raises(ValueError, match="likelihood"):
        model(ids, labels=ids)
    with pytest.raises(ValueError, match="KV cache"):
        model(ids, past_key_values=((ids, ids),))


def test_gradient_checkpointing_recomputes_and_gives_same_grads():
    torch.manual_seed(0)
    model = tiny(n_kv_heads=2)
    ids, mask = left_padded_batch()

    def grads():
        model.zero_grad()
        model(ids, attention_mask=mask).logits.pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    model.train()
    plain = grads()
    calls = []
    model.model.transformer.blocks[1].q_proj.register_forward_hook(lambda *_: calls.append(1))
    model.gradient_checkpointing_enable()  # what TRL calls; defaults as transformers sets them
    checkpointed = grads()
    assert len(calls) == 2  # forward + recomputation in backward
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)


def test_every_projection_is_a_called_nn_linear():
    """Quantization swaps nn.Linear modules in place: every GEMM must go through one of them."""
    model = tiny().eval()
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 7 + 1
    called = set()
    for name in linears:
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: called.add(name))
    with torch.no_grad():
        model(torch.randint(2, MASK, (1, 4)))
    assert called == set(linears)


def test_tiny_builder_is_reproducible_and_leaves_global_rng():
    state = torch.get_rng_state()
    a, b = tiny(seed=3), tiny(seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(tiny(seed=4).model.transformer.wte.weight, a.model.transformer.wte.weight)
    assert a.config.embedding_size == VOCAB and a.config.mask_token_id == MASK


def test_is_diffusion_model():
    assert D.is_diffusion_model(tiny())
    assert not D.is_diffusion_model(nn.Linear(2, 2))


# -- LoRA presets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(D.LORA_PRESETS))
def test_lora_presets_never_catch_the_lm_head(preset):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny(), peft.LoraConfig(r=2, target_modules=D.lora_target_modules(preset)))
    adapted = {n.split(".lora_A")[0].removeprefix("base_model.model.")
               for n, _ in model.named_parameters() if ".lora_A." in n}
    expected = {f"model.transformer.blocks.{i}.{m}" for i in range(2) for m in D.LORA_PRESETS[preset]}
    assert adapted == expected
    assert D.LLADA_LM_HEAD not in adapted
    ids, mask = left_padded_batch()
    assert model(input_ids=ids, attention_mask=mask).logits.shape == (3, 9, VOCAB)


def test_naive_ff_out_target_would_catch_the_lm_head():
    """Why the presets are regexes: a plain suffix list adapts the LM head too."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny(), peft.LoraConfig(r=2, target_modules=["ff_out"]))
    assert any(n.startswith(f"base_model.model.{D.LLADA_LM_HEAD}.lora_A") for n, _ in model.named_parameters())


def test_lora_preset_unknown_name():
    with pytest.raises(ValueError, match="all_linear"):
        D.lora_target_modules("everything")


# -- precision phases ---------------------------------------------------------------------------------


def test_quantize_model_swaps_block_linears_but_not_the_lm_head():
    from jetrl_trainer.quant import PrecisionPhases, QuantLinear, count_quant_gemms, quantize_model

    model = quantize_model(tiny(dtype=torch.bfloat16).eval(), train="bf16", rollout="fp8")
    tr = model.model.transformer
    assert type(tr.ff_out) is nn.Linear  # found through get_output_embeddings()
    assert all(isinstance(getattr(b, n), QuantLinear) for b in tr.blocks for n in BLOCK_WEIGHTS[:7])
    ids, mask = left_padded_batch()
    with torch.no_grad(), count_quant_gemms() as counts, PrecisionPhases(model).rollout():
        logits = model(ids, attention_mask=mask).logits
    assert counts == {("rollout", "fp8"): 2 * 7}
    assert torch.isfinite(logits).all()


def test_saved_checkpoint_loads_through_trls_model_loader(tmp_path):
    # TRL builds the KL reference model with create_model_from_path, which reads `config.auto_map`;
    # a checkpoint we save has none and must still load as our class.
    from trl.trainer.utils import create_model_from_path

    from jetrl_trainer.diffusion.tiny import build_tiny_llada

    model = build_tiny_llada(vocab_size=40, mask_token_id=39)
    model.save_pretrained(tmp_path)
    reloaded = create_model_from_path(str(tmp_path))
    assert type(reloaded) is type(model)
    ids = torch.tensor([[1, 2, 3, 39]])
    assert torch.equal(reloaded(ids).logits, model(ids).logits)


# -- on CUDA -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available() or optional_module("triton_swiglu") is None, reason="needs Triton")
def test_fused_swiglu_is_bit_identical_and_runs(monkeypatch):
    from jetrl_trainer.diffusion import _fused

    model, (ids, mask) = model_fp8(), cuda_prompts()
    calls = []
    real = _fused.fused_swiglu
    monkeypatch.setattr(_fused, "fused_swiglu", lambda *a: calls.append(1) or real(*a))
    canvas = torch.cat([ids, torch.full((ids.shape[0], 16), CUDA_MASK, device="cuda")], 1)
    attn = torch.cat([mask, torch.ones_like(canvas[:, 9:])], 1)
    with torch.no_grad(), PrecisionPhases(model).rollout():
        fused = model(canvas, attention_mask=attn).logits
        served = [c for c in calls]
        for block in model.model.transformer.blocks:
            block.swiglu.fused = False
        plain = model(canvas, attention_mask=attn).logits
    assert len(served) == len(model.model.transformer.blocks)
    assert torch.equal(fused, plain)
    # and it feeds ff_out: the fused path returned a value (not None) in the FP8 phase
    assert real(torch.randn(4, 512, device="cuda", dtype=torch.bfloat16),
                torch.randn(4, 512, device="cuda", dtype=torch.bfloat16), model.model.transformer.blocks[0]) is None
    with PrecisionPhases(model).rollout():
        assert real(torch.randn(4, 512, device="cuda", dtype=torch.bfloat16),
                    torch.randn(4, 512, device="cuda", dtype=torch.bfloat16),
                    model.model.transformer.blocks[0]) is not None
