"""Rollouts with transformers continuous batching (`generate_batch`), with sampling log-probs.

transformers (>= 5.8) can return the log-prob of each sampled token under the processed
distribution (``ContinuousBatchingConfig.return_logprobs``): log of the softmax of the warped scores
it sampled from. TRL 1.16 discards them (its CB branch returns ``logprobs=None``); we keep them.

The CB engine runs the model in a background thread. The precision phase is the model's own (its
``QuantLinear``s carry it, `jetrl_trainer.quant.PrecisionPhases`), so the caller's rollout block
reaches that thread too.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from .base import Rollout, RolloutBackend

__all__ = ["ContinuousBatchingBackend", "generate_batch_with_logprobs"]


@torch.no_grad()
def generate_batch_with_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    generation_config: GenerationConfig,
    continuous_batching_config,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one completion per prompt with ``model.generate_batch``; ids and sampling log-probs.

    The model runs in its own precision phase: call it inside ``PrecisionPhases(model).rollout()``
    for a rollout.

    ``continuous_batching_config`` (a ``transformers.generation.ContinuousBatchingConfig``) is
    copied with ``return_logprobs=True`` and ``use_cuda_graph=False``: a captured graph would keep
    replaying the FP8 weight copies of the capture step after the optimizer has updated the master
    weights (the quantized-weight cache lives outside the graph). Completions are returned as the
    engine produced them (stopped at and including EOS, as TRL's branch does).
    """
    cb_config = copy.copy(continuous_batching_config)
    cb_config.return_logprobs = True
    cb_config.use_cuda_graph = False
    was_training = model.training
    try:
        outputs = model.generate_batch(
            [list(p) for p in prompt_ids],
            generation_config=generation_config,
            continuous_batching_config=cb_config,
            progress_bar=False,
        )
    finally:
        model.train(was_training)
    if len(outputs) != len(prompt_ids):
        raise RuntimeError(f"continuous batching returned {len(outputs)} completions for {len(prompt_ids)} prompts")
    completion_ids, logprobs = [], []
    for out in outputs.values():
        if out.error is not None:
            raise RuntimeError(f"continuous batching request {out.request_id} failed: {out.error}")
        if len(out.logprobs) != len(out.generated_tokens):
            raise RuntimeError("continuous batching returned no log-probs; transformers >= 5.8 is required")
        completion_ids.append(list(out.generated_tokens))
        logprobs.append([float(x) for x in out.logprobs])
    return completion_ids, logprobs


class ContinuousBatchingBackend(RolloutBackend):
    """``rollout_backend="continuous"``: transformers continuous batching (``generate_batch``).

    The engine reports the sampling log-probs itself; no CUDA graphs (see
    `generate_batch_with_logprobs`).
    """

    name = "continuous"

    def __init__(self, continuous_batching_config) -> None:
        self.continuous_batching_config = continuous_batching_config

    def generate(self, model: nn.Module, prompt_ids: Sequence[Sequence[int]], sampling: GenerationConfig) -> Rollout:
        ids, logprobs = generate_batch_with_logprobs(model, prompt_ids, sampling, self.continuous_batching_config)
        return Rollout(ids, logprobs)
