"""`JetGRPOTrainer`: TRL's GRPO with low-precision rollouts and training (DESIGN §4).

One GRPO step, and where this class steps in:

```
prompts ─► rollout (precision_phase("rollout"))      ─► completion ids + sampling log-probs   [_rollout]
        ─► rewards ─► group advantages                                                        (TRL)
        ─► old log-probs, no grad, precision_phase("train")                                   [_train_logps]
        ─► corrector(old, sampling, mask, advantages) ─► weights [B, T] + mismatch sums
        ─► TRL's per-token surrogate × weights ─► backward ─► guarded optimizer step
```

How this departs from TRL 1.16's `GRPOTrainer`:

* the policy's ``nn.Linear`` layers become `QuantLinear` at init (`quantize_model`); the reference
  model, when there is one, is quantized with the *training* recipe in both phases;
* HF ``generate`` and continuous batching return the sampling log-probs (TRL returns them only
  from vLLM, which is refused here since it would not run our quantized modules);
* the corrector weights go into TRL's own importance-sampling slot: ``_compute_loss`` multiplies
  the per-token surrogate by ``inputs["importance_sampling_ratio"]`` after clipping and before the
  KL term, for every ``loss_type`` (VESPO folds it into its gamma weights, as TRL does);
* ``mismatch/*`` and ``corrector/*`` are logged every generation, exact across processes
  (additive sums all-reduced, then turned into metrics);
* an optimizer step with a non-finite loss or gradient is skipped (``jetrl/skipped_steps``);
* saved checkpoints hold the master weights under their usual names; the card says how.

Overridden TRL/Trainer methods: ``__init__``, ``_generate_single_turn``,
``_generate_and_score_completions``, ``_compute_loss``, ``training_step``, ``create_optimizer``,
``log``, ``_save``, ``create_model_card``. Everything else is inherited.

Hooks for subclasses (e.g. a diffusion LM): ``_rollout(prompt_ids)`` produces completions and their
sampling log-probs; ``_train_logps(batch)`` the training-precision log-probs of a generated batch
(by default through TRL's ``_get_per_token_logps_and_entropies``, itself overridable).
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

from jetrl_trainer._dist import all_reduce_sums, any_across_processes
from jetrl_trainer._guard import NonFiniteGuard
from jetrl_trainer.config import JetGRPOConfig
from jetrl_trainer.correctors import get_corrector, merge_sums, metrics_from_sums
from jetrl_trainer.hub import master_state_dict, update_model_card
from jetrl_trainer.quant import precision_phase, quantize_model
from jetrl_trainer.rollout import generate_batch_with_logprobs, generate_with_logprobs

__all__ = ["JetGRPOTrainer"]

SKIPPED_STEPS_KEY = "jetrl/skipped_steps"


class JetGRPOTrainer(GRPOTrainer):
    """GRPO in FP8/NVFP4: unified precision flow or corrected BF16/FP8 baseline, on `trl.GRPOTrainer`.

    Use it exactly like ``trl.GRPOTrainer``, with a [`JetGRPOConfig`] (``train_precision``,
    ``rollout_precision``, ``corrector`` and friends). ``model`` may be a model id (loaded with
    ``args.model_init_kwargs``), a model object, or a peft model (only the frozen base layers are
    quantized; adapters stay in their dtype); the model is converted in place.

    Overrides ``__new__`` (diffusion routing, below), ``__init__``, ``_generate_single_turn``, ``_generate_and_score_completions``,
    ``_compute_loss``, ``training_step``, ``create_optimizer``, ``log``, ``_save`` and
    ``create_model_card``; everything else is inherited. Subclass hooks: ``_rollout`` and
    ``_train_logps``.

    Not supported: vLLM (refused by the config), multimodal prompts.

    A LLaDA (masked-diffusion) model, or a checkpoint id of one, makes ``__new__`` return a subclass
    with `DiffusionGRPOMixin` in front (diffusion rollouts and estimated log-probs; see
    ``jetrl_trainer/diffusion/grpo.py`` and docs/llada.md).
    """

    _tag_names = ["trl", "grpo", "jetrl"]
    _name = "JetRL GRPO"

    def __new__(cls, model: Any = None, reward_funcs: Any = None, args: Any = None, **kwargs: Any):
        # A masked-diffusion LM (LLaDA) gets DiffusionGRPOMixin in front: diffusion rollouts and
        # estimated log-probs; everything else stays this class's (jetrl_trainer/diffusion/grpo.py).
        from jetrl_trainer.diffusion.grpo import (
            diffusion_trainer_class,
            is_diffusion_source,
        )

        if is_diffusion_source(model, args):
            cls = diffusion_trainer_class(cls)
        return super().__new__(cls)

    def __init__(self, model: Any, reward_funcs: Any = None, args: JetGRPOConfig | None = None, **kwargs: Any):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = JetGRPOConfig(f"{name.split('/')[-1]}-JetGRPO")
        elif not isinstance(args, JetGRPOConfig):
            raise ValueError(
                f"JetGRPOTrainer needs a JetGRPOConfig (it accepts every GRPOConfig field); got {type(args).__name__}."
            )
        super().__init__(model, reward_funcs, args=args, **kwargs)
        if self._is_vlm:
            raise ValueError("JetGRPOTrainer supports text-only models; multimodal processors are not supported.")
        params = args.corrector_params() if isinstance(args.corrector, str) else {}
        self.corrector = get_corrector(args.corrector, **params)
        self._quantize_models()
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
        return a.corrector_active or a.train_precision != a.rollout_precision or a.log_mismatch

    # ------------------------------------------------------------------ rollout

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images or multimodal_fields or has_tool_images:
            raise ValueError("JetGRPOTrainer supports text-only rollouts; got images or multimodal fields.")
        with precision_phase("rollout"):
            return self._rollout(prompt_ids)

    def _rollout(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """Hook: one completion per prompt, and the log-prob of every completion token under the
        distribution it was sampled from. Called inside ``precision_phase("rollout")``."""
        cb = self.use_transformers_continuous_batching
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=None if cb else self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            if cb:  # unlike TRL's CB branch, the model is not cast to the autocast dtype: recipes decide
                return generate_batch_with_logprobs(
                    unwrapped_model, prompt_ids, self.generation_config, self.continuous_batching_config
                )
            return generate_with_logprobs(
                unwrapped_model,
                prompt_ids,
                self.generation_config,
                pad_token_id=self._tokenizer.pad_token_id,
                eos_token_ids=self.eos_token_ids,
                pad_to_multiple_of=self.pad_to_multiple_of,
                device=self.accelerator.device,
            )

    # ------------------------------------------------------------------ old log-probs + corrector

    def _train_logps(self, batch: dict[str, Any]) -> Tensor:
        """Hook: log-probs ``[B, T]`` of the completion tokens under the training precision, no grad."""
        return self._phase_logps(batch, "train")

    def _phase_logps(self, batch: dict[str, Any], phase: str) -> Tensor:
        """Log-probs of a generated batch's completion tokens in ``phase``'s precision, no grad."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            precision_phase(phase),
        ):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, batch["completion_ids"].size(1), batch_size=batch_size
            )
        return logps

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        if not self._needs_train_logps:
            return batch
        sampling = batch.get("sampling_per_token_logps")
        if sampling is None:  # only a user rollout_func can get here
            if self.args.corrector_active:
                raise ValueError("corrector needs sampling log-probs, but the rollout_func returned logprobs=None.")
            return batch
        train = batch.get("old_per_token_logps")
        if train is None:  # TRL skips it when it equals the loss's own forward; we need it now
            train = batch["old_per_token_logps"] = self._train_logps(batch)
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        correction = self.corrector(train, sampling, mask, batch["advantages"])
        self._add_sums("train" if self.model.training else "eval", correction.sums)
        if self.args.corrector_active:
            batch["importance_sampling_ratio"] = correction.weights.to(sampling.dtype)
        return batch

    def _add_sums(self, mode: str, sums: dict[str, Tensor]) -> None:
        """Reduce over processes now (every rank is here together), accumulate until the next log."""
        sums = all_reduce_sums(sums)
        previous = self._jet_sums[mode]
        self._jet_sums[mode] = sums if previous is None else merge_sums(previous, sums)

    # ------------------------------------------------------------------ loss

    def _compute_loss(self, model, inputs):
        if "importance_sampling_ratio" not in inputs:
            return super()._compute_loss(model, inputs)
        # TRL applies `per_token_loss *= inputs["importance_sampling_ratio"]` (after the clipped
        # surrogate, before the KL term) only under these two flags. Within `_compute_loss` they guard
        # nothing else, so raising them for this call puts our weights there for every loss_type.
        with _attributes(self, use_vllm=True, vllm_importance_sampling_correction=True):
            return super()._compute_loss(model, inputs)

    # ------------------------------------------------------------------ non-finite guard

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._guard.observe_loss(loss)
        return loss

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

    # ------------------------------------------------------------------ saving

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=master_state_dict(self.model, state_dict))
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
