"""LLaDA (masked-diffusion LM): modeling, sampler, likelihood estimator, LoRA presets, and the
rollout backend and policy scorer that `JetGRPOTrainer` uses for it.

Importing this package registers ``model_type="llada"`` with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM``, so the published checkpoints load with our code and no remote code::

    import jetrl_trainer.diffusion  # noqa: F401  (registers "llada")
    model = AutoModelForCausalLM.from_pretrained("GSAI-ML/LLaDA-8B-Instruct", dtype=torch.bfloat16)

``import jetrl_trainer`` alone does not import this package (it would pull in transformers).
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_llada import LLaDAConfig
from .likelihood import (
    LikelihoodEstimator,
    available_estimators,
    elbo_logps,
    get_estimator,
    mask_seeds_for_step,
    mean_field_logps,
    register_estimator,
)
from .lora import LLADA_LM_HEAD, LORA_PRESETS, check_lora_targets, lora_target_modules
from .modeling_llada import LLaDAModel, LLaDAModelLM
from .rollout import DiffusionBackend, DiffusionSampling
from .sampler import DenoiseStepInfo, generate
from .scoring import DiffusionScorer
from .tiny import build_tiny_llada, tiny_llada_config
from .warm_start import diffusion_warm_start

__all__ = [
    "LLaDAConfig",
    "LLaDAModel",
    "LLaDAModelLM",
    "is_diffusion_model",
    "generate",
    "DenoiseStepInfo",
    "LikelihoodEstimator",
    "get_estimator",
    "register_estimator",
    "available_estimators",
    "mean_field_logps",
    "elbo_logps",
    "mask_seeds_for_step",
    "LLADA_LM_HEAD",
    "LORA_PRESETS",
    "lora_target_modules",
    "check_lora_targets",
    "DiffusionBackend",
    "DiffusionSampling",
    "DiffusionScorer",
    "build_tiny_llada",
    "tiny_llada_config",
    "diffusion_warm_start",
]


def _register() -> None:
    # exist_ok: re-importing (e.g. importlib.reload in tests) must not fail.
    AutoConfig.register(LLaDAConfig.model_type, LLaDAConfig, exist_ok=True)
    AutoModel.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
    AutoModelForCausalLM.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)


def is_diffusion_model(model: object) -> bool:
    """True when ``model`` (possibly wrapped by peft / accelerate) is a LLaDA model."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == LLaDAConfig.model_type


_register()
