"""Held-out evaluation through the trainer's own rollout backend, so AR models and LLaDA share it.

Departs from `jetrl_trainer.tiny.evaluate_reward` (transformers ``generate``, sampled) in two ways:
it decodes greedily, so the score of a policy is one number rather than a draw, and it samples with
``trainer.rollout_backend`` in a chosen precision phase, which is the same code path as the rollouts
(``generate`` for autoregressive models, the masked-diffusion sampler for LLaDA).

``samples=k`` also scores k completions per prompt drawn as the rollouts draw them (the trainer's
temperature). GRPO trains the sampling policy: a nearly deterministic warm start can learn to sample
its greedy answer more often without changing that answer (session 35 measured this on the GPU), which
the greedy score alone does not show. The draws come from a fixed seed inside a forked RNG, so the
evaluation before and after training sees the same noise and the training's own RNG stream is untouched.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from jetrl_trainer.quant import PrecisionPhases

__all__ = ["evaluate_policy"]


def greedy_sampling(sampling: Any) -> Any:
    """The backend's sampling settings with greedy decoding (temperature 0 for the diffusion sampler)."""
    if dataclasses.is_dataclass(sampling):  # DiffusionSampling: temperature 0 is Gumbel-free argmax
        return dataclasses.replace(sampling, temperature=0.0)
    config = copy.deepcopy(sampling)  # a GenerationConfig
    config.do_sample = False
    config.temperature = config.top_p = config.top_k = config.min_p = None
    return config


@torch.no_grad()
def evaluate_policy(trainer: Any, task: Any, dataset: Any, *, phase: str = "train", batch_size: int = 64,
                    samples: int = 0, seed: int = 0) -> dict:  # fmt: skip
    """``{"reward": mean reward, "accuracy": share of completions earning 1.0, "n": prompts}`` of greedy
    answers; with ``samples`` > 0 also ``sampled_reward`` and ``sampled_accuracy`` over ``samples`` sampled
    completions per prompt (seeded by ``seed``)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    prompts = list(dataset["prompt"])
    columns = {k: list(dataset[k]) for k in dataset.column_names if k != "prompt"}
    prompt_ids = trainer.processing_class.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                                              return_dict=True)["input_ids"]  # fmt: skip
    score = dict(trainer=trainer, model=model, task=task, phase=phase, batch_size=batch_size)
    rewards = _rewards(prompts, prompt_ids, columns, greedy_sampling(trainer.rollout_sampling), **score)
    result = {"reward": _mean(rewards), "accuracy": _exact_share(rewards), "n": len(rewards)}
    if samples:
        def repeat(values: list) -> list:
            return [v for v in values for _ in range(samples)]

        devices = [model.device.index or 0] if model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            drawn = _rewards(repeat(prompts), repeat(prompt_ids), {k: repeat(v) for k, v in columns.items()},
                             trainer.rollout_sampling, **score)  # fmt: skip
        result.update(sampled_reward=_mean(drawn), sampled_accuracy=_exact_share(drawn), samples=samples)
    return result


def _rewards(prompts: list, prompt_ids: list, columns: dict, sampling: Any, *, trainer: Any, model: Any, task: Any,
             phase: str, batch_size: int) -> list[float]:  # fmt: skip
    """The task's reward of one completion per prompt, generated with ``sampling`` in ``phase``."""
    tokenizer = trainer.processing_class
    was_training = model.training
    model.eval()
    completion_ids: list[list[int]] = []
    with PrecisionPhases(model).use(phase):
        for start in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[start : start + batch_size]
            completion_ids += trainer.rollout_backend.generate(model, batch, sampling).completion_ids
    model.train(was_training)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    rewards = task.reward_fn(prompts=prompts, completions=[[{"role": "assistant", "content": t}] for t in texts],
                             **columns)  # fmt: skip
    return [0.0 if r is None else float(r) for r in rewards]


def _mean(rewards: list[float]) -> float:
    return sum(rewards) / len(rewards)


def _exact_share(rewards: list[float]) -> float:
    return sum(r >= 1.0 for r in rewards) / len(rewards)
