"""Saving and sharing: master weights under their normal names, and a model card that says how.

A quantized policy is still an ordinary model: `QuantLinear` subclasses ``nn.Linear`` and shares
the original ``weight`` / ``bias`` Parameters, so ``save_pretrained`` writes the master weights
(BF16 when the model was loaded in BF16) under the usual names and a plain
``AutoModelForCausalLM.from_pretrained`` loads them. Nothing else reaches the state dict: the
quantized weight cache is a plain attribute, not a buffer, and the fused norm/SwiGLU modules hold
the same Parameters under the same names (``tests/test_hub.py`` checks both), so there is nothing to
filter at save time. No FP8-block checkpoint exporter exists yet.

The model card gets the ``jetrl`` tag, a ``jetrl`` metadata block (precisions, corrector, quant
options) and a short section in words.
"""

from __future__ import annotations

import os
import re
from typing import Any


__all__ = ["JETRL_TAG", "jetrl_card_metadata", "jetrl_card_section", "update_model_card"]

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
