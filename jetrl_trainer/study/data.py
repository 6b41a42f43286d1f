"""The three prompt sets of a study: warm start, GRPO training, held-out evaluation.

All three are fixed by the spec, not by the run seed, so every strategy and seed trains on the same
prompts (TRL shuffles them with the run's seed). The evaluation set is drawn from its own seed and
then purged of every prompt that the warm start or GRPO could have seen, so the final accuracy is
measured on unseen problems even for tasks with small problem spaces (4x4 sudoku, small operands).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .spec import StudySpec

__all__ = ["StudyData", "make_study_data"]

# Dataset seeds, distinct from any run seed's role: they pick problems, not model randomness.
_SFT_SEED, _TRAIN_SEED, _EVAL_SEED = 7_001, 7_002, 7_003
_EVAL_OVERDRAW = 4  # draw this many times the wanted eval prompts before purging seen ones


@dataclass(frozen=True)
class StudyData:
    sft: Any  # datasets.Dataset for the warm start
    train: Any  # GRPO prompts: steps x prompts_per_step
    eval: Any  # held-out prompts, disjoint from both


def _key(prompt: Any) -> str:
    return json.dumps(prompt, sort_keys=True)


def make_study_data(spec: StudySpec) -> StudyData:
    from jetrl_trainer.tasks import get_task

    task = get_task(spec.task)
    sft = task.make_dataset(spec.sft_examples, seed=_SFT_SEED, **spec.difficulty)
    train = task.make_dataset(spec.steps * spec.prompts_per_step, seed=_TRAIN_SEED, **spec.difficulty)
    seen = {_key(p) for p in sft["prompt"]} | {_key(p) for p in train["prompt"]}
    pool = task.make_dataset(spec.eval_prompts * _EVAL_OVERDRAW, seed=_EVAL_SEED, **spec.difficulty)
    fresh, keep = set(), []
    for i, prompt in enumerate(pool["prompt"]):
        key = _key(prompt)
        if key not in seen and key not in fresh:
            fresh.add(key)
            keep.append(i)
    if not keep:
        raise ValueError(f"every {spec.task} evaluation prompt was already seen in training; lower sft_examples or "
                         "raise the difficulty so that the problem space is larger.")  # fmt: skip
    return StudyData(sft=sft, train=train, eval=pool.select(keep[: spec.eval_prompts]))
