"""Checks of the trainer's inputs that need the data or the model, run at construction.

`JetGRPOConfig.__post_init__` checks what the config alone can tell; these need more. Without them an
empty dataset trains 0 steps in silence (or fails with "max_steps must be set to a positive value"),
a dataset without a ``prompt`` column fails with ``KeyError: 'prompt'`` at the first step, and the
diffusion fields are silently ignored for an autoregressive model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sized
from typing import Any

from jetrl_trainer.config import DIFFUSION_FIELDS

__all__ = ["check_datasets", "check_diffusion_fields"]

_PROMPT_LIKE = ("question", "problem", "query", "instruction", "input", "text", "messages")


def check_datasets(train_dataset: Any, eval_dataset: Any) -> None:
    """Refuse an empty dataset, or one without a ``prompt`` column, with the columns it has."""
    _check_dataset("train_dataset", train_dataset)
    if isinstance(eval_dataset, dict):
        for key, dataset in eval_dataset.items():
            _check_dataset(f"eval_dataset[{key!r}]", dataset)
    else:
        _check_dataset("eval_dataset", eval_dataset)


def _check_dataset(what: str, dataset: Any) -> None:
    if dataset is None:
        return
    if isinstance(dataset, Sized) and len(dataset) == 0:
        raise ValueError(
            f"{what} is empty (0 rows): there is no prompt to train on. Check the split, filter or slice that built it."
        )
    columns = getattr(dataset, "column_names", None)  # None for an IterableDataset of unknown features
    if isinstance(columns, list) and "prompt" not in columns:
        guess = next((c for c in _PROMPT_LIKE if c in columns), "<your prompt column>")
        raise ValueError(
            f"{what} has no 'prompt' column (found: {', '.join(columns) or 'none'}).\nGRPO reads the prompts from a "
            f"'prompt' column (strings or lists of chat messages): rename yours, e.g. "
            f"dataset.rename_column({guess!r}, 'prompt')."
        )


def check_diffusion_fields(args: Any, model: Any, *, diffusion: bool) -> None:
    """Refuse diffusion-only fields set (to non-defaults) for an autoregressive model."""
    if diffusion:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    stray = [name for name in DIFFUSION_FIELDS if getattr(args, name) != defaults[name]]
    if stray:
        verb, pronoun = ("applies", "it") if len(stray) == 1 else ("apply", "them")
        raise ValueError(
            f"{', '.join(stray)} {verb} to diffusion LMs (LLaDA) only, and {type(model).__name__} is autoregressive; "
            f"unset {pronoun}."
        )
