"""Chain: add numbers one at a time, writing each running total on its own line.

The strategy study needs completions of a few hundred tokens on which plain GRPO can still raise
accuracy (docs/study.md, "The long-chain setting"). With `reverse`, the 0.3B model's warm start got
no 150-240-digit answer exactly right, and at 32-64 digits the completions were only 49 tokens on
average; countdown answers are 7-8 tokens. Here every step is short and local: copy the total
from the line above, copy the next term from the prompt, add two small numbers. SFT can teach that,
while a chain is right only if all of its steps are, so the per-step errors compound over the 13-17
steps of the default and leave room for RL.

The default prompt is ``"sum 482+517+905="``; ``prompt_style="instruct"`` wraps it in a sentence.
The reference completion (one token per character for the tiny tokenizer) is::

    482+517=999
    999+905=1904
    =1904

Numbers are written as usual, most significant digit first. Writing them the other way round is
known to make addition easier for small transformers, but on the tiny CPU model it was not clearly
easier within a warm start's budget (which order learned first depended on the seed; docs/tasks.md),
and the usual order is one a reader checks at a glance.

Reward (per completion; the text is the whole completion, or the last ``\\boxed{}`` /
``<answer>`` span in it, split into lines; whitespace around a line and empty lines are ignored):

* ``1.0``  — exactly the reference lines: every ``total+term=new total`` step right, then ``=<sum>``;
* ``0.5 * k / s``  — a well-formed chain that is not the reference, whose first ``k`` of the ``s``
  step lines equal the reference's (a later step wrong, stopped early, a wrong or missing final
  line, extra steps). The credit grows along the chain, so long chains still give a signal;
* ``0.0``  — anything else: empty, a line that is neither ``a+b=c`` nor ``=c`` (ASCII digits only,
  no spaces or signs), or an ``=c`` line that is not the last.

A right sum after a wrong step earns only the prefix credit, and a bare ``=<sum>`` earns 0: the
scratchpad is the task.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from jetrl_trainer.tasks._common import Task, extract_answer_span, rng_for, score_each_answer, user_prompt

__all__ = ["TASK", "chain_reward", "completion_length_for", "make_dataset", "reference_answer", "reward", "score",
           "step_lines"]  # fmt: skip

PREFIX_CREDIT = 0.5
DEFAULT_MIN_TERMS, DEFAULT_MAX_TERMS, DEFAULT_DIGITS = 14, 18, 3

_STEP = re.compile(r"[0-9]+\+[0-9]+=[0-9]+")
_FINAL = re.compile(r"=[0-9]+")
_INSTRUCTION = ("Add these numbers from left to right. Write one line per addition, 'total+next=new total', "
                "then a last line '=' followed by the sum: ")  # fmt: skip


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_difficulty(min_terms: int, max_terms: int, digits: int, prompt_style: str) -> None:
    if not _is_int(min_terms) or not _is_int(max_terms) or not 2 <= min_terms <= max_terms:
        raise ValueError(f"need ints 2 <= min_terms <= max_terms (a chain adds at least two numbers), got "
                         f"min_terms={min_terms!r}, max_terms={max_terms!r}")  # fmt: skip
    if not _is_int(digits) or digits < 1:
        raise ValueError(f"digits must be an int >= 1 (the length of every term), got {digits!r}")
    if prompt_style not in ("short", "instruct"):
        raise ValueError(f"prompt_style must be 'short' or 'instruct', got {prompt_style!r}")


def make_dataset(
    n: int, seed: int = 0, *, min_terms: int = DEFAULT_MIN_TERMS, max_terms: int = DEFAULT_MAX_TERMS,
    digits: int = DEFAULT_DIGITS, prompt_style: str = "short",
):
    """``n`` sums of ``min_terms`` to ``max_terms`` terms of ``digits`` digits; columns ``prompt``, ``terms``, ``answer``."""
    from datasets import Dataset

    _check_difficulty(min_terms, max_terms, digits, prompt_style)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = rng_for(seed)
    rows: dict[str, list] = {"prompt": [], "terms": [], "answer": []}
    for _ in range(n):
        terms = [rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(rng.randint(min_terms, max_terms))]
        expression = "+".join(str(t) for t in terms)
        content = f"sum {expression}=" if prompt_style == "short" else _INSTRUCTION + expression
        rows["prompt"].append(user_prompt(content))
        rows["terms"].append(terms)
        rows["answer"].append(sum(terms))
    return Dataset.from_dict(rows)


def step_lines(terms: Sequence[int]) -> list[str]:
    """The reference completion's lines: one ``total+term=new total`` per addition, then ``=<sum>``."""
    lines, total = [], terms[0]
    for term in terms[1:]:
        lines.append(f"{total}+{term}={total + term}")
        total += term
    return [*lines, f"={total}"]


def reference_answer(row: dict) -> str:
    return "\n".join(step_lines(row["terms"]))


def completion_length_for(
    *, min_terms: int = DEFAULT_MIN_TERMS, max_terms: int = DEFAULT_MAX_TERMS, digits: int = DEFAULT_DIGITS,
    prompt_style: str = "short",
) -> int:
    """The longest reference at these knobs (every term ``9...9``), plus the end-of-turn token and slack."""
    _check_difficulty(min_terms, max_terms, digits, prompt_style)
    return len(reference_answer({"terms": [10**digits - 1] * max_terms})) + 8


def score(text: str, terms: Sequence[int]) -> float:
    """Reward of one completion text against the terms (see the module docstring)."""
    if len(terms) < 2:
        raise ValueError(f"a chain needs at least two terms, got {list(terms)!r}")
    want = step_lines(terms)
    lines = [line.strip() for line in extract_answer_span(text).split("\n") if line.strip()]
    if lines == want:
        return 1.0
    well_formed = lines and all(_STEP.fullmatch(line) for line in lines[:-1]) and (
        _STEP.fullmatch(lines[-1]) or _FINAL.fullmatch(lines[-1])
    )
    if not well_formed:
        return 0.0
    steps = want[:-1]
    right = next((i for i, (got, ref) in enumerate(zip(lines, steps)) if got != ref), min(len(lines), len(steps)))
    return PREFIX_CREDIT * right / len(steps)


def chain_reward(
    prompts: Sequence[Any], completions: Sequence[Any], terms: Sequence[Sequence[int]], **kwargs: Any
) -> list[float]:
    """TRL reward function: reads the ``terms`` column."""
    return score_each_answer(lambda text, t: score(text, [int(x) for x in t]), completions, terms)


reward = chain_reward  # TRL logs a reward under its __name__, so the function keeps the task name

TASK = Task(
    name="chain",
    make_dataset=make_dataset,
    reward_fn=chain_reward,
    reference_answer=reference_answer,
    max_completion_length=completion_length_for(),
    description="add min_terms..max_terms numbers of `digits` digits, one running-total line per step (long answers)",
    difficulty_knobs=("min_terms", "max_terms", "digits", "prompt_style"),
    completion_length_for=completion_length_for,
)
