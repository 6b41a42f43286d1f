"""Countdown: combine the given numbers with ``+ - * /`` and parentheses to hit a target.

Every puzzle is built from a random expression over the numbers (so a solution always exists,
and that expression is the reference answer): a random binary tree whose intermediate values are
positive integers, printed with minimal parentheses.

The answer is the completion (or its last ``\\boxed{}`` / ``<answer>`` span), cut at the first
``=`` so that ``"3*5+7=22"`` is accepted. It is parsed with `ast`, never `eval`: only integer
literals, ``+ - * /`` and parentheses are allowed, and it is evaluated in exact fractions.

Reward:

* ``1.0``  — uses each given number exactly once (as a multiset) and equals the target;
* ``0.3``  — uses exactly the given numbers but misses the target (or divides by zero);
* ``0.1``  — a valid expression that does not use exactly the given numbers;
* ``0.0``  — anything else.
"""

from __future__ import annotations

import ast
from collections import Counter
from fractions import Fraction
from typing import Any, Sequence

from jetrl_trainer.tasks._common import Task, completion_text, extract_answer_span, rng_for, user_prompt

__all__ = [
    "TASK",
    "countdown_reward",
    "evaluate_expression",
    "make_dataset",
    "reference_answer",
    "reward",
    "score",
]

CORRECT, RIGHT_NUMBERS, VALID_EXPRESSION, INVALID = 1.0, 0.3, 0.1, 0.0
_MAX_ANSWER_CHARS = 200  # a longer "equation" is not an answer; also bounds the parse cost
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


# ---------------------------------------------------------------- safe parsing and evaluation


def _parse(text: str) -> ast.expr | None:
    text = text.replace("×", "*").replace("÷", "/").strip()
    if not text or len(text) > _MAX_ANSWER_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
            continue
        if isinstance(node, tuple(_AST_OPS)):  # the operator nodes themselves
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            continue
        return None  # names, calls, unary minus, floats, **, ... are all rejected
    return tree


def _numbers(tree: ast.expr) -> list[int]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]


def _apply(op: str, left: Fraction, right: Fraction) -> Fraction:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    return left / right  # ZeroDivisionError is the caller's to catch


def _evaluate(tree: ast.expr) -> Fraction:
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    return _apply(_AST_OPS[type(tree.op)], _evaluate(tree.left), _evaluate(tree.right))


def evaluate_expression(text: str) -> Fraction | None:
    """Exact value of an arithmetic expression over non-negative ints; ``None`` if not allowed or undefined."""
    tree = _parse(text)
    if tree is None:
        return None
    try:
        return _evaluate(tree)
    except ZeroDivisionError:
        return None


def score(text: str, numbers: Sequence[int], target: int) -> float:
    """Reward of one completion text (see the module docstring)."""
    tree = _parse(extract_answer_span(text).split("=", 1)[0])
    if tree is None:
        return INVALID
    if Counter(_numbers(tree)) != Counter(int(n) for n in numbers):
        return VALID_EXPRESSION
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        return RIGHT_NUMBERS
    return CORRECT if value == target else RIGHT_NUMBERS


def countdown_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    numbers: Sequence[Sequence[int]],
    target: Sequence[int],
    **kwargs: Any,
) -> list[float]:
    """TRL reward function: reads the ``numbers`` and ``target`` columns."""
    if not len(completions) == len(numbers) == len(target):
        raise ValueError(
            f"got {len(completions)} completions, {len(numbers)} numbers rows and {len(target)} targets"
        )
    return [score(completion_text(c), ns, int(t)) for c, ns, t in zip(completions, numbers, target)]


reward = countdown_reward  # TRL logs a reward under its __name__, so the function keeps the task name


# ---------------------------------------------------------------- puzzle construction


def _random_expression(rng, leaves: list[int], ops: str) -> tuple[str, Fraction, int] | None:
    """Combine ``leaves`` in a random tree: (text, value, precedence), or None if a value went bad."""
    if len(leaves) == 1:
        return str(leaves[0]), Fraction(leaves[0]), 3
    split = rng.randint(1, len(leaves) - 1)
    left = _random_expression(rng, leaves[:split], ops)
    right = _random_expression(rng, leaves[split:], ops)
    if left is None or right is None:
        return None
    op = rng.choice(ops)
    (lt, lv, lp), (rt, rv, rp) = left, right
    value = _apply(op, lv, rv)
    # keep intermediate values positive integers: easier, and how people play the game
    if value <= 0 or value.denominator != 1:
        return None
    p = _PRECEDENCE[op]
    lt = f"({lt})" if lp < p else lt
    # a - (b + c) and a / (b * c) need their parentheses; a + (b - c) does not
    rt = f"({rt})" if rp < p or (rp == p and op in "-/") else rt
    return f"{lt}{op}{rt}", value, p


def _check_difficulty(min_count: int, max_count: int, max_number: int, max_target: int, ops: str) -> None:
    if not 2 <= min_count <= max_count <= 6:
        raise ValueError(f"need 2 <= min_count <= max_count <= 6, got {min_count}, {max_count}")
    if max_number < 1 or max_target < 1:
        raise ValueError(f"max_number and max_target must be >= 1, got {max_number}, {max_target}")
    if not ops or any(op not in _PRECEDENCE for op in ops):
        raise ValueError(f"ops must be a non-empty string over '+-*/', got {ops!r}")


def make_puzzle(rng, *, min_count: int = 3, max_count: int = 4, max_number: int = 10,
                max_target: int = 100, ops: str = "+-*/") -> dict:
    """One solvable puzzle: ``numbers`` (sorted), ``target`` and the ``solution`` expression."""
    _check_difficulty(min_count, max_count, max_number, max_target, ops)
    for _ in range(10_000):
        leaves = [rng.randint(1, max_number) for _ in range(rng.randint(min_count, max_count))]
        built = _random_expression(rng, leaves, ops)
        if built is not None and built[1] <= max_target:
            return {"numbers": sorted(leaves), "target": int(built[1]), "solution": built[0]}
    raise ValueError(f"could not build a puzzle with target <= {max_target}; raise max_target")


def make_dataset(n: int, seed: int = 0, *, prompt_style: str = "short", **difficulty: Any):
    """``n`` solvable puzzles; columns ``prompt``, ``numbers``, ``target``, ``solution``.

    Difficulty knobs (see `make_puzzle`): ``min_count``, ``max_count``, ``max_number``,
    ``max_target``, ``ops``. The numbers are shown sorted so that their order hides the solution.
    """
    from datasets import Dataset

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if prompt_style not in ("short", "instruct"):
        raise ValueError(f"prompt_style must be 'short' or 'instruct', got {prompt_style!r}")
    rng = rng_for(seed)
    rows: dict[str, list] = {"prompt": [], "numbers": [], "target": [], "solution": []}
    for _ in range(n):
        puzzle = make_puzzle(rng, **difficulty)
        shown = " ".join(map(str, puzzle["numbers"]))
        content = f"{shown} -> {puzzle['target']}" if prompt_style == "short" else (
            f"Using the numbers {shown} each exactly once, with + - * / and parentheses, "
            f"write an expression equal to {puzzle['target']}. Answer with the expression only."
        )
        rows["prompt"].append(user_prompt(content))
        for key in ("numbers", "target", "solution"):
            rows[key].append(puzzle[key])
    return Dataset.from_dict(rows)


def reference_answer(row: dict) -> str:
    return row["solution"]


TASK = Task(
    name="countdown",
    make_dataset=make_dataset,
    reward_fn=countdown_reward,
    reference_answer=reference_answer,
    max_completion_length=20,
    description="reach a target with the given numbers and + - * /; 0.3 for the right numbers",
    difficulty_knobs=("min_count", "max_count", "max_number", "max_target", "ops", "prompt_style"),
)
