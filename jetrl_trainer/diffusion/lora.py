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

__all__ = ["LLADA_LM_HEAD", "LORA_PRESETS", "lora_target_modules"]

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
