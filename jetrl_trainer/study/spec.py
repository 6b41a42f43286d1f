"""`StudySpec`: what one strategy study runs, validated once, identical for every strategy and seed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from jetrl_trainer._choices import PHASES, STUDY_STRATEGIES, check_choice

from .strategy import Strategy, parse_strategies

__all__ = ["StudySpec"]

# Settings a run does not inherit from the spec: they name which runs, not how each one runs.
_NOT_PER_RUN = ("strategies", "seeds")


@dataclass(frozen=True)
class StudySpec:
    """The settings shared by every run of a study.

    Parameters:
        task: a built-in task name (`jetrl_trainer.tasks.get_task`).
        strategies: names ``train/rollout[+corrector]``; default `STUDY_STRATEGIES`.
        seeds: one run per strategy and seed. The seed sets the model init and warm start, TRL's
            data shuffle and the sampling RNG, so all strategies of a seed see the same prompt order.
        steps: GRPO optimizer steps per run.
        prompts_per_step: prompts per step; each gets ``num_generations`` completions.
        num_generations: the GRPO group size.
        max_completion_length: completion budget in tokens; ``None`` = the task's own.
        temperature: sampling temperature of the rollouts.
        learning_rate: AdamW learning rate (constant schedule).
        eval_prompts: held-out prompts for the final evaluation (greedy), none of them seen in the
            warm start or in GRPO.
        eval_phase: precision phase of the evaluation: ``"train"`` (the learner's policy) or
            ``"rollout"`` (the sampler's).
        eval_samples: completions sampled per held-out prompt at the rollout temperature, scored beside
            the greedy answer (``sampled_accuracy`` in each run's result); 0: greedy only.
        final_window: the table's final reward is the mean reward of the last this-many steps;
            ``None`` = a fifth of the steps (at least 1).
        sft_examples: problems in the warm-start pool.
        difficulty: the task's difficulty knobs, for every dataset of the study.
        trainer_kwargs: further `JetGRPOConfig` fields (e.g. ``diffusion_steps`` for LLaDA).
    """

    task: str
    strategies: tuple[str, ...] = STUDY_STRATEGIES
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 30
    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int | None = None
    temperature: float = 1.0
    learning_rate: float = 1e-3
    eval_prompts: int = 64
    eval_phase: str = "train"
    eval_samples: int = 0
    final_window: int | None = None
    sft_examples: int = 1024
    difficulty: dict[str, Any] = field(default_factory=dict)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from jetrl_trainer.tasks import get_task

        get_task(self.task)  # unknown names fail here, listing the tasks
        object.__setattr__(self, "strategies", tuple(s.name for s in parse_strategies(self.strategies)))
        object.__setattr__(self, "seeds", tuple(self.seeds))
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one; got {self.seeds!r}.")
        for name in ("steps", "prompts_per_step", "eval_prompts", "sft_examples"):
            _check_positive(name, getattr(self, name))
        if isinstance(self.eval_samples, bool) or not isinstance(self.eval_samples, int) or self.eval_samples < 0:
            raise ValueError(f"eval_samples must be a count >= 0 (0: greedy evaluation only); got "
                             f"{self.eval_samples!r}.")  # fmt: skip
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (GRPO compares completions in a group); got "
                             f"{self.num_generations}.")  # fmt: skip
        if self.max_completion_length is not None:
            _check_positive("max_completion_length", self.max_completion_length)
        if self.final_window is not None and not 1 <= self.final_window <= self.steps:
            raise ValueError(f"final_window must be in [1, steps={self.steps}]; got {self.final_window}.")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (GRPO samples its rollouts); got {self.temperature}.")
        object.__setattr__(self, "eval_phase", check_choice("eval_phase", self.eval_phase, PHASES, normalize=True))
        clash = {"train_precision", "rollout_precision", "corrector", "seed", "max_steps"} & set(self.trainer_kwargs)
        if clash:
            raise ValueError(f"trainer_kwargs must not set {sorted(clash)}: the study sets them per run.")

    @property
    def strategy_objects(self) -> tuple[Strategy, ...]:
        return parse_strategies(self.strategies)

    @property
    def window(self) -> int:
        return self.final_window or max(1, self.steps // 5)

    def completion_length(self) -> int:
        from jetrl_trainer.tasks import get_task

        return self.max_completion_length or get_task(self.task).completion_budget(**self.difficulty)

    def run_settings(self) -> dict[str, Any]:
        """What every run of this study shares; a run saved with other settings is not reused."""
        settings = asdict(self)
        for name in _NOT_PER_RUN:
            settings.pop(name)
        if not settings["eval_samples"]:  # the default leaves the settings of runs made before it existed as they were
            settings.pop("eval_samples")
        return settings


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}.")
