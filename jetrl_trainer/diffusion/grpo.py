"""GRPO for masked-diffusion LMs (LLaDA) inside `JetGRPOTrainer` (DESIGN §6).

``JetGRPOTrainer(model, ...)`` with a LLaDA model (an object, a peft model around one, or a
checkpoint id whose config says ``model_type="llada"``) builds a :class:`DiffusionGRPOMixin`
subclass of itself. The mixin replaces the two things that assume an autoregressive model:

```
prompts ─► diffusion sampler (precision_phase("rollout"))   ─► completions, cut after the first EOS  [_rollout]
        ─► rewards ─► group advantages                                                            (TRL)
        ─► per inner iteration i (mask seed s_i), no grad:
             old log-probs      = estimator(s_i) in precision_phase("train")
             rollout log-probs  = estimator(s_i) in precision_phase("rollout")
             reference log-probs= estimator(s_i) on the reference (adapter-disabled under LoRA)
        ─► corrector(old_i, rollout_i, mask, advantages) ─► weights_i + mismatch sums
        ─► loss at iteration i: current log-probs = estimator(s_i) with grad; TRL's surrogate × weights_i
```

Everything else — rewards, advantages, every ``loss_type``, KL, correctors, mismatch metrics,
the non-finite guard, logging and saving — is JetGRPOTrainer's and TRL's, unchanged.

How this departs from d1 / diffu-GRPO:

* The "rollout" log-probs of a diffusion LM are not the sampler's own probabilities (its tokens come
  from many denoising steps): they are the same likelihood estimate as the old and current ones,
  evaluated under the rollout precision on the *same* masked input. Their gap to the old log-probs
  is therefore exactly the precision mismatch, 0 in the unified flow.
* Per-iteration tensors are stored batch-first, ``(B, num_iterations, T)``, and mask seeds as
  ``(B, num_iterations)``, because TRL shuffles and splits every batch tensor along dim 0; d1
  stores ``(num_iterations, B, T)`` and ``(num_iterations,)``.
* The mask is a hash of the seed and the row (see `likelihood`), so a row keeps its mask whatever
  micro-batch it lands in after TRL's shuffle.
* Completions are cut after the first EOS, as TRL does for AR models, but the estimator still sees
  the sampler's full ``max_completion_length`` canvas of ``[MASK]`` tokens, so a row's log-probs do
  not depend on how long the other completions of its batch are.
* ``entropy`` (TRL's metric, entropy mask and bonus) is the entropy of the estimator's predictive
  distribution at each completion position.

Overridden (on top of JetGRPOTrainer): ``__init__``, ``_rollout``, ``_generate_and_score_completions``
(TRL's, then a per-iteration corrector step in place of JetGRPOTrainer's single one),
``_compute_loss`` (selects the inner iteration) and ``_get_per_token_logps_and_entropies``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, GenerationConfig
from trl import GRPOTrainer
from trl.models.utils import unwrap_model_for_generation

from jetrl_trainer.rollout import left_pad, truncate_after_eos

from .configuration_llada import LLaDAConfig
from .likelihood import get_estimator, mask_seeds_for_step
from .lora import LLADA_LM_HEAD, LORA_PRESETS, lora_target_modules
from .sampler import REMASKING, generate

__all__ = [
    "PER_ITERATION_KEYS",
    "DiffusionGRPOMixin",
    "DiffusionSampling",
    "check_lora_targets",
    "diffusion_logps",
    "diffusion_trainer_class",
    "ensure_generation_config",
    "is_diffusion_source",
    "select_iteration",
]

# Batch keys holding one slice per inner iteration along dim 1 (dim 0 is the row, for TRL's shuffle).
PER_ITERATION_KEYS = (
    "old_per_token_logps",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "importance_sampling_ratio",
    "mask_seeds",
)
_DEFAULT_BLOCK = 32  # LLaDA's and d1's block length
_PROGRESS_MIN_STEPS = 32  # denoising steps from which a rollout shows its own progress bar


# ---------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class DiffusionSampling:
    """Sampler settings of one run, resolved from a `JetGRPOConfig` (see :meth:`from_args`)."""

    steps: int
    gen_length: int
    block_length: int
    temperature: float
    remasking: str = "low_confidence"

    @classmethod
    def from_args(cls, args: Any) -> DiffusionSampling:
        """``gen_length = max_completion_length``; ``None`` block length / steps get LLaDA's defaults."""
        gen_length = args.max_completion_length
        if not isinstance(gen_length, int) or gen_length < 1:
            raise ValueError(f"max_completion_length must be a positive int for a diffusion LM; got {gen_length!r}.")
        block = args.diffusion_block_length
        if block is None:
            block = _DEFAULT_BLOCK if gen_length % _DEFAULT_BLOCK == 0 else gen_length
        if gen_length % block:
            raise ValueError(f"diffusion_block_length={block} must divide max_completion_length={gen_length}.")
        blocks = gen_length // block
        steps = args.diffusion_steps
        if steps is None:  # two tokens per step (d1), rounded to whole steps per block
            steps = max(1, gen_length // 2 // blocks) * blocks
        if steps % blocks:
            raise ValueError(f"diffusion_steps={steps} must be a multiple of the number of blocks ({blocks}).")
        if args.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 for GRPO on a diffusion LM (the log-probs divide the logits by it); got "
                f"{args.temperature}. Use e.g. 0.1 for near-greedy sampling."
            )
        if args.diffusion_remasking not in REMASKING:
            raise ValueError(f"diffusion_remasking must be one of {REMASKING}; got {args.diffusion_remasking!r}.")
        return cls(steps, gen_length, block, float(args.temperature), args.diffusion_remasking)


# ---------------------------------------------------------------------------------- model set-up


def is_diffusion_source(model: Any, args: Any = None) -> bool:
    """True when ``model`` (an object, a peft model, or a checkpoint id/path) is a LLaDA model."""
    if isinstance(model, str):
        try:
            remote = bool(getattr(args, "trust_remote_code", False))
            config = AutoConfig.from_pretrained(model, trust_remote_code=remote)
        except (OSError, ValueError):  # not resolvable here: let TRL load it and report
            return False
        return getattr(config, "model_type", None) == LLaDAConfig.model_type
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == LLaDAConfig.model_type


def ensure_generation_config(model: nn.Module) -> nn.Module:
    """Give the model the ``generation_config`` TRL reads at init (pad / eos ids).

    transformers sets one only on models that ``can_generate()``; LLaDA does not (it has no
    autoregressive ``generate``), so without this TRL's ``GRPOTrainer.__init__`` fails.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "generation_config", None) is None:
        base.generation_config = GenerationConfig(
            eos_token_id=base.config.eos_token_id, pad_token_id=base.config.pad_token_id
        )
    return model


def _load(model_id: str, args: Any) -> nn.Module:
    """Load a LLaDA checkpoint the way TRL loads a model id (``model_init_kwargs``, no device_map when
    distributed), so that the generation config can be attached before TRL's init reads it."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import create_model_from_path

    kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    if args is not None and args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None
    kwargs.setdefault("trust_remote_code", bool(getattr(args, "trust_remote_code", False)))
    # The architecture is given: TRL would look for `config.auto_map`, absent from checkpoints we save.
    return create_model_from_path(model_id, architecture=AutoModelForCausalLM, **kwargs)


def check_lora_targets(peft_config: Any) -> Any:
    """Refuse a LoRA config that would adapt the LM head; a preset name becomes its regex.

    ``target_modules="all_linear"`` (or ``"attention"``, ``"mlp"``, ``"d1"``) selects a preset of
    :mod:`jetrl_trainer.diffusion.lora`. A plain list such as ``["ff_out"]`` would also catch the
    LM head ``model.transformer.ff_out`` (it shares the MLP's suffix) and is refused.
    """
    if peft_config is None or not hasattr(peft_config, "target_modules"):
        return peft_config
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = peft_config.target_modules
    if isinstance(targets, str) and targets in LORA_PRESETS:
        import copy

        peft_config = copy.copy(peft_config)
        peft_config.target_modules = lora_target_modules(targets)
    elif targets is not None and check_target_module_exists(peft_config, LLADA_LM_HEAD):
        raise ValueError(
            f"LoRA target_modules={targets!r} would put an adapter on LLaDA's LM head {LLADA_LM_HEAD!r} (the "
            "MLP down projections and the head share the name 'ff_out'). Use a preset: target_modules="
            f"'all_linear' (or one of {sorted(LORA_PRESETS)}), or jetrl_trainer.diffusion.lora_target_modules()."
        )
    return peft_config


# ---------------------------------------------------------------------------------- log-probs


def diffusion_logps(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_length: int,
    mask_seeds: Tensor,
    *,
    estimator: Any,
    gen_length: int,
    mask_token_id: int,
    temperature: float,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    entropy_grad: bool = False,
    **estimator_options: Any,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs ``(B, K, T)`` of the completions, one slice per mask seed column.

    ``input_ids``/``attention_mask`` are TRL's ``[prompt | completion]`` ``(B, P + T)`` with
    ``T = completion_length``; ``mask_seeds`` is ``(B, K)`` int64. The completion is padded to the
    sampler's ``gen_length`` canvas (padding is outside ``completion_mask``, so it changes neither
    the mask nor the scored positions). Rows are processed ``batch_size`` at a time.
    Entropies ``(B, K, T)`` are those of the estimator's predictive distribution (``None`` unless
    ``compute_entropy``); they carry gradients only with ``entropy_grad``.
    """
    T = completion_length
    prompt_ids, prompt_mask = input_ids[:, :-T], attention_mask[:, :-T]
    completion_ids, completion_mask = input_ids[:, -T:], attention_mask[:, -T:]
    if gen_length > T:  # the sampler's canvas: the estimator attends to gen_length [MASK] positions
        completion_ids = nn.functional.pad(completion_ids, (0, gen_length - T), value=mask_token_id)
        completion_mask = nn.functional.pad(completion_mask, (0, gen_length - T), value=0)
    B, K = mask_seeds.shape
    step = batch_size or B
    logps, entropies = [], []
    for k in range(K):
        for start in range(0, B, step):
            rows = slice(start, start + step)
            with _captured_logits(model, compute_entropy) as captured:
                lp = estimator(
                    model, prompt_ids[rows], prompt_mask[rows], completion_ids[rows], completion_mask[rows],
                    mask_seed=mask_seeds[rows, k], mask_token_id=mask_token_id, temperature=temperature,
                    **estimator_options,
                )  # fmt: skip
            logps.append(lp[:, :T])
            if compute_entropy:
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    entropies.append(_mean_entropy(captured, T, temperature))
    logps_t = torch.cat(logps).view(K, B, T).transpose(0, 1)  # chunks were k-major
    entropies_t = torch.cat(entropies).view(K, B, T).transpose(0, 1) if compute_entropy else None
    return logps_t, entropies_t


@contextlib.contextmanager
def _captured_logits(model: nn.Module, enabled: bool) -> Iterator[list[Tensor]]:
    """Collect the logits of every forward of ``model`` in the block (for the entropy)."""
    captured: list[Tensor] = []
    if not enabled:
        yield captured
        return

    def hook(module, args, output):
        captured.append(output.logits if hasattr(output, "logits") else output[0])

    handle = model.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def _mean_entropy(captured: Sequence[Tensor], T: int, temperature: float) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at the first T positions, averaged over forwards.

    Row by row, so a float32 copy of the (B, T, V) logits is never materialised.
    """
    if not captured:
        raise RuntimeError("the likelihood estimator ran no forward pass of the model; cannot compute entropies.")
    per_call = []
    for logits in captured:
        rows = []
        for row in logits[:, :T]:
            logp = torch.log_softmax(row.float() / temperature, dim=-1)
            rows.append(-(logp.exp() * logp).sum(-1))
        per_call.append(torch.stack(rows))
    return torch.stack(per_call).mean(0)


def select_iteration(inputs: dict[str, Any], iteration: int) -> dict[str, Any]:
    """A shallow copy of a buffered batch with every per-iteration key reduced to ``iteration``'s slice."""
    out = dict(inputs)
    for key in PER_ITERATION_KEYS:
        value = out.get(key)
        if isinstance(value, Tensor) and value.dim() >= 2:
            out[key] = value[:, iteration]
    return out


# ---------------------------------------------------------------------------------- trainer mixin


class DiffusionGRPOMixin:
    """JetGRPOTrainer for masked-diffusion LMs: diffusion rollouts, estimated per-token log-probs.

    Mixed in front of `JetGRPOTrainer` (or a subclass) by :func:`diffusion_trainer_class`, which
    ``JetGRPOTrainer.__new__`` calls when it is given a LLaDA model. Overrides ``__init__``,
    ``_rollout``, ``_generate_and_score_completions``, ``_compute_loss`` and
    ``_get_per_token_logps_and_entropies``; everything else is inherited. See the module docstring.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, **kwargs: Any):
        if isinstance(model, str):
            model = _load(model, args)
        ensure_generation_config(model)
        if "peft_config" in kwargs:
            kwargs["peft_config"] = check_lora_targets(kwargs["peft_config"])
        if kwargs.get("tools") or kwargs.get("environment_factory") is not None:
            raise ValueError("tool calling and environments are not supported for diffusion LMs (multi-turn "
                             "rollouts assume left-to-right generation); remove tools= / environment_factory=.")
        if getattr(args, "use_transformers_continuous_batching", False):
            raise ValueError("use_transformers_continuous_batching applies to autoregressive models only; LLaDA "
                             "samples with jetrl_trainer.diffusion.generate. Set it to False.")
        super().__init__(model, reward_funcs, args=args, **kwargs)
        self.diffusion_sampling = DiffusionSampling.from_args(self.args)
        self._estimator = get_estimator(self.args.likelihood_estimator)
        self._estimator_options = _accepted(self._estimator, p_mask_prompt=self.args.p_mask_prompt)
        config = self.accelerator.unwrap_model(self.model).config
        if getattr(config, "mask_token_id", None) is None:
            raise ValueError("the diffusion model's config has no mask_token_id; set config.mask_token_id.")
        self._mask_token_id = int(config.mask_token_id)
        self._generations = {"train": 0, "eval": 0}
        self._seed_scope: tuple[Tensor | list[int], bool] | None = None

    # ------------------------------------------------------------------ rollout

    def _rollout(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], None]:
        """Diffusion sampling (already inside ``precision_phase("rollout")``); completions cut after EOS.

        Returns no log-probs: the rollout-precision log-probs are estimated per inner iteration in
        :meth:`_generate_and_score_completions`, on the same masked inputs as the old ones.
        """
        s = self.diffusion_sampling
        ids, mask = left_pad(prompt_ids, self._tokenizer.pad_token_id, self.pad_to_multiple_of)
        device = self.accelerator.device
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            sequences = generate(
                unwrapped_model, ids.to(device), mask.to(device),
                steps=s.steps, gen_length=s.gen_length, block_length=s.block_length, temperature=s.temperature,
                remasking=s.remasking, mask_token_id=self._mask_token_id,
                progress=self._show_progress(),
            )  # fmt: skip
        completions = sequences[:, ids.shape[1] :]
        completion_ids, _ = truncate_after_eos(completions, torch.zeros_like(completions, dtype=torch.float32),
                                               self.eos_token_ids)  # fmt: skip
        return completion_ids, None

    def _show_progress(self) -> bool:
        # A bar for long generations only: a few-step tiny run would print one per micro-step.
        s = self.diffusion_sampling
        return s.steps >= _PROGRESS_MIN_STEPS and not self.args.disable_tqdm and self.accelerator.is_local_main_process

    # ------------------------------------------------------------------ scoring

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if self.model.training else "eval"
        seeds = self._next_mask_seeds(mode)
        # Inside the scope every log-prob TRL asks for (old, reference) comes back as (B, I, T).
        with self._mask_seeds(seeds, squeeze=False):
            batch = GRPOTrainer._generate_and_score_completions(self, inputs)
            rows = batch["completion_ids"].shape[0]
            batch["mask_seeds"] = torch.tensor(seeds, dtype=torch.int64, device=self.accelerator.device).expand(
                rows, len(seeds)
            ).clone()
            if self._needs_train_logps:
                self._correct_per_iteration(batch, mode)
        return batch

    def _correct_per_iteration(self, batch: dict[str, Any], mode: str) -> None:
        """Rollout- and train-precision log-probs per mask seed; corrector weights and mismatch sums."""
        sampling = batch["sampling_per_token_logps"] = self._phase_logps(batch, "rollout")
        train = batch.get("old_per_token_logps")
        if train is None:
            train = batch["old_per_token_logps"] = self._phase_logps(batch, "train")
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        weights = []
        for i in range(sampling.shape[1]):
            correction = self.corrector(train[:, i], sampling[:, i], mask, batch["advantages"])
            self._add_sums(mode, correction.sums)
            weights.append(correction.weights.to(sampling.dtype))
        if self.args.corrector_active:
            batch["importance_sampling_ratio"] = torch.stack(weights, dim=1)

    # ------------------------------------------------------------------ loss

    def _compute_loss(self, model, inputs):
        inputs = select_iteration(inputs, self._inner_iteration())
        with self._mask_seeds(inputs["mask_seeds"][:, None], squeeze=True):
            return super()._compute_loss(model, inputs)

    def _inner_iteration(self) -> int:
        """Which of the ``num_iterations`` passes over the buffered generation batch this micro-step is."""
        if not self.model.training:
            return 0
        return (self._step // self.args.steps_per_generation) % self.num_iterations

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ):  # fmt: skip
        if self._seed_scope is None:
            raise RuntimeError(
                "diffusion log-probs need a mask seed: they are computed in _generate_and_score_completions "
                "(one per inner iteration) and _compute_loss only."
            )
        seeds, squeeze = self._seed_scope
        if not isinstance(seeds, Tensor):  # one seed per iteration, shared by every row of the batch
            seeds = torch.tensor(seeds, dtype=torch.int64, device=input_ids.device).expand(input_ids.shape[0], -1)
        with self.accelerator.autocast():  # as TRL's own log-prob forward
            logps, entropies = diffusion_logps(
                model, input_ids, attention_mask, logits_to_keep, seeds,
                estimator=self._estimator, gen_length=self.diffusion_sampling.gen_length,
                mask_token_id=self._mask_token_id, temperature=self.temperature, batch_size=batch_size,
                compute_entropy=compute_entropy, entropy_grad=self._entropy_bonus_enabled, **self._estimator_options,
            )  # fmt: skip
        if squeeze:
            logps = logps[:, 0]
            entropies = None if entropies is None else entropies[:, 0]
        return logps, entropies, None

    # ------------------------------------------------------------------ mask seeds

    def _next_mask_seeds(self, mode: str) -> list[int]:
        """One seed per inner iteration of this generation batch (eval: one, from a disjoint stream)."""
        count = self._generations[mode]
        self._generations[mode] += 1
        if mode == "train":
            return mask_seeds_for_step(self.args.seed, count, self.num_iterations)
        return mask_seeds_for_step(self.args.seed, -1 - count, 1)

    @contextlib.contextmanager
    def _mask_seeds(self, seeds: Tensor | list[int], *, squeeze: bool) -> Iterator[None]:
        previous, self._seed_scope = self._seed_scope, (seeds, squeeze)
        try:
            yield
        finally:
            self._seed_scope = previous


def _accepted(fn: Any, **options: Any) -> dict[str, Any]:
    """The options ``fn`` takes by keyword (all of them when it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return options
    return {k: v for k, v in options.items() if k in params}


@functools.cache
def diffusion_trainer_class(trainer_cls: type) -> type:
    """``trainer_cls`` with :class:`DiffusionGRPOMixin` in front (cached; identity if already mixed)."""
    if issubclass(trainer_cls, DiffusionGRPOMixin):
        return trainer_cls
    name = f"Diffusion{trainer_cls.__name__}"
    cls = type(name, (DiffusionGRPOMixin, trainer_cls), {"__module__": __name__, "__doc__": DiffusionGRPOMixin.__doc__})
    globals().setdefault(name, cls)  # so that the class pickles by reference, like a class written out here
    return cls
