"""Rollouts with transformers continuous batching (`generate_batch`), with sampling log-probs.

transformers (>= 5.8) can return the log-prob of each sampled token under the processed
distribution (``ContinuousBatchingConfig.return_logprobs``): log of the softmax of the warped scores
it sampled from. TRL 1.16 discards them (its CB branch returns ``logprobs=None``); we keep them.

The CB engine runs the model in a background thread. Precision phases are thread-local (a rollout
thread must not flip the trainer's phase), so entering ``precision_phase("rollout")`` in the caller
would not reach it: `phase_around_forward` enters the phase inside every forward of the model,
in whichever thread runs it.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from jetrl_trainer.quant.phase import precision_phase

from .base import Rollout, RolloutBackend

__all__ = ["ContinuousBatchingBackend", "generate_batch_with_logprobs", "phase_around_forward"]


@contextlib.contextmanager
def phase_around_forward(model: nn.Module, phase: str) -> Iterator[None]:
    """While active, every ``model(...)`` call runs inside ``precision_phase(phase)``, in any thread."""
    local = threading.local()

    def enter(module, args):
        ctx = precision_phase(phase)
        ctx.__enter__()
        local.stack = [*getattr(local, "stack", []), ctx]

    def leave(module, args, output):
        local.stack.pop().__exit__(None, None, None)

    pre = model.register_forward_pre_hook(enter)
    post = model.register_forward_hook(leave, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


@torch.no_grad()
def generate_batch_with_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    generation_config: GenerationConfig,
    continuous_batching_config,
    *,
    phase: str = "rollout",
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one completion per prompt with ``model.generate_batch``; ids and sampling log-probs.

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
        with phase_around_forward(model, phase):
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
