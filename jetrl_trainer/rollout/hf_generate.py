"""Rollouts with `transformers.generate`, returning completions and their sampling log-probs.

Departs from TRL 1.16's HF branch of ``_generate_single_turn`` (which returns ``logprobs=None``) in
one way: the sampling warpers run as an explicit processor list ending in a
`SampledLogprobRecorder`, so each generated token comes with ``log p`` under the distribution it was
drawn from. Text-only: prompts are lists of token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from .sampling import SampledLogprobRecorder, split_sampling_config

__all__ = ["generate_with_logprobs", "left_pad", "truncate_after_eos"]


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


@torch.no_grad()
def generate_with_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    generation_config: GenerationConfig,
    *,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    pad_to_multiple_of: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one completion per prompt; return completion ids and per-token sampling log-probs.

    Both lists are cut after the first EOS. Runs in whatever precision phase is active: the
    caller wraps it in ``precision_phase("rollout")``.
    """
    stripped_config, warpers = split_sampling_config(generation_config)
    recorder = SampledLogprobRecorder()
    warpers.append(recorder)
    input_ids, attention_mask = left_pad(prompt_ids, pad_token_id, pad_to_multiple_of)
    device = device if device is not None else next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    sequences = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=stripped_config,
        logits_processor=warpers,
    )
    prompt_len = input_ids.size(1)
    completion_ids = sequences[:, prompt_len:]
    logprobs = recorder.finish(sequences, completion_ids.size(1))
    return truncate_after_eos(completion_ids, logprobs, eos_token_ids)
