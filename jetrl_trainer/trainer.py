"""`JetGRPOTrainer`: TRL's GRPO with low-precision rollouts and training (docs/architecture.md#one-grpo-step).

One GRPO step, and what does each part. The trainer holds two small objects chosen at init: a
**rollout backend** (`jetrl_trainer.rollout`; ``rollout_backend``) and a **policy scorer**
(`jetrl_trainer.scoring`: log-probs ``(B, K, T)``, K = 1 for autoregressive models, one slice per
inner iteration and mask seed for a diffusion LM). A LLaDA model is a different pair, not a
different class.

```
prompts ─► backend.generate, in precision_phases.rollout()  ─► completion ids + sampling log-probs
        ─► rewards ─► group advantages                                                     (TRL)
        ─► old log-probs: scorer, train phase, no grad
           (sampling log-probs too, in the rollout phase, when the backend recorded none;
           with exact_logprobs the recorded ones are those bits: checked every exact_check_every-th batch)
        ─► per slice: corrector(old, sampling, mask, advantages) ─► weights [B, T] + mismatch sums
        ─► TRL's per-token surrogate × weights ─► backward ─► guarded optimizer step
        ─► weight_cache_refresh: the policy re-quantizes its weights on its next forward
```

How this departs from TRL 1.16's `GRPOTrainer` (docs/architecture.md#where-it-meets-trl):

* the policy's ``nn.Linear`` layers become `QuantLinear` at init (`quantize_model`); the reference
  model, when there is one, is quantized with the *training* recipe in both phases;
* every backend returns the sampling log-probs (TRL returns them only from vLLM). vLLM itself
  (``rollout_backend="vllm"``) goes through TRL's own generation and weight sync, with our corrector
  in place of TRL's vLLM importance-sampling correction (`jetrl_trainer.rollout.vllm_backend`);
* the corrector weights go into TRL's own importance-sampling slot: ``_compute_loss`` multiplies
  the per-token surrogate by ``inputs["importance_sampling_ratio"]`` after clipping and before the
  KL term, for every ``loss_type`` (VESPO folds it into its gamma weights, as TRL does);
* ``mismatch/*`` and ``corrector/*`` are logged every generation, exact across processes
  (additive sums all-reduced, then turned into metrics);
* an optimizer step with a non-finite loss or gradient is skipped (``jetrl/skipped_steps``);
* saved checkpoints hold the master weights under their usual names; the card says how. Each
  ``checkpoint-N`` is written into a staging folder and renamed into place once complete, and a
  resume skips incomplete ones (`jetrl_trainer.checkpoint`);
* bad input is refused at construction (`jetrl_trainer._inputs`), and reward outputs are checked
  where TRL computes them: wrong types raise, NaN/inf count as missing (`jetrl_trainer._rewards`).

The overrides of TRL's private methods form one thin layer (``_generate_single_turn``,
``_generate_and_score_completions``, ``_get_per_token_logps_and_entropies``, ``_compute_loss``);
tests/trainer/test_trl_contract.py checks each contract they rely on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation

import jetrl_trainer.diffusion  # noqa: F401  (registers model_type "llada", so LLaDA ids load)
from jetrl_trainer._composition import build_policy_scorer, build_rollout_backend, logger, resolve_exact_logprobs
from jetrl_trainer._dist import all_reduce_sums, any_across_processes
from jetrl_trainer._guard import NonFiniteGuard
from jetrl_trainer._inputs import check_datasets, check_diffusion_fields
from jetrl_trainer._rewards import RewardChecks
from jetrl_trainer.checkpoint import StagedCheckpoint, checkpoint_state, resolve_resume, rotate_checkpoints
from jetrl_trainer.config import JetGRPOConfig
from jetrl_trainer.correctors import get_corrector, merge_sums, metrics_from_sums
from jetrl_trainer.diffusion import is_diffusion_model
from jetrl_trainer.diffusion.lora import check_lora_targets, resolve_lora_preset
from jetrl_trainer.exact import ExactOps
from jetrl_trainer.hub import update_model_card
from jetrl_trainer.quant import PrecisionPhases, WeightCacheRefresh, quantize_model
from jetrl_trainer.rollout import Rollout, VLLMSampling
from jetrl_trainer.rollout.engine import kv_roundtrip

__all__ = ["JetGRPOTrainer"]

SKIPPED_STEPS_KEY = "jetrl/skipped_steps"


class JetGRPOTrainer(GRPOTrainer):
    """GRPO in FP8/NVFP4: unified precision flow or corrected BF16/FP8 baseline, on `trl.GRPOTrainer`.

    Use it exactly like ``trl.GRPOTrainer``, with a [`JetGRPOConfig`] (``train_precision``,
    ``rollout_precision``, ``corrector``, ``rollout_backend`` and friends). ``model`` may be a model
    id (loaded with ``args.model_init_kwargs``), a model object, or a peft model (only the frozen
    base layers are quantized; adapters stay in their dtype); the model is converted in place.
    A LLaDA (masked-diffusion) model, or an id of one, trains through the same class: it gets the
    diffusion backend and scorer (docs/llada.md).

    Overrides ``__init__``, ``_generate_single_turn``, ``_generate_and_score_completions``,
    ``_get_per_token_logps_and_entropies``, ``_compute_loss``, ``_calculate_rewards``, ``train``,
    ``training_step``, ``create_optimizer``, ``log``, ``_get_output_dir``, ``_save_checkpoint``,
    ``_push_from_checkpoint``, ``_save`` and ``create_model_card``; everything else is inherited.

    Two objects it owns carry the state that the precision flow switches (`jetrl_trainer.quant`):

    * ``precision_phases``, a ``PrecisionPhases`` over the policy: the rollout runs inside its
      ``rollout()`` block, everything else in the training phase its ``QuantLinear``s start in;
    * ``weight_cache_refresh``, a ``WeightCacheRefresh`` registered on the optimizer that updates the
      weights (under accelerate's and DeepSpeed's wrappers), so that every optimizer step makes the
      policy re-quantize its weights once. It is registered at the first ``training_step``, when
      the optimizer is final (a DeepSpeed JSON optimizer included); a reference model that TRL
      syncs from the policy (``sync_ref_model``) gets one too. ``None`` before training.

    Not supported: FP8 rollouts in vLLM and vLLM server mode on CPU (refused by the config),
    multimodal prompts; tools and environments with a diffusion LM.
    """

    _tag_names = ["trl", "grpo", "jetrl"]
    _name = "JetRL GRPO"
    _staging_root: str | None = None  # set while _save_checkpoint runs (see _get_output_dir)
    _pending_push: str | None = None

    def __init__(self, model: Any, reward_funcs: Any = None, args: JetGRPOConfig | None = None, **kwargs: Any):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = JetGRPOConfig(f"{name.split('/')[-1]}-JetGRPO")
        elif not isinstance(args, JetGRPOConfig):
            raise ValueError(
                f"JetGRPOTrainer needs a JetGRPOConfig (it accepts every GRPOConfig field); got {type(args).__name__}."
            )
        if kwargs.get("peft_config") is not None:
            kwargs["peft_config"] = resolve_lora_preset(kwargs["peft_config"])
        if not isinstance(model, str) and is_diffusion_model(model):  # before TRL's init applies LoRA
            _check_diffusion_kwargs(kwargs)
        check_datasets(kwargs.get("train_dataset"), kwargs.get("eval_dataset"))
        _check_vllm_model(model, args)
        super().__init__(model, reward_funcs, args=args, **kwargs)
        if self._is_vlm:
            raise ValueError("JetGRPOTrainer supports text-only models; multimodal processors are not supported.")
        diffusion = is_diffusion_model(self.accelerator.unwrap_model(self.model))
        if diffusion and isinstance(model, str):  # known only once TRL has loaded the id
            _check_diffusion_kwargs(kwargs)
        check_diffusion_fields(args, self.accelerator.unwrap_model(self.model), diffusion=diffusion)
        self._reward_checks = RewardChecks(args.max_nonfinite_reward_batches)
        self.reward_funcs = self._reward_checks.wrap_all(self.reward_funcs, self.reward_func_names)
        params = args.corrector_params() if isinstance(args.corrector, str) else {}
        self.corrector = get_corrector(args.corrector, **params)
        self._quantize_models()
        self.precision_phases = PrecisionPhases(self.model)
        self.exact_logprobs, why = resolve_exact_logprobs(
            args, self.accelerator.unwrap_model(self.model), diffusion=diffusion,
            cuda=self.accelerator.device.type == "cuda",
        )  # fmt: skip
        logger.info("jetrl: exact on-policy log-probs %s (%s)", "on" if self.exact_logprobs else "off", why)
        # With the FP8 KV cache the training forward's attention reads keys and values as the cache stores them.
        self.exact_kv_roundtrip = kv_roundtrip(args.rollout_kv_cache_dtype) if self.exact_logprobs else None
        self._generation_batches = 0  # counts the exact contract's checks (exact_check_every)
        self.weight_cache_refresh: WeightCacheRefresh | None = None  # see _follow_optimizer
        self._ref_cache_refresh: WeightCacheRefresh | None = None
        self.rollout_backend, self.rollout_sampling = build_rollout_backend(self, diffusion=diffusion)
        self.policy_scorer = build_policy_scorer(
            self, diffusion=diffusion, trl_token_logps=super()._get_per_token_logps_and_entropies
        )
        self._active_slices: Tensor | None = None  # see _scoring
        self._logprob_sources: set[str] = set()
        self._guard = NonFiniteGuard(lambda flag: any_across_processes(flag, self.accelerator.device))
        self._jet_sums: dict[str, dict[str, Tensor] | None] = {"train": None, "eval": None}

    # ------------------------------------------------------------------ setup

    def _quant_kwargs(self) -> dict[str, Any]:
        a = self.args
        return dict(
            keep_last_n_layers=a.keep_last_n_layers_bf16,
            keep_modules=tuple(a.keep_bf16_modules or ()),
            scale_format=a.fp8_scale_format,
            nvfp4_backward=a.nvfp4_backward,
            fuse_norms=a.fuse_norm_quant,
        )

    def _quantize_models(self) -> None:
        """Swap Linear layers for QuantLinear in place (Parameters shared, so the optimizer sees them)."""
        a = self.args
        quantize_model(self.model, train=a.train_precision, rollout=a.rollout_precision, **self._quant_kwargs())
        if self.ref_model is not None:
            # The KL reference is evaluated in the training phase only: same recipe in both phases.
            ref = self.accelerator.unwrap_model(self.ref_model)
            quantize_model(ref, train=a.train_precision, rollout=a.train_precision, **self._quant_kwargs())

    @property
    def _needs_train_logps(self) -> bool:
        a = self.args
        return self.exact_logprobs or a.corrector_active or a.train_precision != a.rollout_precision or a.log_mismatch

    # ------------------------------------------------------------------ rollout (TRL hook)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images or multimodal_fields or has_tool_images:
            raise ValueError("JetGRPOTrainer supports text-only rollouts; got images or multimodal fields.")
        backend = self.rollout_backend
        if backend.name == "vllm":  # vLLM samples its own, synced copy: no phase, no unwrapping
            rollout = backend.generate(self.model, prompt_ids, VLLMSampling(num_generations))
            self._note_logprob_source(rollout)
            return rollout.completion_ids, rollout.logprobs
        with (
            self.precision_phases.rollout(),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs if backend.name in ("hf", "engine") else None,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            rollout = backend.generate(unwrapped_model, prompt_ids, self.rollout_sampling)
        self._note_logprob_source(rollout)
        stats = getattr(backend, "last_stats", None)  # the engine's: how long the graph captures took
        if stats:
            metrics = self._metrics["train" if self.model.training else "eval"]
            metrics["rollout/engine_capture_seconds"].append(stats["capture_seconds"])
            metrics["rollout/engine_reused_state"].append(float(stats["reused_state"]))
        return rollout.completion_ids, rollout.logprobs

    def _note_logprob_source(self, rollout: Rollout) -> None:
        if rollout.logprob_source not in self._logprob_sources:
            self._logprob_sources.add(rollout.logprob_source)
            logger.info("jetrl: %s rollout log-probs %s", self.rollout_backend.name, rollout.logprob_source)

    # ------------------------------------------------------------------ scoring + corrector (TRL hooks)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if self.model.training else "eval"
        device = self.accelerator.device
        slices = {k: v.to(device).expand(len(inputs), -1) for k, v in self.policy_scorer.new_slices(mode).items()}
        # Exact log-probs: the recorded ones are the old ones, so TRL's own old-log-prob forward (which it
        # runs when num_iterations makes generation and optimizer steps misaligned) is skipped; TRL reads
        # num_iterations there only to decide that (tests/trainer/test_trl_contract.py).
        skip_old = _attributes(self, num_iterations=1) if self.exact_logprobs else contextlib.nullcontext()
        with self._scoring(next(iter(slices.values()), None)), skip_old:  # TRL's reference / old log-prob calls
            batch = super()._generate_and_score_completions(inputs)
        batch.update({k: v.clone() for k, v in slices.items()})
        if self._needs_train_logps:
            self._correct(batch, mode)
        return batch

    def _correct(self, batch: dict[str, Any], mode: str) -> None:
        """Sampling and old log-probs of every slice, corrector weights and mismatch sums (in place)."""
        sampling = batch.get("sampling_per_token_logps")
        sampling = self._score(batch, "rollout") if sampling is None else self._as_slices(sampling)
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        checked = True
        if self.exact_logprobs:  # the recorded log-probs are the training forward's bits: no forward needed
            checked = self._exact_check_due()
            train = self._checked_exact(batch, sampling, mask) if checked else sampling
        else:
            train = batch.get("old_per_token_logps")  # TRL skips it when it equals the loss's own forward
            train = self._score(batch, "train") if train is None else self._as_slices(train)
        batch["sampling_per_token_logps"] = self._from_slices(sampling)
        batch["old_per_token_logps"] = self._from_slices(train)
        weights = []
        for k in range(sampling.shape[1]):
            correction = self.corrector(train[:, k], sampling[:, k], mask, batch["advantages"])
            if checked:  # unchecked exact batches compared nothing: no mismatch figures for them
                self._add_sums(mode, correction.sums)
            weights.append(correction.weights.to(sampling.dtype))
        if self.args.corrector_active:
            batch["importance_sampling_ratio"] = self._from_slices(torch.stack(weights, dim=1))

    def _exact_check_due(self) -> bool:
        """Whether this generation batch checks the exact contract (every ``exact_check_every``-th, the first included)."""
        every, count = self.args.exact_check_every, self._generation_batches
        self._generation_batches += 1
        return every > 0 and count % every == 0

    def _checked_exact(self, batch: dict[str, Any], sampling: Tensor, mask: Tensor) -> Tensor:
        """The training forward's log-probs of the batch (no grad), compared with the recorded ones: a
        warning names the largest difference if any token's bits differ. These are the old log-probs then."""
        train = self._score(batch, "train")
        mask = mask.bool()[:, None].expand_as(train)
        differ = (train != sampling) & mask
        if bool(differ.any()):
            largest = float((train - sampling).abs()[differ].max())
            logger.warning(
                "jetrl: exact_logprobs: %d of %d completion tokens' recorded log-probs differ from the training "
                "forward's (largest |dlogp| %.3g); the contract broke (a forward hook, another attention, another "
                "device?). docs/trainer.md#exact-on-policy-log-probs lists what breaks it.",
                int(differ.sum()), int(mask.sum()), largest,
            )  # fmt: skip
        return train

    def _score(self, batch: dict[str, Any], phase: str) -> Tensor:
        """The scorer's log-probs ``(B, K, T)`` of a generated batch in ``phase``, no grad."""
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if phase == "rollout":
                return self.policy_scorer.rollout_logps(self.model, batch, batch_size=batch_size)
            return self.policy_scorer.logps(self.model, batch, phase, batch_size=batch_size)

    def _as_slices(self, t: Tensor) -> Tensor:
        return t if self.policy_scorer.sliced else t[:, None]

    def _from_slices(self, t: Tensor) -> Tensor:
        return t if self.policy_scorer.sliced else t[:, 0]

    def _add_sums(self, mode: str, sums: dict[str, Tensor]) -> None:
        """Reduce over processes now (every rank is here together), accumulate until the next log."""
        sums = all_reduce_sums(sums)
        previous = self._jet_sums[mode]
        self._jet_sums[mode] = sums if previous is None else merge_sums(previous, sums)

    @contextlib.contextmanager
    def _scoring(self, slices: Tensor | None) -> Iterator[None]:
        """The slices that TRL's log-prob calls in the block score.

        TRL calls ``_get_per_token_logps_and_entropies`` with input ids only (the reference
        log-probs while scoring a generation, the current ones in the loss): these two callers say
        which slices (mask seeds) apply. ``None``: one unsliced log-prob per token (K = 1).
        """
        previous, self._active_slices = self._active_slices, slices
        try:
            yield
        finally:
            self._active_slices = previous

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):  # fmt: skip
        return self.policy_scorer.token_logps(
            model, input_ids, attention_mask, logits_to_keep, self._active_slices, batch_size=batch_size,
            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal,
        )  # fmt: skip

    def _inner_iteration(self) -> int:
        """Which of the ``num_iterations`` passes over the buffered generation batch this micro-step is."""
        if not self.model.training:
            return 0
        return (self._step // self.args.steps_per_generation) % self.num_iterations

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        mode = "train" if self.model.training else "eval"
        nonfinite = self._reward_checks.end_batch(rewards_per_func, self.reward_funcs, training=mode == "train")
        self._metrics[mode]["rewards/nonfinite"].append(nonfinite)
        return rewards_per_func

    # ------------------------------------------------------------------ loss

    def _compute_loss(self, model, inputs):
        inputs = self.policy_scorer.select(inputs, self._inner_iteration())
        with self._scoring(self.policy_scorer.slices_of(inputs)):
            if "importance_sampling_ratio" not in inputs:
                return super()._compute_loss(model, inputs)
            # TRL applies `per_token_loss *= inputs["importance_sampling_ratio"]` (after the clipped
            # surrogate, before the KL term) only under these two flags. Within `_compute_loss` they
            # guard nothing else (tests/trainer/test_trl_contract.py), so raising them for this call puts our
            # weights there for every loss_type without copying the method.
            with _attributes(self, use_vllm=True, vllm_importance_sampling_correction=True):
                return super()._compute_loss(model, inputs)

    # ------------------------------------------------------------------ non-finite guard

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._follow_optimizer()
        # Exact log-probs: the backward under ExactOps too, where gradient checkpointing recomputes the forward.
        with ExactOps.entered(self.exact_logprobs, self.exact_kv_roundtrip):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self._guard.observe_loss(loss)
        return loss

    def _follow_optimizer(self) -> None:
        """Register the weight-cache refresh on the optimizer that steps (again if it was replaced).

        Here rather than in ``create_optimizer``: by the first training step accelerate and DeepSpeed
        have wrapped the optimizer, or built their own from the DeepSpeed JSON."""
        if self.weight_cache_refresh is not None and self.weight_cache_refresh.follows(self.optimizer):
            return
        for refresh in (self.weight_cache_refresh, self._ref_cache_refresh):
            if refresh is not None:
                refresh.remove()
        self.weight_cache_refresh = WeightCacheRefresh(self.model, self.optimizer)
        synced_ref = self.ref_model is not None and self.args.sync_ref_model
        # TRL's SyncRefModelCallback writes the reference through .data after the step: no _version bump.
        self._ref_cache_refresh = WeightCacheRefresh(self.ref_model, self.optimizer) if synced_ref else None

    def create_optimizer(self, *args: Any, **kwargs: Any):
        optimizer = super().create_optimizer(*args, **kwargs)
        return self._guard.install(optimizer)

    # ------------------------------------------------------------------ logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        sums = self._jet_sums.get(mode)
        if sums is not None:
            prefix = "eval_" if mode == "eval" else ""
            logs.update({f"{prefix}{k}": v for k, v in metrics_from_sums(sums).items()})
            self._jet_sums[mode] = None
        if mode == "train":
            logs[SKIPPED_STEPS_KEY] = float(self._guard.skipped_steps)
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints (jetrl_trainer/checkpoint.py)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir)  # a complete one
        if resume_from_checkpoint is not None:
            self._guard.skipped_steps = int(checkpoint_state(resume_from_checkpoint).get(SKIPPED_STEPS_KEY, 0))
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def _get_output_dir(self, trial) -> str:
        # Where Trainer._save_checkpoint (and TRL's) put checkpoint-N: the staging folder while we save.
        return self._staging_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """TRL's checkpoint, written into a staging folder, then fsynced and renamed into place whole."""
        run_dir = self._get_output_dir(trial)
        stage = StagedCheckpoint(run_dir, self.state.global_step, main=self.args.should_save)
        stage.prepare()
        self.accelerator.wait_for_everyone()
        with _attributes(self, _staging_root=stage.root, _pending_push=None):
            super()._save_checkpoint(model, trial)  # its rotation sees only the staging folder: a no-op
            push = self._pending_push
        self.accelerator.wait_for_everyone()  # every process has written its files
        stage.commit(self.state, {SKIPPED_STEPS_KEY: self._guard.skipped_steps})
        if self.args.should_save:
            keep = (stage.final, self.state.best_model_checkpoint)
            rotate_checkpoints(run_dir, self.args.save_total_limit, keep=keep)
        self.accelerator.wait_for_everyone()
        if push is not None:
            super()._push_from_checkpoint(stage.final)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._staging_root is not None:  # called inside _save_checkpoint: upload once the folder is in place
            self._pending_push = checkpoint_folder
            return
        super()._push_from_checkpoint(checkpoint_folder)

    # ------------------------------------------------------------------ saving

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=state_dict)  # QuantLinear shares Parameters: master weights only
        if self.args.should_save:
            update_model_card(os.path.join(output_dir or self.args.output_dir, "README.md"), self.args)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None):
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            update_model_card(os.path.join(self.args.output_dir, "README.md"), self.args)


@contextlib.contextmanager
def _attributes(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes for the duration of the block, then restore them."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _check_vllm_model(model: Any, args: JetGRPOConfig) -> None:
    """vLLM colocate loads the model from ``model.name_or_path`` (TRL's LLM(...)): refuse an in-memory one."""
    if not args.use_vllm or args.vllm_mode != "colocate" or isinstance(model, str):
        return
    if not getattr(model, "name_or_path", ""):
        raise ValueError(
            "vllm_mode='colocate' starts vLLM from model.name_or_path, and this model has none (built in memory). "
            "Save it first (model.save_pretrained(path); tokenizer.save_pretrained(path)) and pass the path or the "
            "reloaded model."
        )


def _check_diffusion_kwargs(kwargs: dict[str, Any]) -> None:
    """What a diffusion LM cannot do with GRPO here, refused at construction."""
    if kwargs.get("tools") or kwargs.get("environment_factory") is not None:
        raise ValueError(
            "tool calling and environments are not supported for diffusion LMs (multi-turn rollouts assume "
            "left-to-right generation); remove tools= / environment_factory=."
        )
    if kwargs.get("peft_config") is not None:
        check_lora_targets(kwargs["peft_config"])
