"""LoRA target presets for LLaDA's module names.

LLaDA calls both the MLP down projection (``blocks.{i}.ff_out``) and the LM head
(``transformer.ff_out``) ``ff_out``. peft matches a list entry ``"ff_out"`` against every module
whose name *ends* in ``.ff_out``, so a naive list puts an adapter on the 126k-wide LM head. The
presets are therefore full-match regular expressions anchored on ``blocks.<i>.``, which peft
applies with ``re.fullmatch`` whenever ``target_modules`` is a string.

Presets:

* ``"all_linear"`` — every projection of every block (q, k, v, attn_out, ff_proj, up_proj, ff_out).
* ``"attention"``  — q_proj, k_proj, v_proj, attn_out.
* ``"mlp"``        — ff_proj, up_proj, ff_out.
* ``"d1"``         — q_proj, k_proj, v_proj, up_proj: what d1 / diffu-GRPO actually adapts. Its
  Llama-style list (``q,k,v,o,gate,up,down_proj``) only matches those four names in LLaDA.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["LLADA_LM_HEAD", "LORA_PRESETS", "check_lora_targets", "lora_target_modules", "resolve_lora_preset"]

LLADA_LM_HEAD = "model.transformer.ff_out"
"""Fully qualified name of the LM head inside :class:`LLaDAModelLM` (keep it out of LoRA / quantization)."""

LORA_PRESETS: dict[str, tuple[str, ...]] = {
    "all_linear": ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"),
    "attention": ("q_proj", "k_proj", "v_proj", "attn_out"),
    "mlp": ("ff_proj", "up_proj", "ff_out"),
    "d1": ("q_proj", "k_proj", "v_proj", "up_proj"),
}


def lora_target_modules(preset: str = "all_linear") -> str:
    """A ``target_modules`` regex for ``peft.LoraConfig`` that never matches the LM head.

    >>> LoraConfig(r=16, target_modules=lora_target_modules("attention"))
    """
    if preset not in LORA_PRESETS:
        raise ValueError(f"Unknown LLaDA LoRA preset {preset!r}; choose one of {sorted(LORA_PRESETS)}.")
    names = "|".join(LORA_PRESETS[preset])
    # ``(.*\.)?`` keeps the regex valid under any wrapper prefix (peft's ``base_model.model.``).
    return rf"(.*\.)?blocks\.\d+\.({names})"


def resolve_lora_preset(peft_config: Any) -> Any:
    """A copy of ``peft_config`` whose ``target_modules`` preset name (``"all_linear"``, ...) is its regex.

    Any other config is returned as it is. Preset names are no valid peft target for any model (peft
    full-matches a string against whole module names), so resolving them before peft sees the
    config cannot change what another model's LoRA adapts.
    """
    targets = getattr(peft_config, "target_modules", None)
    if not (isinstance(targets, str) and targets in LORA_PRESETS):
        return peft_config
    peft_config = copy.copy(peft_config)
    peft_config.target_modules = lora_target_modules(targets)
    return peft_config


def check_lora_targets(peft_config: Any) -> None:
    """Refuse a LoRA config that would adapt LLaDA's LM head (``model.transformer.ff_out``).

    A plain list such as ``["ff_out"]`` catches the head too (it shares the MLP's suffix).
    """
    targets = getattr(peft_config, "target_modules", None)
    if targets is None:
        return
    from peft.tuners.tuners_utils import check_target_module_exists

    if check_target_module_exists(resolve_lora_preset(peft_config), LLADA_LM_HEAD):
        raise ValueError(
            f"LoRA target_modules={targets!r} would put an adapter on LLaDA's LM head {LLADA_LM_HEAD!r} (the "
            "MLP down projections and the head share the name 'ff_out'). Use a preset: target_modules="
            f"'all_linear' (or one of {sorted(LORA_PRESETS)}), or jetrl_trainer.diffusion.lora_target_modules()."
        )
