"""A folder of warm-started weights, so that processes sharing a seed start from the same bits.

The strategies or learning rates of one seed, run as parallel processes, would each spend the warm
start's minutes, and a start that is not bit-reproducible (LLaDA's on a GPU: its backward adds with
atomics; the autoregressive one runs under torch's deterministic algorithms) would give each other
weights. With a start cache, the first process that needs a seed's start builds it and saves it;
the others wait on a lock and load it. The key is what the warm start depends on:
the model builder, the task, its difficulty, the warm-start pool and the completion budget, not
the GRPO settings, so a learning-rate sweep shares its starts too.

Only `TinyModel` is cached: a `PretrainedModel` has no warm start (loading is reproducible), and a
builder of your own cannot be rebuilt without its warm start. Weights go through safetensors,
which keeps every bit, so a loaded start has the built one's `weights_fingerprint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .models import PretrainedModel, TinyModel, describe_builder
from .spec import StudySpec

__all__ = ["cached_start", "start_key"]

_DONE = "start.json"  # written last: a folder without it is not a start
_WEIGHTS = "model.safetensors"


def start_key(builder: Any, spec: StudySpec) -> str:
    """The first 16 hex digits of the SHA-256 of what a warm start depends on."""
    inputs = {"model": describe_builder(builder), "task": spec.task, "difficulty": spec.difficulty,
              "sft_examples": spec.sft_examples, "completion_length": spec.completion_length()}  # fmt: skip
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_start(builder: Any, spec: StudySpec, seed: int, cache_dir: str | os.PathLike, build: Callable[[Any], tuple],
                 fingerprint: Callable[[Any], str]) -> tuple[Any, Any]:  # fmt: skip
    """``build(builder)``'s ``(model, tokenizer)`` for ``seed``, from ``cache_dir`` when a process saved it
    already; otherwise built here and saved for the others. ``fingerprint``: `weights_fingerprint`."""
    if isinstance(builder, PretrainedModel):
        return build(builder)
    if not isinstance(builder, TinyModel):
        kind = describe_builder(builder)["builder"]
        raise ValueError("start_cache rebuilds a TinyModel's architecture and loads its saved warm start; this "
                         f"builder is {kind}. Leave start_cache unset for it.")  # fmt: skip
    folder = Path(cache_dir) / start_key(builder, spec) / f"seed{seed}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f"seed{seed}.lock"):
        if (folder / _DONE).exists():
            return _load(builder, build, folder, fingerprint)
        model, tokenizer = build(builder)
        _save(model, folder, fingerprint(model), seed)
        return model, tokenizer


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:  # an flock is per open file: it also orders threads that open it apart
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _save(model: Any, folder: Path, fingerprint: str, seed: int) -> None:
    from safetensors.torch import save_model

    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    save_model(model, str(partial / _WEIGHTS))  # tied weights saved once
    (partial / _DONE).write_text(json.dumps({"seed": seed, "fingerprint": fingerprint}))
    shutil.rmtree(folder, ignore_errors=True)  # a folder without start.json: an interrupted save
    partial.rename(folder)


def _load(builder: TinyModel, build: Callable[[Any], tuple], folder: Path, fingerprint: Callable[[Any], str]):
    from safetensors.torch import load_model

    model, tokenizer = build(dataclasses.replace(builder, warm_start_steps=0))  # the architecture, untrained
    load_model(model, str(folder / _WEIGHTS), device=str(next(model.parameters()).device))
    saved = json.loads((folder / _DONE).read_text())["fingerprint"]
    if fingerprint(model) != saved:
        raise RuntimeError(f"the start loaded from {folder} does not match the weights saved there; delete the "
                           "folder to build it again.")  # fmt: skip
    return model.eval(), tokenizer
