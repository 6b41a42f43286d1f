"""Built-in RL tasks: seeded prompt generators and TRL-compatible reward functions.

```python
from jetrl_trainer.tasks import get_task

task = get_task("countdown")
dataset = task.make_dataset(256, seed=0, max_count=3)   # "prompt" + answer columns
trainer = JetGRPOTrainer(model, reward_funcs=task.reward_fn, train_dataset=dataset, ...)
```

Prompts are conversational (``[{"role": "user", "content": ...}]``) and, by default, terse
(``"12+7="``): the tiny offline models of `jetrl_trainer.tiny` read one token per character.
Pass ``prompt_style="instruct"`` for real chat models. See docs/tasks.md for every reward rule.
"""

from __future__ import annotations

from jetrl_trainer.tasks import arithmetic, chain, countdown, gsm8k, reverse, sudoku
from jetrl_trainer.tasks._common import Task, completion_text
from jetrl_trainer.tasks.gsm8k import load_gsm8k

__all__ = ["TASKS", "Task", "completion_text", "get_task", "load_gsm8k"]

TASKS: dict[str, Task] = {
    t.name: t for t in (arithmetic.TASK, countdown.TASK, sudoku.TASK, reverse.TASK, chain.TASK, gsm8k.TASK)
}


def get_task(name: str) -> Task:
    """The built-in task called ``name`` (one of ``TASKS``)."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}") from None
