"""Where a study keeps its runs, and the atomic writes that make a finished run recognisable.

Layout: ``<output_dir>/<strategy slug>/seed<k>/{metrics.jsonl, result.json}``. Both files are
written to a temporary name and renamed into place once the run has finished; ``result.json``
comes last and is the done-marker. A run killed halfway leaves neither, and is run again: from its
newest checkpoint where it saved them (``run_study(checkpoint_every=N)``: ``checkpoint-<step>/``
beside ``started.json``, the settings it began with, and ``eval_before.json``, the evaluation of its start,
which a resume reads instead of evaluating the start again), from the start otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_eval_before", "read_run", "read_started", "run_dir", "write_eval_before", "write_run", "write_started"]

METRICS, RESULT, STARTED, EVAL_BEFORE = "metrics.jsonl", "result.json", "started.json", "eval_before.json"


def run_dir(output_dir: str | os.PathLike, slug: str, seed: int) -> Path:
    return Path(output_dir) / slug / f"seed{seed}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the whole new one


def write_run(folder: Path, rows: list[dict[str, float]], result: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / METRICS, "".join(json.dumps(row) + "\n" for row in rows))
    _write_atomic(folder / RESULT, json.dumps(result, indent=1) + "\n")


def read_run(folder: Path) -> tuple[list[dict[str, float]], dict[str, Any]] | None:
    """``(rows, result)`` of a finished run, or ``None`` when it is missing or incomplete."""
    try:
        result = json.loads((folder / RESULT).read_text())
        rows = [json.loads(line) for line in (folder / METRICS).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    return (rows, result) if len(rows) == result.get("rows") else None


def write_started(folder: Path, identity: dict[str, Any]) -> None:
    """What a checkpointed run began with, so that a resume never continues another run's checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / STARTED, json.dumps(identity, indent=1) + "\n")


def read_started(folder: Path) -> dict[str, Any] | None:
    return _read_json(folder / STARTED)


def write_eval_before(folder: Path, evaluation: dict[str, Any]) -> None:
    """The held-out evaluation of a checkpointed run's start: on the GPU preset (256 prompts, several sampled
    answers each) it takes about a minute, which every resumed call of a run would otherwise spend again."""
    _write_atomic(folder / EVAL_BEFORE, json.dumps(evaluation, indent=1) + "\n")


def read_eval_before(folder: Path) -> dict[str, Any] | None:
    return _read_json(folder / EVAL_BEFORE)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
