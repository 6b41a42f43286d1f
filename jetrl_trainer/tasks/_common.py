"""Pieces every task shares: the `Task` record and the completion parsers.

TRL calls a reward function as ``reward(prompts=..., completions=..., completion_ids=..., **columns)``
where each dataset column other than ``prompt`` arrives as a list, plus trainer extras
(``trainer_state``, ``log_extra``, ...). Completions are plain strings for text prompts and
``[{"role": "assistant", "content": ...}]`` for conversational ones; `completion_text` accepts both.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable

__all__ = [
    "Task",
    "completion_text",
    "extract_answer_span",
    "parse_number",
    "rng_for",
    "score_each_answer",
    "user_prompt",
]

RewardFn = Callable[..., list[float]]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"^[+-]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?$")


@dataclass(frozen=True)
class Task:
    """A prompt generator, its reward, and the answer a perfect policy would give.

    Parameters:
        name: registry name.
        make_dataset: ``(n, seed, **difficulty) -> datasets.Dataset`` with a conversational
            ``"prompt"`` column plus the answer columns the reward reads.
        reward_fn: TRL-compatible ``(prompts, completions, **columns) -> list[float]``.
        reference_answer: ``row -> str``, the completion text that earns full reward (used by the
            SFT warm start in `jetrl_trainer.tiny`).
        max_completion_length: a completion budget in tokens that fits the reference answers of
            the default difficulty under the character-level tiny tokenizer.
        description: one line for ``--help`` texts.
        difficulty_knobs: the keyword arguments ``make_dataset`` accepts besides ``n`` and ``seed``.
        completion_length_for: ``(**difficulty) -> int``, the budget for other knob values, for tasks
            whose answer length follows a knob; ``None`` = ``max_completion_length`` for any knobs.
    """

    name: str
    make_dataset: Callable[..., Any]
    reward_fn: RewardFn
    reference_answer: Callable[[dict], str]
    max_completion_length: int
    description: str = ""
    difficulty_knobs: tuple[str, ...] = field(default_factory=tuple)
    completion_length_for: Callable[..., int] | None = None

    def completion_budget(self, **difficulty: Any) -> int:
        """A completion budget in tokens that fits the reference answers at these knob values."""
        if self.completion_length_for is None:
            return self.max_completion_length
        return self.completion_length_for(**difficulty)


def user_prompt(content: str) -> list[dict[str, str]]:
    """A one-turn conversational prompt, the format TRL's GRPOTrainer renders with the chat template."""
    return [{"role": "user", "content": content}]


def completion_text(completion: Any) -> str:
    """The assistant text of a completion given as a string or as a list of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        parts = []
        for message in completion:
            if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
                continue
            content = message.get("content", "")
            if isinstance(content, list):  # content blocks: [{"type": "text", "text": ...}]
                content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
            parts.append(content or "")
        return "".join(parts)
    raise ValueError(
        f"completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )


def score_each_answer(score: Callable[[str, Any], float], completions: Any, answer: Any) -> list[float]:
    """``score(text, answer)`` per completion, for the rewards that read one ``answer`` column."""
    if len(completions) != len(answer):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")
    return [score(completion_text(c), a) for c, a in zip(completions, answer)]


def extract_answer_span(text: str) -> str:
    """The part of ``text`` that holds the answer: the last ``\\boxed{}`` or ``<answer>`` span, else all of it.

    Instruction-tuned models wrap answers in these; the tiny char-level models answer bare.
    """
    for pattern in (_BOXED, _ANSWER_TAG):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    return text.strip()


def parse_number(text: str) -> Fraction | None:
    """Parse a whole string as a number (``"1,234"``, ``"-3"``, ``"2.50"``, ``"$7"``); ``None`` if it is not one."""
    text = text.strip().removeprefix("$").rstrip(".").strip()
    if not _NUMBER.match(text):
        return None
    return Fraction(text.replace(",", ""))


def rng_for(seed: int) -> random.Random:
    """A private RNG so dataset generation neither reads nor disturbs the global random state."""
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return random.Random(seed)
