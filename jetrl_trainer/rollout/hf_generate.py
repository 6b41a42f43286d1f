"""Rollouts with `transformers.generate`, returning completions and their sampling log-probs.

Departs from TRL 1.16's HF branch of ``_generate_single_turn`` (which returns ``logprobs=None``) in
one way: the sampling warpers run as an explicit processor list ending in a
`SampledLogprobRecorder`, so each generated token comes with ``log p`` under the distribution it was
drawn from. Text-only: prompts are lists of token ids.

Why a recorder and not ``output_scores=True`` (the public way to get processed scores): the scores
of every step are kept until ``generate`` returns, ``[B, T, V]`` floats (10 GB for 64 × 256 tokens
of a 152k vocabulary); the recorder holds one ``[B, V]`` row at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from .base import Rollout, RolloutBackend
from .sampling import SampledLogprobRecorder, split_sampling_config

__all__ = ["HFGenerateBackend", "left_pad", "position_ids_from_mask", "truncate_after_eos"]


def left_pad(
    prompt_ids: Sequence[Sequence[int]], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> tuple[Tensor, Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` ``(B, P)`` for a batch of prompts."""
    width = max(len(p) for p in prompt_ids)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        if ids:
            input_ids[row, width - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """RoPE positions ``(B, L)`` as ``generate`` numbers them: from each row's first real token; pads get 1."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def truncate_after_eos(
    completion_ids: Tensor, logprobs: Tensor, eos_token_ids: Sequence[int]
) -> tuple[list[list[int]], list[list[float]]]:
    """Cut each row just after its first EOS (kept), as TRL does; log-probs are cut alike."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(list(eos_token_ids), device=completion_ids.device))
    lengths = torch.full((completion_ids.size(0),), completion_ids.size(1), dtype=torch.long)
    has_eos = is_eos.any(dim=1).cpu()
    lengths[has_eos] = is_eos.int().argmax(dim=1).cpu()[has_eos] + 1
    ids, lps = completion_ids.cpu().tolist(), logprobs.float().cpu().tolist()
    return [row[:n] for row, n in zip(ids, lengths.tolist())], [row[:n] for row, n in zip(lps, lengths.tolist())]


class HFGenerateBackend(RolloutBackend):
    """``rollout_backend="hf"``: transformers ``generate``, the reference backend (CPU and GPU).

    The sampling warpers run as an explicit processor list ending in a `SampledLogprobRecorder`,
    so each token comes with ``log p`` under the distribution it was drawn from. Two cases return
    ``logprobs=None`` instead (the trainer then scores the tokens with a rollout-phase forward):
    beam search or greedy decoding (no single per-token sampling distribution), and a ``generate``
    that did not run the processors it was handed (a stub or wrapper; the recorder saw too few steps).
    """

    name = "hf"

    def __init__(
        self,
        *,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        pad_to_multiple_of: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.device = device

    @torch.no_grad()
    def generate(
        self, model: nn.Module, prompt_ids: Sequence[Sequence[int]], sampling: GenerationConfig
    ) -> Rollout:
        unrecordable = _unrecordable_reason(sampling)
        if unrecordable is None:
            config, processors = split_sampling_config(sampling)
            recorder = SampledLogprobRecorder()
            processors.append(recorder)
        else:
            config, processors, recorder = sampling, None, None
        input_ids, attention_mask = left_pad(prompt_ids, self.pad_token_id, self.pad_to_multiple_of)
        device = self.device if self.device is not None else next(model.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        sequences = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config, logits_processor=processors
        )
        completion_ids = sequences[:, input_ids.size(1) :]
        num_new = completion_ids.size(1)
        if recorder is not None and not recorder.covers(num_new):
            recorder.reset()
            unrecordable = "generate did not run the recording logits processor (a stub or wrapper of generate?)"
        if unrecordable is not None:
            ids, _ = truncate_after_eos(completion_ids, torch.zeros(completion_ids.shape), self.eos_token_ids)
            return Rollout(ids, None, f"scored by a rollout-phase forward: {unrecordable}")
        ids, logprobs = truncate_after_eos(completion_ids, recorder.finish(sequences, num_new), self.eos_token_ids)
        return Rollout(ids, logprobs)


def _unrecordable_reason(config: GenerationConfig) -> str | None:
    """Why a per-token sampling log-prob is not defined for this decoding mode, or None."""
    if (config.num_beams or 1) > 1:
        return f"beam search (num_beams={config.num_beams}) has no per-token sampling distribution"
    if not config.do_sample:
        return "greedy decoding (do_sample=False) samples from no distribution"
    return None
