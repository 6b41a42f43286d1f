"""Which rollout backend and policy scorer a trainer gets, chosen once at init.

docs/architecture.md#one-grpo-step shows where each sits in a GRPO step.
"""

from __future__ import annotations

import logging
from typing import Any

from jetrl_trainer.compiled_forward import CompiledBackbone, compile_unavailable_reason
from jetrl_trainer.rollout import ContinuousBatchingBackend, HFGenerateBackend, RolloutBackend
from jetrl_trainer.scoring import AutoregressiveScorer, PolicyScorer

__all__ = ["build_policy_scorer", "build_rollout_backend", "resolve_exact_logprobs", "resolve_rollout_backend"]

logger = logging.getLogger("jetrl_trainer")


def resolve_rollout_backend(
    requested: str, *, diffusion: bool, continuous_batching: bool, cuda: bool = False
) -> tuple[str, str]:
    """The backend to build for ``requested`` (a `JetGRPOConfig.rollout_backend` value), and why.

    ``cuda``: the policy lives on a CUDA device, where ``auto`` picks the decode engine (it falls
    back to ``hf``, logged, for a model or generation option it does not support). Refuses a
    backend that cannot serve the model, with the setting to use instead.
    """
    if diffusion:
        if requested == "continuous" or continuous_batching:
            raise ValueError(
                "use_transformers_continuous_batching / rollout_backend='continuous' applies to autoregressive "
                "models only; LLaDA samples with jetrl_trainer.diffusion.generate. Set rollout_backend='auto'."
            )
        if requested in ("auto", "diffusion"):
            return "diffusion", "the model is a masked-diffusion LM (LLaDA)"
        # the config turns TRL's use_vllm=True into rollout_backend='vllm': name both, the user wrote one
        asked = "rollout_backend='vllm' (or use_vllm=True)" if requested == "vllm" else f"rollout_backend={requested!r}"
        raise ValueError(f"{asked} cannot sample a diffusion LM (LLaDA); use rollout_backend 'auto' or 'diffusion'.")
    if requested == "diffusion":
        raise ValueError("rollout_backend='diffusion' needs a masked-diffusion LM (LLaDA); use 'auto' or 'hf'.")
    if requested == "vllm":
        return "vllm", "requested (TRL's vLLM generation and weight sync; vLLM samples its own BF16 copy)"
    if requested == "engine":
        return "engine", "requested (falls back to 'hf' for what it does not support, logged)"
    if requested == "continuous" or (requested == "auto" and continuous_batching):
        return "continuous", "use_transformers_continuous_batching=True"
    if requested == "hf":
        return "hf", "requested"
    if cuda:
        return "engine", "the decode engine on CUDA (falls back to 'hf' for what it does not support, logged)"
    return "hf", "transformers generate off CUDA (the engine's CPU path is plain torch, for checking; " \
                 "rollout_backend='engine' opts in)"


def resolve_exact_logprobs(args: Any, model: Any, *, diffusion: bool, cuda: bool) -> tuple[bool, str]:
    """Whether the trainer runs under the exact on-policy contract (``exact_logprobs``), and why.

    ``True`` was checked against the settings by the config; here only the model can still refuse it.
    ``None`` turns it on where it applies and the engine decodes on CPU. On CUDA the exact decode runs
    the model's modules under the exact ops, not the engine's fused kernels (docs/performance.md has
    the measured cost), so
    ``None`` leaves it off there, but for the FP8 KV cache in the unified flow, which needs it."""
    from jetrl_trainer.config import exact_refusal, unified_fp8_kv_refusal
    from jetrl_trainer.rollout.engine import unsupported_model_reason

    if args.exact_logprobs is False:
        return False, "exact_logprobs=False"
    unmet = "the model is a diffusion LM, which the engine does not decode" if diffusion else args.exact_unmet()
    if unmet is None:
        reason = unsupported_model_reason(model)
        unmet = f"the decode engine cannot run this model ({reason})" if reason is not None else None
    if args.exact_logprobs or args.unified_fp8_kv:  # the config allows the unified FP8 cache under the contract only
        if unmet is not None:
            raise exact_refusal(unmet) if args.exact_logprobs else unified_fp8_kv_refusal(unmet)
        return True, ("exact_logprobs=True" if args.exact_logprobs else
                      "the unified flow with the FP8 KV cache, which the training forward reads under the exact contract")
    if unmet is not None:
        return False, unmet
    if cuda:
        return False, ("on CUDA the exact decode runs the model's modules instead of the engine's fused kernels "
                       "(about 1.12x the plain step at the 8B shape); exact_logprobs=True opts in")  # fmt: skip
    return True, "the unified flow with the engine (exact_logprobs=None)"


def build_rollout_backend(trainer: Any, *, diffusion: bool) -> tuple[RolloutBackend, Any]:
    """The trainer's backend and the sampling settings it is called with; logs the choice once."""
    args = trainer.args
    name, why = resolve_rollout_backend(
        args.rollout_backend, diffusion=diffusion, continuous_batching=args.use_transformers_continuous_batching,
        cuda=trainer.accelerator.device.type == "cuda",
    )
    logger.info("jetrl: rollout backend %r (%s)", name, why)
    if name == "vllm":
        from jetrl_trainer.rollout.vllm_backend import VLLMBackend

        if args.vllm_mode == "server":
            logger.warning("jetrl: vllm_mode='server' syncs weights through TRL's NCCL path, which has not run with "
                           "jetrl-trainer (CI is CPU-only); colocate mode is the one tested end to end (docs/vllm.md).")
        backend = VLLMBackend(trainer.vllm_generation, step=lambda: trainer.state.global_step,
                              main_process=trainer.accelerator.is_main_process)  # fmt: skip
        return backend, None  # per call: VLLMSampling(num_generations); the rest lives in TRL's VLLMGeneration
    tokenizer, device = trainer._tokenizer, trainer.accelerator.device
    if name == "diffusion":
        from jetrl_trainer.diffusion.rollout import DiffusionBackend, DiffusionSampling

        backend = DiffusionBackend(
            mask_token_id=_mask_token_id(trainer), pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=trainer.eos_token_ids, pad_to_multiple_of=trainer.pad_to_multiple_of, device=device,
            show_progress=not args.disable_tqdm and trainer.accelerator.is_local_main_process,
        )  # fmt: skip
        return backend, DiffusionSampling.from_args(args)
    if name == "continuous":
        return ContinuousBatchingBackend(trainer.continuous_batching_config), trainer.generation_config
    backend = HFGenerateBackend(
        pad_token_id=tokenizer.pad_token_id, eos_token_ids=trainer.eos_token_ids,
        pad_to_multiple_of=trainer.pad_to_multiple_of, device=device,
    )  # fmt: skip
    if name == "engine":
        from jetrl_trainer.rollout.engine import EngineBackend

        backend = EngineBackend(
            eos_token_ids=trainer.eos_token_ids, pad_token_id=tokenizer.pad_token_id, fallback=backend,
            kv_cache_tokens=args.rollout_kv_cache_tokens, kv_cache_dtype=args.rollout_kv_cache_dtype,
            kv_cache_bytes=None if args.rollout_kv_cache_gib is None else int(args.rollout_kv_cache_gib * 2**30),
            requested=args.rollout_backend, keep_state=args.rollout_keep_engine_state,
            pad_to_multiple_of=trainer.pad_to_multiple_of, exact=trainer.exact_logprobs,
            autocast=trainer.accelerator.autocast,
        )  # fmt: skip
    return backend, trainer.generation_config


def build_policy_scorer(trainer: Any, *, diffusion: bool, trl_token_logps: Any) -> PolicyScorer:
    """K = 1 TRL log-probs for autoregressive models; per-iteration mask-seed slices for diffusion."""
    args = trainer.args
    if not diffusion:
        return AutoregressiveScorer(trl_token_logps, _sampling_config(trainer), trainer.accelerator.autocast,
                                    compiled=_compiled_backbone(trainer), exact=trainer.exact_logprobs,
                                    kv_roundtrip=trainer.exact_kv_roundtrip)  # fmt: skip
    if args.compile_policy_forward:
        logger.warning("compile_policy_forward: not implemented for diffusion LMs; the policy's forward runs eagerly.")
    from jetrl_trainer.diffusion.scoring import DiffusionScorer

    return DiffusionScorer(
        estimator=args.likelihood_estimator, p_mask_prompt=args.p_mask_prompt, n_mc=args.likelihood_mc_samples,
        antithetic=args.likelihood_antithetic, gen_length=args.max_completion_length,
        mask_token_id=_mask_token_id(trainer), temperature=trainer.temperature, seed=args.seed,
        num_iterations=trainer.num_iterations, entropy_grad=trainer._entropy_bonus_enabled,
        autocast=trainer.accelerator.autocast,
    )  # fmt: skip


def _compiled_backbone(trainer: Any) -> CompiledBackbone | None:
    """``compile_policy_forward``: the policy's decoder stack compiled, or None (reason logged once)."""
    args = trainer.args
    if not args.compile_policy_forward:
        return None
    reason = compile_unavailable_reason(trainer.model, bool(args.gradient_checkpointing))
    if reason is not None:
        logger.warning("compile_policy_forward: %s; the policy's forward runs eagerly.", reason)
        return None
    return CompiledBackbone(trainer.model, length_multiple=args.compile_length_multiple, backend=args.compile_backend,
                            mode=args.compile_mode)  # fmt: skip


def _sampling_config(trainer: Any) -> Any:
    """The sampling settings the rollouts used; TRL builds no ``generation_config`` when vLLM samples."""
    if getattr(trainer, "generation_config", None) is not None:
        return trainer.generation_config
    from transformers import GenerationConfig

    return GenerationConfig(temperature=trainer.temperature, top_k=trainer.top_k, top_p=trainer.top_p,
                            min_p=trainer.min_p, do_sample=True)  # fmt: skip


def _mask_token_id(trainer: Any) -> int:
    config = trainer.accelerator.unwrap_model(trainer.model).config
    if getattr(config, "mask_token_id", None) is None:
        raise ValueError("the diffusion model's config has no mask_token_id; set config.mask_token_id.")
    return int(config.mask_token_id)
