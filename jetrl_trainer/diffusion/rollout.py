"""``rollout_backend="diffusion"``: the LLaDA sampler as a rollout backend (docs/architecture.md#llada).

Returns no sampling log-probs: a diffusion LM's tokens come from many denoising steps, so the
"rollout" log-probs are the same likelihood estimate as the old and current ones, evaluated in the
rollout precision on the same masked input (`DiffusionScorer`). Their gap to the old log-probs is
then exactly the precision mismatch, 0 in the unified flow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from jetrl_trainer.rollout.base import Rollout, RolloutBackend
from jetrl_trainer.rollout.hf_generate import left_pad, truncate_after_eos

from .sampler import generate

__all__ = ["DiffusionBackend", "DiffusionSampling"]

_DEFAULT_BLOCK = 32  # LLaDA's and d1's block length
_PROGRESS_MIN_STEPS = 32  # denoising steps from which a rollout shows its own progress bar


@dataclass(frozen=True)
class DiffusionSampling:
    """Sampler settings of one run, resolved from a `JetGRPOConfig` (see :meth:`from_args`)."""

    steps: int
    gen_length: int
    block_length: int
    temperature: float
    remasking: str = "low_confidence"  # validated by JetGRPOConfig (and by the sampler)

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
        return cls(steps, gen_length, block, float(args.temperature), args.diffusion_remasking)


class DiffusionBackend(RolloutBackend):
    """Semi-autoregressive LLaDA sampling; completions cut after the first EOS, as TRL cuts AR ones."""

    name = "diffusion"

    def __init__(
        self,
        *,
        mask_token_id: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        pad_to_multiple_of: int | None = None,
        device: torch.device | str | None = None,
        show_progress: bool = True,
    ) -> None:
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.device = device
        self.show_progress = show_progress

    @torch.no_grad()
    def generate(self, model: nn.Module, prompt_ids: Sequence[Sequence[int]], sampling: DiffusionSampling) -> Rollout:
        ids, mask = left_pad(prompt_ids, self.pad_token_id, self.pad_to_multiple_of)
        device = self.device if self.device is not None else next(model.parameters()).device
        sequences = generate(
            model, ids.to(device), mask.to(device),
            steps=sampling.steps, gen_length=sampling.gen_length, block_length=sampling.block_length,
            temperature=sampling.temperature, remasking=sampling.remasking, mask_token_id=self.mask_token_id,
            # A bar for long generations only: a few-step tiny run would print one per micro-step.
            progress=self.show_progress and sampling.steps >= _PROGRESS_MIN_STEPS,
        )  # fmt: skip
        completions = sequences[:, ids.shape[1] :]
        completion_ids, _ = truncate_after_eos(completions, torch.zeros(completions.shape), self.eos_token_ids)
        return Rollout(completion_ids, None, "estimated in the rollout precision on the old log-probs' masks")
