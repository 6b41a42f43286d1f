"""The diffusion policy scorer: per-iteration mask seeds and estimated per-token log-probs (docs/architecture.md#llada).

One slice per GRPO inner iteration: the old, rollout (rollout-precision) and reference log-probs of
iteration i, and the current ones of the loss at iteration i, all score the completions with mask
seed s_i. A generation batch carries its seeds as ``mask_seeds`` ``(B, num_iterations)``.

```
prompts ─► diffusion sampler (rollout precision)     ─► completions, cut after the first EOS
        ─► per inner iteration i (mask seed s_i), no grad:
             old log-probs      = estimator(s_i), model in the train phase
             rollout log-probs  = estimator(s_i), model in the rollout phase
             reference log-probs= estimator(s_i) on the reference (adapter-disabled under LoRA)
        ─► corrector(old_i, rollout_i, mask, advantages) ─► weights_i + mismatch sums
        ─► loss at iteration i: current log-probs = estimator(s_i) with grad; TRL's surrogate × weights_i
```

How this departs from d1 / diffu-GRPO:

* Per-iteration tensors are stored batch-first, ``(B, num_iterations, T)``, and mask seeds as
  ``(B, num_iterations)``, because TRL shuffles and splits every batch tensor along dim 0; d1
  stores ``(num_iterations, B, T)`` and ``(num_iterations,)``.
* The mask is a hash of the seed and the row (see `likelihood`), so a row keeps its mask whatever
  micro-batch it lands in after TRL's shuffle.
* The estimator sees the sampler's full ``max_completion_length`` canvas of ``[MASK]`` tokens even
  though completions are cut after the first EOS, so a row's log-probs do not depend on how long
  the other completions of its batch are.
* ``entropy`` (TRL's metric, entropy mask and bonus) is the entropy of the estimator's predictive
  distribution at each completion position; for the ELBO, averaged over its forwards with the
  weights its log-probs get (``estimator.forward_weights``), i.e. only where the token was masked.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from jetrl_trainer.scoring import PolicyScorer

from .likelihood import get_estimator, mask_seeds_for_step

__all__ = ["PER_ITERATION_KEYS", "DiffusionScorer", "diffusion_logps", "select_iteration"]

# Batch keys holding one slice per inner iteration along dim 1 (dim 0 is the row, for TRL's shuffle).
PER_ITERATION_KEYS = (
    "old_per_token_logps",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "importance_sampling_ratio",
    "mask_seeds",
)


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
    forward_weights = getattr(estimator, "forward_weights", None)  # per-forward entropy weights (elbo)
    logps, entropies = [], []
    for k in range(K):
        for start in range(0, B, step):
            rows = slice(start, start + step)
            args = (prompt_ids[rows], prompt_mask[rows], completion_ids[rows], completion_mask[rows])
            with _captured_logits(model, compute_entropy) as captured:
                lp = estimator(
                    model, *args, mask_seed=mask_seeds[rows, k], mask_token_id=mask_token_id,
                    temperature=temperature, **estimator_options,
                )  # fmt: skip
            logps.append(lp[:, :T])
            if compute_entropy:
                weights = None
                if forward_weights is not None:
                    weights = forward_weights(*args, mask_seed=mask_seeds[rows, k], **estimator_options)[..., :T]
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    entropies.append(_mean_entropy(captured, T, temperature, weights))
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


def _mean_entropy(captured: Sequence[Tensor], T: int, temperature: float, weights: Tensor | None = None) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at the first T positions, averaged over forwards.

    ``weights`` ``(n_forwards, B, T)``, when the estimator gives them, weigh each forward as its
    log-probs are weighed (the ELBO: ``L/l`` where masked, 0 where the token was visible), so the
    entropy is read where the estimator reads its log-probs. Row by row, so a float32 copy of the
    (B, T, V) logits is never materialised.
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
    stacked = torch.stack(per_call)  # (n_forwards, B, T)
    if weights is None:
        return stacked.mean(0)
    if weights.shape != stacked.shape:
        raise RuntimeError(f"estimator forward weights {tuple(weights.shape)} do not match its {tuple(stacked.shape)} "
                           "forwards; forward_weights must describe the forwards the estimator runs.")
    return (stacked * weights.to(stacked.dtype)).mean(0)


def select_iteration(inputs: dict[str, Any], iteration: int) -> dict[str, Any]:
    """A shallow copy of a buffered batch with every per-iteration key reduced to ``iteration``'s slice."""
    out = dict(inputs)
    for key in PER_ITERATION_KEYS:
        value = out.get(key)
        if isinstance(value, Tensor) and value.dim() >= 2:
            out[key] = value[:, iteration]
    return out


class DiffusionScorer(PolicyScorer):
    """K = ``num_iterations`` slices, one mask seed each; log-probs from a likelihood estimator."""

    slice_keys = PER_ITERATION_KEYS

    def __init__(
        self,
        *,
        estimator: str | Callable,
        p_mask_prompt: float,
        n_mc: int | None = None,
        antithetic: bool = False,
        gen_length: int,
        mask_token_id: int,
        temperature: float,
        seed: int,
        num_iterations: int,
        entropy_grad: bool = False,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.estimator = get_estimator(estimator)
        options: dict[str, Any] = dict(p_mask_prompt=p_mask_prompt)
        if n_mc is not None:  # None: the estimator's own default
            options["n_mc"] = n_mc
        if antithetic:
            options["antithetic"] = True
        self.estimator_options = _accepted(self.estimator, **options)
        ignored = sorted(set(options) - set(self.estimator_options) - {"p_mask_prompt"})
        if ignored:
            raise ValueError(
                f"the likelihood estimator {estimator!r} takes no {', '.join(ignored)} (likelihood_mc_samples / "
                "likelihood_antithetic are options of likelihood_estimator='elbo'); drop them or pick 'elbo'."
            )
        self.gen_length = gen_length
        self.mask_token_id = mask_token_id
        self.temperature = temperature
        self.seed = seed
        self.num_iterations = num_iterations
        self.entropy_grad = entropy_grad
        self._autocast = autocast
        self._generations = {"train": 0, "eval": 0}

    def new_slices(self, mode: str) -> dict[str, Tensor]:
        """One seed per inner iteration of this generation batch (eval: one, from a disjoint stream).

        Returned as ``(1, K)``: the trainer expands it to every row of the batch.
        """
        count = self._generations[mode]
        self._generations[mode] += 1
        if mode == "train":
            seeds = mask_seeds_for_step(self.seed, count, self.num_iterations)
        else:
            seeds = mask_seeds_for_step(self.seed, -1 - count, 1)
        return {"mask_seeds": torch.tensor([seeds], dtype=torch.int64)}

    def slices_of(self, batch: dict[str, Any]) -> Tensor:
        return batch["mask_seeds"]

    def select(self, inputs: dict[str, Any], iteration: int) -> dict[str, Any]:
        return select_iteration(inputs, iteration)

    def token_logps(self, model, input_ids, attention_mask, logits_to_keep, slices, *, batch_size=None,
                    compute_entropy=False, compute_aux_loss=False, **multimodal):  # fmt: skip
        """``(B, K, T)`` for ``slices`` ``(B, K)``; ``(B, T)`` for ``slices`` ``(B,)`` (the loss's one seed)."""
        if slices is None:
            raise RuntimeError(
                "diffusion log-probs need the mask seeds of the batch (mask_seeds); they are set by the "
                "trainer's _generate_and_score_completions and _compute_loss."
            )
        one = slices.dim() == 1
        with self._autocast():  # as TRL's own log-prob forward
            logps, entropies = diffusion_logps(
                model, input_ids, attention_mask, logits_to_keep, slices[:, None] if one else slices,
                estimator=self.estimator, gen_length=self.gen_length, mask_token_id=self.mask_token_id,
                temperature=self.temperature, batch_size=batch_size, compute_entropy=compute_entropy,
                entropy_grad=self.entropy_grad, **self.estimator_options,
            )  # fmt: skip
        if one:
            logps = logps[:, 0]
            entropies = None if entropies is None else entropies[:, 0]
        return logps, entropies, None


def _accepted(fn: Any, **options: Any) -> dict[str, Any]:
    """The options ``fn`` takes by keyword (all of them when it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return options
    return {k: v for k, v in options.items() if k in params}
