"""Saving and sharing: master weights under their normal names, and a model card that says how.

A quantized policy is still an ordinary model: `QuantLinear` subclasses ``nn.Linear`` and shares
the original ``weight`` / ``bias`` Parameters, so ``save_pretrained`` writes the master weights
(BF16 when the model was loaded in BF16) under the usual names and a plain
``AutoModelForCausalLM.from_pretrained`` loads them. Nothing else reaches the state dict: the
quantized weight cache is a plain attribute, not a buffer, and the fused norm/SwiGLU modules hold
the same Parameters under the same names (``tests/trainer/test_hub.py`` checks both), so there is nothing to
filter at save time.

`export_fp8_checkpoint` writes the other kind: the FP8 weights the rollout phase ran, for serving
engines. Every `QuantLinear` whose rollout recipe is FP8 stores its cached ``(q, s_inv)`` pair bit
for bit (``weight`` in ``float8_e4m3fn``, ``weight_scale_inv`` FP32 ``[ceil(N/128), ceil(K/128)]``,
128×128 blocks), so nothing is re-quantized on the way out; everything else (embeddings, norms,
``lm_head``, layers kept in BF16) keeps its master weight. ``config.json`` gets the block-FP8
``quantization_config`` that vLLM (``quantization="fp8"``) and transformers' FineGrainedFP8 read.
What the engine then does with the *activations* is its own: vLLM and transformers quantize them
dynamically in 1×128 groups, with a scale that can differ from ours in the last bit (docs/vllm.md).

The model card gets the ``jetrl`` tag, a ``jetrl`` metadata block (precisions, corrector, quant
options) and a short section in words.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from typing import Any

import torch
from torch import nn

__all__ = [
    "FP8_BLOCK",
    "JETRL_TAG",
    "export_fp8_checkpoint",
    "fp8_quantization_config",
    "jetrl_card_metadata",
    "jetrl_card_section",
    "load_fp8_checkpoint",
    "push_to_hub",
    "update_model_card",
]

FP8_BLOCK = (128, 128)  # the weight block of our FP8 recipe, and of the exported checkpoint

JETRL_TAG = "jetrl"
_BEGIN, _END = "<!-- jetrl:begin -->", "<!-- jetrl:end -->"


def jetrl_card_metadata(args: Any) -> dict[str, Any]:
    """The ``jetrl`` block of the card's YAML metadata, from a `JetGRPOConfig`."""
    corrector = getattr(args, "corrector_name", None) or str(getattr(args, "corrector", "none"))
    meta: dict[str, Any] = {
        "train_precision": args.train_precision,
        "rollout_precision": args.rollout_precision,
        "unified_precision": args.train_precision == args.rollout_precision,
        "corrector": corrector,
    }
    params = args.corrector_params() if hasattr(args, "corrector_params") and isinstance(args.corrector, str) else {}
    if params:
        meta["corrector_params"] = params
    if "fp8" in (args.train_precision, args.rollout_precision):
        meta["fp8_scale_format"] = args.fp8_scale_format
    if "nvfp4" in (args.train_precision, args.rollout_precision):
        meta["nvfp4_backward"] = args.nvfp4_backward
    if args.keep_last_n_layers_bf16:
        meta["keep_last_n_layers_bf16"] = args.keep_last_n_layers_bf16
    if args.keep_bf16_modules:
        meta["keep_bf16_modules"] = list(args.keep_bf16_modules)
    return meta


def jetrl_card_section(args: Any) -> str:
    """A short Markdown section saying how the model was trained."""
    meta = jetrl_card_metadata(args)
    if meta["unified_precision"]:
        flow = (
            f"unified precision flow: rollouts and training both ran in **{meta['train_precision']}**, on the "
            "same quantized modules"
        )
    else:
        handled = "not corrected" if meta["corrector"] == "none" else f"managed by the `{meta['corrector']}` corrector"
        flow = (
            f"rollouts in **{meta['rollout_precision']}**, training in **{meta['train_precision']}** "
            f"(the mismatch between them {handled})"
        )
    params = ", ".join(f"{k}={v}" for k, v in meta.get("corrector_params", {}).items())
    lines = [
        _BEGIN,
        "## Low-precision RL (jetrl-trainer)",
        "",
        f"Trained with GRPO by `JetGRPOTrainer` (jetrl-trainer); {flow}.",
        "",
        f"- train precision: `{meta['train_precision']}`",
        f"- rollout precision: `{meta['rollout_precision']}`",
        f"- corrector: `{meta['corrector']}`" + (f" ({params})" if params else ""),
    ]
    for key in ("fp8_scale_format", "nvfp4_backward", "keep_last_n_layers_bf16", "keep_bf16_modules"):
        if key in meta:
            lines.append(f"- {key}: `{meta[key]}`")
    lines += [
        "",
        "The weights in this repository are the master weights (not quantized copies), under their usual "
        "names: they load with `AutoModelForCausalLM.from_pretrained`.",
        _END,
    ]
    return "\n".join(lines)


def update_model_card(readme_path: str | os.PathLike, args: Any) -> None:
    """Add (or refresh) the jetrl tag, metadata block and section of the card at ``readme_path``.

    Creates a minimal card when the file does not exist. Idempotent.
    """
    from huggingface_hub import ModelCard

    if os.path.exists(readme_path):
        card = ModelCard.load(readme_path)
    else:
        card = ModelCard("---\nlibrary_name: transformers\n---\n")
    tags = list(card.data.tags or [])
    if JETRL_TAG not in tags:
        tags.append(JETRL_TAG)
    card.data.tags = tags
    card.data.jetrl = jetrl_card_metadata(args)
    text = re.sub(re.escape(_BEGIN) + r".*?" + re.escape(_END), "", card.text, flags=re.DOTALL).rstrip()
    card.text = f"{text}\n\n{jetrl_card_section(args)}\n" if text else f"{jetrl_card_section(args)}\n"
    card.save(readme_path)


# ---------------------------------------------------------------- FP8-block export


def fp8_quantization_config(modules_to_not_convert: list[str], *, scale_format: str = "fp32") -> dict[str, Any]:
    """The ``quantization_config`` of a block-FP8 checkpoint (the layout vLLM and transformers read)."""
    config: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
        "modules_to_not_convert": sorted(modules_to_not_convert),
    }
    if scale_format == "ue8m0":  # power-of-two scales, as DeepSeek's ue8m0 checkpoints mark them
        config["scale_fmt"] = "ue8m0"
    return config


def _fp8_layers(model: nn.Module) -> tuple[dict[str, Any], list[str], set[str]]:
    """``{name: QuantLinear}`` with an FP8 rollout recipe, the other Linear names, the scale formats."""
    from jetrl_trainer.quant import FP8Recipe, QuantLinear

    fp8, others, formats = {}, [], set()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and isinstance(module.recipes["rollout"], FP8Recipe):
            fp8[name] = module
            formats.add(module.recipes["rollout"].scale_format)
        elif isinstance(module, QuantLinear) and module.recipes["rollout"].quantized:
            raise ValueError(
                f"{name} rolls out in {module.recipes['rollout'].name}: only FP8 checkpoints can be exported (NVFP4 "
                "export is not supported). Save the master weights with save_pretrained instead."
            )
        elif isinstance(module, nn.Linear):
            others.append(name)
    return fp8, others, formats


# Projections that vLLM loads into one fused block-FP8 weight (qkv_proj, gate_up_proj): each shard's
# scale rows start at its offset / 128, so an out size off the block grid cannot be placed.
_VLLM_FUSED_SHARDS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _warn_off_grid_fused_shards(fp8: dict[str, Any]) -> None:
    off_grid = [f"{name} ({module.out_features})" for name, module in fp8.items()
                if name.rsplit(".", 1)[-1] in _VLLM_FUSED_SHARDS and module.out_features % FP8_BLOCK[0]]  # fmt: skip
    if off_grid:
        warnings.warn(
            f"vLLM cannot load this FP8 checkpoint: it fuses q/k/v and gate/up into one block-FP8 weight, which "
            f"needs each one's out size to be a multiple of {FP8_BLOCK[0]}, and these are not: "
            f"{', '.join(off_grid[:4])}{' ...' if len(off_grid) > 4 else ''}. transformers and load_fp8_checkpoint "
            "read it; for vLLM, give the model head counts whose q/k/v sizes are multiples of 128.",
            stacklevel=3,
        )


def export_fp8_checkpoint(model: nn.Module, save_directory: str | os.PathLike, *, tokenizer: Any = None,
                          args: Any = None, safe_serialization: bool = True) -> dict[str, Any]:  # fmt: skip
    """Write ``model`` as a block-FP8 checkpoint: the FP8 weights its rollout phase used, bit for bit.

    ``model`` is a policy converted by `quantize_model` (``trainer.model`` after training) with an
    FP8 rollout recipe. A LoRA (peft) model must be merged first (``merge_and_unload()``) and
    quantized again, since its rollouts ran the FP8 base plus BF16 adapters, which no single FP8
    weight reproduces. ``tokenizer`` is saved beside it; ``args`` (a `JetGRPOConfig`) adds the jetrl
    section to the model card. Returns the ``quantization_config`` written into ``config.json``.
    """
    if hasattr(model, "peft_config"):
        raise ValueError(
            "export_fp8_checkpoint got a peft model: merge the adapters first (model = model.merge_and_unload()), "
            "then quantize_model(model, train=..., rollout='fp8') and export that."
        )
    fp8, others, formats = _fp8_layers(model)
    if not fp8:
        raise ValueError(
            "the model has no FP8 rollout layers to export: convert it first with "
            "jetrl_trainer.quant.quantize_model(model, train=..., rollout='fp8'), or save BF16 with save_pretrained."
        )
    if len(formats) > 1:
        raise ValueError(f"the FP8 layers mix scale formats {sorted(formats)}; a checkpoint holds one.")
    _warn_off_grid_fused_shards(fp8)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for name, module in fp8.items():
            q, s_inv = module.quantized_weight(module.recipes["rollout"])  # the rollout's own cached operands
            state[f"{name}.weight"] = q.detach().contiguous()
            state[f"{name}.weight_scale_inv"] = s_inv.detach().float().contiguous()
    os.makedirs(save_directory, exist_ok=True)
    model.save_pretrained(save_directory, state_dict=state, safe_serialization=safe_serialization)
    quant_config = fp8_quantization_config(others, scale_format=formats.pop())
    config_path = os.path.join(save_directory, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(save_directory)
    readme = os.path.join(save_directory, "README.md")
    if args is not None:
        update_model_card(readme, args)
    _add_fp8_card_section(readme, quant_config, n_fp8=len(fp8))
    return quant_config


def load_fp8_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> tuple[nn.Module, dict]:
    """Load an exported FP8 checkpoint on any device: the model with dequantized weights, and the raw pairs.

    Returns ``(model, fp8)``: ``model`` is the transformers model whose FP8 linears hold
    ``dequantize_fp8_blocks(q, s_inv)`` in ``dtype`` (default: the checkpoint's ``dtype``);
    ``fp8`` maps each converted module name to its ``(q, s_inv)`` as stored. Use it to check what
    was exported, or to run the checkpoint where no FP8 GEMM exists.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    quant = getattr(config, "quantization_config", None)
    quant = quant if isinstance(quant, dict) else getattr(quant, "to_dict", lambda: None)()
    if not quant or quant.get("quant_method") != "fp8" or list(quant.get("weight_block_size") or []) != list(FP8_BLOCK):
        raise ValueError(f"{path} is not a 128x128 block-FP8 checkpoint (config.json quantization_config: {quant}).")
    state: dict[str, torch.Tensor] = {}
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        state.update(load_file(os.path.join(path, file)))
    fp8 = {k[: -len(".weight_scale_inv")]: (state[k[: -len("_scale_inv")]], state[k])
           for k in state if k.endswith(".weight_scale_inv")}  # fmt: skip
    del config.quantization_config  # built plain; the FP8 pairs are dequantized below
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    from jetrl_trainer.quant import dequantize_fp8_blocks

    for name, (q, s_inv) in fp8.items():
        state[f"{name}.weight"] = dequantize_fp8_blocks(q, s_inv, FP8_BLOCK[0], dtype=dtype)
        del state[f"{name}.weight_scale_inv"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in _tied_names(model)]
    if missing or unexpected:
        raise ValueError(f"{path} does not match its config: missing {missing}, unexpected {unexpected}.")
    model.tie_weights()
    return model, fp8


def _tied_names(model: nn.Module) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied if not isinstance(tied, dict) else tied.keys())


def _add_fp8_card_section(readme_path: str, quant_config: dict[str, Any], *, n_fp8: int) -> None:
    from huggingface_hub import ModelCard

    card = ModelCard.load(readme_path) if os.path.exists(readme_path) else ModelCard("---\nlibrary_name: transformers\n---\n")
    card.data.tags = sorted(set(card.data.tags or []) | {JETRL_TAG, "fp8"})
    kept = ", ".join(f"`{m}`" for m in quant_config["modules_to_not_convert"]) or "none"
    section = "\n".join([
        _FP8_BEGIN,
        "## FP8-block checkpoint",
        "",
        f"The weights of {n_fp8} linear layers are the FP8 E4M3 weights that the rollouts ran, bit for bit, in "
        "128x128 blocks with `weight_scale_inv` dequantization multipliers (`quant_method: fp8`, "
        "`weight_block_size: [128, 128]`, `activation_scheme: dynamic`). Embeddings, norms and the linear layers "
        f"kept in BF16 ({kept}) hold the master weights. Serve it with vLLM (`quantization=\"fp8\"` is read from "
        "the config) or load it with transformers (FineGrainedFP8; dequantized to BF16 where no FP8 GEMM exists).",
        _FP8_END,
    ])  # fmt: skip
    text = re.sub(re.escape(_FP8_BEGIN) + r".*?" + re.escape(_FP8_END), "", card.text, flags=re.DOTALL).rstrip()
    card.text = f"{text}\n\n{section}\n" if text else f"{section}\n"
    card.save(readme_path)


_FP8_BEGIN, _FP8_END = "<!-- jetrl-fp8:begin -->", "<!-- jetrl-fp8:end -->"


def push_to_hub(model: nn.Module, repo_id: str, *, fp8: bool = False, tokenizer: Any = None, args: Any = None,
                private: bool | None = None, token: str | None = None, commit_message: str | None = None) -> Any:  # fmt: skip
    """Upload ``model`` to the Hub: its master weights (``fp8=False``) or the FP8-block checkpoint (``fp8=True``).

    The FP8 upload is exactly the folder `export_fp8_checkpoint` writes. ``args`` (a
    `JetGRPOConfig`) adds the jetrl card section. Returns ``HfApi.upload_folder``'s commit info.
    """
    from huggingface_hub import HfApi

    with tempfile.TemporaryDirectory() as folder:
        if fp8:
            export_fp8_checkpoint(model, folder, tokenizer=tokenizer, args=args)
        else:
            model.save_pretrained(folder)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
            if args is not None:
                update_model_card(os.path.join(folder, "README.md"), args)
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        message = commit_message or ("Upload FP8-block checkpoint (jetrl-trainer)" if fp8 else "Upload model (jetrl-trainer)")
        return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=message)
