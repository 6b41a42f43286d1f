"""Held-out evaluation through the trainer's own rollout backend, so AR models and LLaDA share it.

Departs from `jetrl_trainer.tiny.evaluate_reward` (transformers ``generate``, sampled) in two ways:
it decodes greedily, so the score of a policy is one number rather than a draw, and it samples with
``trainer.rollout_backend`` in a chosen precision phase, which is the same code path as the rollouts
(``generate`` for autoregressive models, the masked-diffusion sampler for LLaDA).
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
def evaluate_policy(trainer: Any, task: Any, dataset: Any, *, phase: str = "train", batch_size: int = 64) -> dict:
    """``{"reward": mean reward, "accuracy": share of completions earning 1.0, "n": prompts}``."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    tokenizer = trainer.processing_class
    prompts = list(dataset["prompt"])
    prompt_ids = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]  # fmt: skip
    sampling = greedy_sampling(trainer.rollout_sampling)
    was_training = model.training
    model.eval()
    completion_ids: list[list[int]] = []
    with PrecisionPhases(model).use(phase):
        for start in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[start : start + batch_size]
            completion_ids += trainer.rollout_backend.generate(model, batch, sampling).completion_ids
    model.train(was_training)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    columns = {k: list(dataset[k]) for k in dataset.column_names if k != "prompt"}
    rewards = task.reward_fn(prompts=prompts, completions=[[{"role": "assistant", "content": t}] for t in texts],
                             **columns)  # fmt: skip
    rewards = [0.0 if r is None else float(r) for r in rewards]
    return {"reward": sum(rewards) / len(rewards), "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "n": len(rewards)}  # fmt: skip
