"""GSM8K: grade-school word problems with a numeric final answer.

`load_gsm8k` reads the Hub dataset (``openai/gsm8k``, config ``main``) through
`datasets.load_dataset`, or a local copy: a ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a
directory, or explicit ``data_files``. Rows need ``question`` and ``answer`` columns, the answer
being the worked solution ending in ``#### <number>`` as in the original release.

Reward (binary): 1.0 when the completion's final answer equals the reference number, else 0.0.
The final answer is, in order of preference, the last ``\\boxed{...}``, the number after the last
``####``, or the last number in the completion. Commas, a leading ``$`` and a trailing ``.`` are
ignored; numbers compare exactly (``"42.0"`` equals ``"42"``).
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

from jetrl_trainer.tasks._common import Task, parse_number, score_each_answer, user_prompt

__all__ = [
    "DEFAULT_INSTRUCTION",
    "TASK",
    "extract_final_answer",
    "gsm8k_reward",
    "load_gsm8k",
    "parse_reference",
    "reference_answer",
    "reward",
    "score",
]

DEFAULT_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
_NUMBER_IN_TEXT = re.compile(r"-?\$?\d+(?:,\d{3})*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations, e.g. <<48/2=24>>
_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def parse_reference(solution: str) -> str:
    """The final number of a GSM8K solution (after ``####``): ``"1,234"`` -> ``"1234"``, ``"3.0"`` -> ``"3"``."""
    if "####" not in solution:
        raise ValueError(f"a GSM8K answer ends with '#### <number>'; got {solution[-80:]!r}")
    final = solution.rsplit("####", 1)[1]
    value = parse_number(final)
    if value is None:
        raise ValueError(f"no number after '####' in {solution[-80:]!r}")
    if value.denominator == 1:
        return str(value.numerator)
    return final.strip().removeprefix("$").rstrip(".").replace(",", "")  # a decimal, as written


def extract_final_answer(text: str) -> str | None:
    """The final answer string of a completion (see the module docstring), or None if it has no number."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    if "####" in text:
        after = _NUMBER_IN_TEXT.findall(text.rsplit("####", 1)[1])
        if after:
            return after[0]
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1] if numbers else None


def score(text: str, answer: str) -> float:
    found = extract_final_answer(text)
    if found is None:
        return 0.0
    pred, ref = parse_number(found), parse_number(str(answer))
    return 1.0 if pred is not None and pred == ref else 0.0


def gsm8k_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """TRL reward function: reads the ``answer`` column (the normalised final number)."""
    return score_each_answer(score, completions, answer)


reward = gsm8k_reward  # TRL logs a reward under its __name__, so the function keeps the task name


def _first_file(data_files: Any) -> str:
    if isinstance(data_files, dict):
        data_files = next(iter(data_files.values()))
    if isinstance(data_files, (list, tuple)):
        data_files = data_files[0]
    return str(data_files)


def _load_raw(path_or_name: str, config: str | None, split: str, data_files: Any):
    from datasets import load_dataset

    if data_files is not None:  # explicit local files: the builder follows their extension
        ext = os.path.splitext(_first_file(data_files))[1]
        builder = _LOCAL_FORMATS.get(ext, path_or_name)
        if isinstance(data_files, (str, list, tuple)):
            data_files = {split: data_files}
        return load_dataset(builder, data_files=data_files, split=split)
    if os.path.isfile(path_or_name):
        ext = os.path.splitext(path_or_name)[1]
        if ext not in _LOCAL_FORMATS:
            raise ValueError(
                f"a local GSM8K file must end in one of {sorted(_LOCAL_FORMATS)}, got {path_or_name!r}"
            )
        return load_dataset(_LOCAL_FORMATS[ext], data_files={split: path_or_name}, split=split)
    if os.path.isdir(path_or_name):
        return load_dataset(path_or_name, split=split)
    return load_dataset(path_or_name, config, split=split)  # a Hub id: the only branch that may download


def load_gsm8k(
    split: str = "train",
    path_or_name: str = "openai/gsm8k",
    config: str | None = "main",
    *,
    data_files: Any = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    n: int | None = None,
    seed: int = 0,
):
    """GSM8K as a GRPO dataset: columns ``prompt`` (conversational), ``answer`` (final number), ``solution``.

    ``instruction`` is appended to each question on a new line (``None`` to leave questions bare).
    ``n`` keeps a seeded random subset of that size. Downloads only when ``path_or_name`` is a Hub
    id and no ``data_files`` are given.
    """
    raw = _load_raw(path_or_name, config, split, data_files)
    missing = {"question", "answer"} - set(raw.column_names)
    if missing:
        raise ValueError(f"GSM8K rows need 'question' and 'answer' columns; {sorted(missing)} missing")
    if n is not None:
        if not 1 <= n <= len(raw):
            raise ValueError(f"n must be in [1, {len(raw)}], got {n}")
        raw = raw.shuffle(seed=seed).select(range(n))

    def to_row(row: dict) -> dict:
        content = row["question"] if instruction is None else f"{row['question']}\n{instruction}"
        return {"prompt": user_prompt(content), "answer": parse_reference(row["answer"]), "solution": row["answer"]}

    return raw.map(to_row, remove_columns=raw.column_names).select_columns(["prompt", "answer", "solution"])


def reference_answer(row: dict) -> str:
    """The worked solution without calculator annotations, ending in ``#### <answer>``."""
    return _CALCULATOR.sub("", row["solution"])


def _make_dataset(n: int, seed: int = 0, **kwargs: Any):
    return load_gsm8k(n=n, seed=seed, **kwargs)


TASK = Task(
    name="gsm8k",
    make_dataset=_make_dataset,
    reward_fn=gsm8k_reward,
    reference_answer=reference_answer,
    max_completion_length=512,
    description="GSM8K word problems (Hub or local files), binary reward on the final number",
    difficulty_knobs=("split", "path_or_name", "config", "data_files", "instruction"),
)
