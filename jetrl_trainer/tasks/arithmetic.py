"""Arithmetic: ``a+b``, ``a-b``, ``a*b`` with a numeric answer.

The default prompt is the bare expression (``"12+7="``) because the tiny models read one token
per character; ``prompt_style="instruct"`` wraps it in a sentence for real chat models.

Reward (per completion; the answer is the whole completion, or the last ``\\boxed{}`` /
``<answer>`` span in it, stripped of surrounding whitespace):

* ``1.0``  — a number equal to the answer;
* ``0.1 + 0.4 * max(0, 1 - |pred - answer| / max(10, |answer|))`` — a well-formed number that is
  wrong: 0.1 for the format plus up to 0.4 for being close (relative error, with a floor of 10 so
  that small answers do not make every miss "far");
* ``0.0``  — anything else (empty, words, trailing text, two numbers).
"""

from __future__ import annotations

from typing import Any, Sequence

from jetrl_trainer.tasks._common import (
    Task,
    extract_answer_span,
    parse_number,
    rng_for,
    score_each_answer,
    user_prompt,
)

__all__ = ["TASK", "arithmetic_reward", "make_dataset", "reference_answer", "reward", "score"]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
FORMAT_CREDIT = 0.1
CLOSENESS_CREDIT = 0.4


def _check_difficulty(max_operand: int, ops: str, prompt_style: str) -> None:
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ValueError(f"max_operand must be an int >= 1, got {max_operand!r}")
    if not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"ops must be a non-empty string over '+-*', got {ops!r}")
    if prompt_style not in ("short", "instruct"):
        raise ValueError(f"prompt_style must be 'short' or 'instruct', got {prompt_style!r}")


def make_dataset(
    n: int,
    seed: int = 0,
    *,
    max_operand: int = 20,
    ops: str = "+-",
    allow_negative: bool = False,
    prompt_style: str = "short",
):
    """``n`` problems with operands in ``[0, max_operand]``; columns ``prompt``, ``expression``, ``answer``.

    ``allow_negative=False`` orders the operands of ``-`` so answers stay >= 0 (one fewer
    character for the tiny models to learn).
    """
    from datasets import Dataset

    _check_difficulty(max_operand, ops, prompt_style)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = rng_for(seed)
    rows: dict[str, list] = {"prompt": [], "expression": [], "answer": []}
    for _ in range(n):
        op = rng.choice(ops)
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and not allow_negative and a < b:
            a, b = b, a
        expression = f"{a}{op}{b}"
        content = f"{expression}=" if prompt_style == "short" else (
            f"What is {expression}? Answer with the number only."
        )
        rows["prompt"].append(user_prompt(content))
        rows["expression"].append(expression)
        rows["answer"].append(_OPS[op](a, b))
    return Dataset.from_dict(rows)


def reference_answer(row: dict) -> str:
    return str(row["answer"])


def score(text: str, answer: int) -> float:
    """Reward of one completion text against the integer answer (see the module docstring)."""
    pred = parse_number(extract_answer_span(text))
    if pred is None:
        return 0.0
    if pred == answer:
        return 1.0
    closeness = max(0.0, 1.0 - float(abs(pred - answer)) / max(10.0, abs(answer)))
    return FORMAT_CREDIT + CLOSENESS_CREDIT * closeness


def arithmetic_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[int], **kwargs: Any
) -> list[float]:
    """TRL reward function: reads the ``answer`` column."""
    return score_each_answer(lambda text, a: score(text, int(a)), completions, answer)


reward = arithmetic_reward  # TRL logs a reward under its __name__, so the function keeps the task name

TASK = Task(
    name="arithmetic",
    make_dataset=make_dataset,
    reward_fn=arithmetic_reward,
    reference_answer=reference_answer,
    max_completion_length=8,
    description="a+b / a-b / a*b, numeric answer, partial credit for close well-formed numbers",
    difficulty_knobs=("max_operand", "ops", "allow_negative", "prompt_style"),
)
