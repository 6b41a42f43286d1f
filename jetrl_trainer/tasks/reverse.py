"""Reverse: write a string of digits backwards. A task whose completions are as long as you ask.

The mismatch between a BF16 and an FP8 policy compounds over the tokens of a completion, so the
strategy study needs a task with long completions (docs/study.md). The answers of countdown,
sudoku and arithmetic are a few tokens long, whatever the budget. Here the completion has as many
tokens as the prompt has digits (``min_digits`` to ``max_digits``; one token per digit for the
character-level tiny tokenizer), and every digit depends on the prompt.

The default prompt is ``"reverse 40213="``; ``prompt_style="instruct"`` wraps it in a sentence.

Reward (per completion; the answer is the whole completion, or the last ``\\boxed{}`` /
``<answer>`` span in it, stripped of surrounding whitespace):

* ``1.0``  — exactly the reversed digits;
* ``0.5 * k / n``  — a string of digits that is not the answer, whose first ``k`` of the ``n``
  answer digits are right (partial credit that grows along the completion, so long answers still
  give a signal);
* ``0.0``  — anything else (empty, or a character that is not a digit).
"""

from __future__ import annotations

from typing import Any, Sequence

from jetrl_trainer.tasks._common import Task, extract_answer_span, rng_for, score_each_answer, user_prompt

__all__ = ["TASK", "make_dataset", "reference_answer", "reverse_reward", "reward", "score"]

PREFIX_CREDIT = 0.5
DEFAULT_MIN_DIGITS, DEFAULT_MAX_DIGITS = 8, 32


def _check_difficulty(min_digits: int, max_digits: int, prompt_style: str) -> None:
    if not isinstance(min_digits, int) or not isinstance(max_digits, int) or not 1 <= min_digits <= max_digits:
        raise ValueError(f"need ints 1 <= min_digits <= max_digits, got min_digits={min_digits!r}, "
                         f"max_digits={max_digits!r}")  # fmt: skip
    if prompt_style not in ("short", "instruct"):
        raise ValueError(f"prompt_style must be 'short' or 'instruct', got {prompt_style!r}")


def make_dataset(
    n: int, seed: int = 0, *, min_digits: int = DEFAULT_MIN_DIGITS, max_digits: int = DEFAULT_MAX_DIGITS,
    prompt_style: str = "short",
):
    """``n`` digit strings of ``min_digits`` to ``max_digits`` digits; columns ``prompt``, ``digits``, ``answer``."""
    from datasets import Dataset

    _check_difficulty(min_digits, max_digits, prompt_style)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = rng_for(seed)
    rows: dict[str, list] = {"prompt": [], "digits": [], "answer": []}
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
        content = f"reverse {digits}=" if prompt_style == "short" else (
            f"Write these digits in reverse order, digits only: {digits}"
        )  # fmt: skip
        rows["prompt"].append(user_prompt(content))
        rows["digits"].append(digits)
        rows["answer"].append(digits[::-1])
    return Dataset.from_dict(rows)


def completion_length_for(*, max_digits: int = DEFAULT_MAX_DIGITS, **_: Any) -> int:
    """The answer's digits, plus room for the end-of-sequence token and a little slack."""
    return max_digits + 8


def reference_answer(row: dict) -> str:
    return row["answer"]


def score(text: str, answer: str) -> float:
    """Reward of one completion text against the reversed digits (see the module docstring)."""
    pred = extract_answer_span(text)
    if pred == answer:
        return 1.0
    if not pred or not pred.isdigit() or not pred.isascii():
        return 0.0
    right = next((i for i, (p, a) in enumerate(zip(pred, answer)) if p != a), min(len(pred), len(answer)))
    return PREFIX_CREDIT * right / len(answer)


def reverse_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """TRL reward function: reads the ``answer`` column."""
    return score_each_answer(lambda text, a: score(text, str(a)), completions, answer)


reward = reverse_reward  # TRL logs a reward under its __name__, so the function keeps the task name

TASK = Task(
    name="reverse",
    make_dataset=make_dataset,
    reward_fn=reverse_reward,
    reference_answer=reference_answer,
    max_completion_length=completion_length_for(),
    description="write a digit string backwards; completions as long as the prompt (min_digits..max_digits)",
    difficulty_knobs=("min_digits", "max_digits", "prompt_style"),
    completion_length_for=completion_length_for,
)
