"""Policy scorers: the log-probs a GRPO step needs of its completions, in either precision phase.

The trainer holds one scorer, chosen at init with the rollout backend (docs/architecture.md#one-grpo-step):
``logps(model, batch, phase) -> (B, K, T)``. K is the number of *slices*: 1 for an autoregressive
model; for a diffusion LM, one per inner iteration, each with its own mask seed
(`jetrl_trainer.diffusion.scoring.DiffusionScorer`). The trainer corrects each slice in one place.

TRL asks for log-probs through ``_get_per_token_logps_and_entropies(model, input_ids, ...)``, a call
that carries no batch (the reference log-probs during scoring, the current ones in the loss). The
trainer forwards those calls to `token_logps` with the slices that apply (``None`` for K = 1).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from jetrl_trainer.compiled_forward import CompiledBackbone
from jetrl_trainer.exact import training_logprobs
from jetrl_trainer.exact.mode import KVRoundtrip
from jetrl_trainer.quant import PrecisionPhases
from jetrl_trainer.rollout import position_ids_from_mask, processed_logprobs

__all__ = ["AutoregressiveScorer", "PolicyScorer", "completion_inputs", "generation_positions"]


def completion_inputs(batch: dict[str, Any]) -> tuple[Tensor, Tensor, int]:
    """``[prompt | completion]`` ids and mask ``(B, P + T)`` of a generated batch, and ``T``."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention_mask, batch["completion_ids"].size(1)


@contextlib.contextmanager
def generation_positions(model: nn.Module):
    """While open, a forward of ``model`` given a mask but no ``position_ids`` numbers positions as ``generate`` does.

    TRL's log-prob forward passes no ``position_ids``, so transformers counts a left-padded row's
    pads and its RoPE angles are offset from the rollout's: the same attention in exact arithmetic,
    not in rounding (on a tiny FP32 Qwen3, 3.6e-7 in the logits). ``generate``, the engine and vLLM
    all number a prompt from its first real token, so the training forward does too.
    """

    def add_positions(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        mask = kwargs.get("attention_mask")
        if kwargs.get("position_ids") is None and isinstance(mask, Tensor) and mask.dim() == 2:
            kwargs["position_ids"] = position_ids_from_mask(mask)
        return args, kwargs

    handle = model.register_forward_pre_hook(add_positions, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class PolicyScorer(ABC):
    """Scores completions; K slices per generation batch (see the module docstring)."""

    # Batch keys whose dim 1 is the slice (dim 0 stays the row, for TRL's shuffle); empty when K = 1.
    slice_keys: ClassVar[tuple[str, ...]] = ()

    @property
    def sliced(self) -> bool:
        return bool(self.slice_keys)

    def new_slices(self, mode: str) -> dict[str, Tensor]:
        """Per-row batch entries ``(B, K)`` that define the slices of a new generation batch (none: K = 1)."""
        return {}

    def slices_of(self, batch: dict[str, Any]) -> Tensor | None:
        """The slice ids ``(B, K)`` of a batch, in the form `token_logps` takes; ``None`` when K = 1."""
        return None

    def select(self, inputs: dict[str, Any], iteration: int) -> dict[str, Any]:
        """The micro-batch the loss of inner iteration ``iteration`` sees (identity when K = 1)."""
        return inputs

    @abstractmethod
    def token_logps(
        self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, slices: Tensor | None,
        **options: Any,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """TRL's ``_get_per_token_logps_and_entropies`` contract: (logps, entropies, aux loss).

        ``(B, T)`` tensors when ``slices`` is ``None`` or has one column and the caller is the loss;
        ``(B, K, T)`` otherwise (see the implementations).
        """

    def logps(self, model: nn.Module, batch: dict[str, Any], phase: str, *, batch_size: int) -> Tensor:
        """Log-probs ``(B, K, T)`` of the batch's completion tokens with ``model`` in ``phase``, no grad."""
        input_ids, attention_mask, T = completion_inputs(batch)
        with torch.no_grad(), PrecisionPhases(model).use(phase):
            logps, _, _ = self.token_logps(
                model, input_ids, attention_mask, T, self.slices_of(batch), batch_size=batch_size
            )
        return logps if logps.dim() == 3 else logps[:, None]

    def rollout_logps(self, model: nn.Module, batch: dict[str, Any], *, batch_size: int) -> Tensor:
        """The rollout policy's log-probs ``(B, K, T)`` of what it generated, when the backend recorded none."""
        return self.logps(model, batch, "rollout", batch_size=batch_size)


class AutoregressiveScorer(PolicyScorer):
    """K = 1: TRL's own per-token log-probs (``log_softmax(logits / temperature)``), positions as ``generate``'s.

    `rollout_logps` scores the distribution the sampler draws from: the generation config's
    warpers (temperature, top-k, top-p, min-p) applied to a rollout-phase forward, the teacher-forced
    twin of `SampledLogprobRecorder`, so a backend that could not record (beam search, a bypassed
    recorder) yields log-probs with the same meaning as one that could.
    """

    def __init__(
        self,
        trl_token_logps: Callable[..., tuple[Tensor, Tensor | None, Tensor | None]],
        generation_config: GenerationConfig,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        compiled: CompiledBackbone | None = None,
        exact: bool = False,
        kv_roundtrip: KVRoundtrip | None = None,
    ) -> None:
        self._trl_token_logps = trl_token_logps
        self.compiled = compiled  # compile_policy_forward: the policy's train-phase forwards, compiled
        # exact_logprobs: the training forward under the exact contract (jetrl_trainer.exact), whose
        # log-probs are the engine's recorded bits; TRL's fused LM head computes other bits.
        self.exact = exact
        self.kv_roundtrip = kv_roundtrip  # the rollout cache's rounding of keys and values (FP8 cache), or None
        self._warp = dict(
            temperature=generation_config.temperature or 1.0,
            top_k=generation_config.top_k or 0,
            top_p=1.0 if generation_config.top_p is None else generation_config.top_p,
            min_p=generation_config.min_p,
        )
        self._autocast = autocast

    def token_logps(self, model, input_ids, attention_mask, logits_to_keep, slices, **options):
        with generation_positions(model):
            if self.exact:
                return training_logprobs(
                    model, input_ids, attention_mask, logits_to_keep, temperature=self._warp["temperature"],
                    batch_size=options.get("batch_size"), compute_entropy=options.get("compute_entropy", False),
                    autocast=self._autocast, kv_roundtrip=self.kv_roundtrip,
                )  # fmt: skip
            if self.compiled is None or not self.compiled.applies_to(model):
                return self._trl_token_logps(model, input_ids, attention_mask, logits_to_keep, **options)
            # Right-padded to a static length; the padded tokens' log-probs (the last ones) are dropped.
            input_ids, attention_mask, pad = self.compiled.pad(input_ids, attention_mask)
            with self.compiled.active():
                logps, entropies, aux = self._trl_token_logps(
                    model, input_ids, attention_mask, logits_to_keep + pad, **options
                )
        if pad:
            logps = logps[:, :logits_to_keep]
            entropies = entropies[:, :logits_to_keep] if entropies is not None else None
        return logps, entropies, aux

    @torch.no_grad()
    def rollout_logps(self, model: nn.Module, batch: dict[str, Any], *, batch_size: int) -> Tensor:
        input_ids, attention_mask, T = completion_inputs(batch)
        rows = []
        with PrecisionPhases(model).rollout(), self._autocast(), generation_positions(model):
            for start in range(0, input_ids.size(0), batch_size):
                chunk = slice(start, start + batch_size)
                # Position p predicts token p + 1: keep the T logits that predict the completion.
                logits = model(input_ids=input_ids[chunk], attention_mask=attention_mask[chunk],
                               logits_to_keep=T + 1).logits[:, :-1]  # fmt: skip
                rows.append(processed_logprobs(logits.float(), input_ids[chunk, -T:], **self._warp))
        return torch.cat(rows)[:, None]
