"""`run_study`: every strategy x seed of a `StudySpec`, then the table and the plot.

Per seed, the model is built (and warm-started) once and deep-copied for each strategy, so all
strategies of a seed start from the same weights, train on the same prompts in the same order (TRL
shuffles with the run seed) and draw from the same RNG stream. Finished runs are skipped (see
`_files`), so an interrupted study resumes where it stopped; a finished run made with other
settings or another model is refused rather than mixed into the table. With ``checkpoint_every``
an interrupted run also resumes from its newest checkpoint instead of its first step: runs longer
than one sitting (a device lent in 10-minute calls, a preemptible node) still finish.

Each run records a fingerprint of the weights it started from. A resume rebuilds the model, and a
GPU warm start can come out with other bits (on another GPU or software; LLaDA's in any process), so
when the rebuilt start differs from the one a seed's finished runs used, the study says so (in the log and in ``study.md``) instead of hiding it.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._files import (EVAL_BEFORE, STARTED, read_eval_before, read_run, read_started, run_dir, write_eval_before,
                     write_run, write_started)  # fmt: skip
from .data import StudyData, make_study_data
from .models import ModelBuilder, PretrainedModel, describe_builder
from .spec import StudySpec
from .strategy import Strategy

__all__ = ["StudyOutputs", "run_study", "weights_fingerprint"]


@dataclass(frozen=True)
class StudyOutputs:
    table: Path  # study.md
    plot: Path  # study.png
    ran: tuple[str, ...]  # "<strategy> seed <k>" of the runs made by this call
    skipped: tuple[str, ...]  # the ones found finished
    stopped: tuple[str, ...] = ()  # the ones left unfinished at stop_after_seconds


def run_study(
    spec: StudySpec,
    model: str | ModelBuilder,
    output_dir: str | os.PathLike,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    run: bool = True,
    start_cache: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    stop_after_seconds: float | None = None,
) -> StudyOutputs:
    """Run what is missing of ``spec`` into ``output_dir``; write ``study.md`` and ``study.png`` there.

    ``model`` is a builder (`TinyModel`, `PretrainedModel` or your own callable) or a checkpoint id.
    ``run=False`` builds and runs nothing: the table and plot cover the finished runs, and
    ``study.md`` lists the missing ones (for a study cut short where its hardware was).
    ``start_cache``: a folder where each seed's warm-started model is saved by the first process that
    builds it and loaded by the others (`start_cache.py`), so parallel processes share its bits.
    ``checkpoint_every``: each run saves a checkpoint (weights, optimizer, RNG, its metrics so far)
    every this many steps, keeping the newest; a run interrupted after one continues from it (0: none).
    A finished run deletes its checkpoints.
    ``stop_after_seconds``: the run in progress this long after the call began saves a checkpoint and
    stops after its current step, and no run starts after that; the table covers the finished runs,
    ``stopped`` names the others, and calling again continues them (for a sitting of known length).
    """
    from jetrl_trainer.tasks import get_task

    from .plot import plot_study
    from .start_cache import cached_start
    from .summary import load_runs, mixed_start_seeds, write_table

    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be a step count >= 0 (0: no checkpoints); got {checkpoint_every!r}.")
    if stop_after_seconds is not None and not stop_after_seconds >= 0:
        raise ValueError(f"stop_after_seconds must be a number of seconds >= 0; got {stop_after_seconds!r}.")
    deadline = None if stop_after_seconds is None else _now() + stop_after_seconds
    builder = PretrainedModel(model) if isinstance(model, str) else model
    identity = {"settings": spec.run_settings(), "model": describe_builder(builder)}
    identity = json.loads(json.dumps(identity))  # tuples -> lists, as read back from result.json
    task, data = get_task(spec.task), make_study_data(spec)
    ran, skipped, missing, stopped = [], [], [], []
    for seed in spec.seeds:
        pending = [s for s in spec.strategy_objects if not _finished(output_dir, s, seed, identity)]
        skipped += [f"{s.name} seed {seed}" for s in spec.strategy_objects if s not in pending]
        if not run or _past(deadline):
            (missing if not run else stopped).extend(f"{s.name} seed {seed}" for s in pending)
            pending = []
        if not pending:
            continue
        log(f"seed {seed}: building the model ({identity['model']['builder'].rsplit('.', 1)[-1]})")
        build = functools.partial(_call_builder, seed=seed, task=task, spec=spec, data=data)
        if start_cache is None:
            base, tokenizer = build(builder)
        else:
            base, tokenizer = cached_start(builder, spec, seed, start_cache, build, weights_fingerprint)
        start = weights_fingerprint(base)
        for strategy in pending:
            finished = not _past(deadline) and _run_one(spec, strategy, seed, base, tokenizer, task, data, output_dir,
                                                        identity, progress, start, checkpoint_every, deadline)  # fmt: skip
            (ran if finished else stopped).append(f"{strategy.name} seed {seed}")
        del base
    if skipped:
        log(f"skipped {len(skipped)} finished run(s): {', '.join(skipped)}")
    if missing:
        log(f"not run (run=False): {', '.join(missing)}")
    if stopped:
        log(f"stopped after {stop_after_seconds:g} s; not finished: {', '.join(stopped)}. Run the same command again "
            "to continue them (a stopped run from its checkpoint).")  # fmt: skip
    runs = load_runs(output_dir, spec)
    for seed in mixed_start_seeds(runs):
        log(f"warning: seed {seed}'s rebuilt start differs from the one its finished runs began with (a GPU "
            "warm start can differ across GPUs, software, or for LLaDA across processes); study.md marks the seed. Run a seed in one process, or let its "
            "processes share a start_cache, to avoid it.")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_table(runs, out / "study.md", spec, identity["model"], missing=missing + stopped)
    plot_study(runs, out / "study.png", spec)
    return StudyOutputs(out / "study.md", out / "study.png", tuple(ran), tuple(skipped), tuple(stopped))


_now = time.monotonic  # the deadline's clock (a test replaces it)


def _past(deadline: float | None) -> bool:
    return deadline is not None and _now() >= deadline


def _call_builder(builder: ModelBuilder, *, seed: int, task: Any, spec: StudySpec, data: StudyData) -> tuple[Any, Any]:
    return builder(seed=seed, task=task, max_completion_length=spec.completion_length(), sft_dataset=data.sft)


def _finished(output_dir, strategy: Strategy, seed: int, identity: dict[str, Any]) -> bool:
    folder = run_dir(output_dir, strategy.slug, seed)
    found = read_run(folder)
    if found is None:
        return False
    saved = {k: found[1].get(k) for k in identity}
    if saved != identity:
        changed = [k for k, v in identity["settings"].items() if (saved["settings"] or {}).get(k) != v]
        what = f"settings ({', '.join(changed)})" if changed else "model"
        raise ValueError(f"{folder} holds a finished run with another {what}; use another output_dir, or delete "
                         "that folder to run it again.")  # fmt: skip
    return True


def weights_fingerprint(model) -> str:
    """SHA-256 (first 16 hex digits) of ``model``'s parameters and buffers, by name, bit for bit."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _run_one(spec, strategy, seed, base, tokenizer, task, data: StudyData, output_dir, identity, progress,
             start_fingerprint: str, checkpoint_every: int = 0, deadline: float | None = None) -> bool:  # fmt: skip
    """Run one strategy x seed to its end (True), or until ``deadline``, saving a checkpoint (False)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback

    from jetrl_trainer import JetGRPOTrainer

    from .evaluate import evaluate_policy
    from .recorder import RolloutClock, RunRecorder

    folder = run_dir(output_dir, strategy.slug, seed)
    started = {**identity, "start_fingerprint": start_fingerprint}
    resume = _resumable(folder, started)
    checkpointed = bool(checkpoint_every) or deadline is not None
    if checkpointed and not resume:
        write_started(folder, started)
    trainer = JetGRPOTrainer(copy.deepcopy(base), task.reward_fn,
                             args=_config(spec, strategy, seed, folder, checkpoint_every),
                             train_dataset=data.train, processing_class=tokenizer)  # fmt: skip
    for cb in (PrinterCallback, ProgressCallback):  # our bar replaces the per-step dict dumps
        trainer.remove_callback(cb)
    recorder = RunRecorder(RolloutClock(trainer), total=spec.steps, desc=f"{spec.task} {strategy.name} seed {seed}",
                           progress=progress)  # fmt: skip
    trainer.add_callback(recorder)
    if deadline is not None:

        class StopAtDeadline(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step < state.max_steps and _past(deadline):  # the Trainer saves, then stops
                    control.should_save = control.should_training_stop = True

        trainer.add_callback(StopAtDeadline())
    evaluation = dict(phase=spec.eval_phase, samples=spec.eval_samples, seed=seed)
    # A resume continues the very start of started.json, so the evaluation saved with it is this start's.
    before = read_eval_before(folder) if resume else None
    if before is None:
        before = evaluate_policy(trainer, task, data.eval, **evaluation)
        if checkpointed:
            write_eval_before(folder, before)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if resume else None)  # True: the newest complete checkpoint
    if trainer.state.global_step < spec.steps:  # stopped at the deadline, its checkpoint saved
        del trainer
        gc.collect()
        return False
    seconds = time.perf_counter() - start + sum(row["time/step_s"] for row in recorder.rows[: recorder.restored])
    after = evaluate_policy(trainer, task, data.eval, **evaluation)
    result = {"strategy": strategy.name, "seed": seed, **started, "rows": len(recorder.rows),
              "train_seconds": seconds, "eval_before": before, "eval_after": after}  # fmt: skip
    if recorder.restored:
        result["resumed_after_step"] = recorder.rows[recorder.restored - 1]["step"]
    write_run(folder, recorder.rows, result)
    for leftover in (*folder.glob("checkpoint-*"), *folder.glob(".jetrl-*")):  # a finished run keeps its two files
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in (STARTED, EVAL_BEFORE, "README.md"):  # README.md: the checkpoints' model card
        (folder / leftover).unlink(missing_ok=True)
    del trainer
    gc.collect()
    return True


def _resumable(folder: Path, started: dict[str, Any]) -> bool:
    """Whether ``folder`` holds checkpoints of this very run (its settings, model and start)."""
    if not any(folder.glob("checkpoint-*")):
        return False
    found = read_started(folder)
    if found != json.loads(json.dumps(started)):
        raise ValueError(f"{folder} holds checkpoints of a run with other settings, another model or another start "
                         f"({'no started.json' if found is None else 'started.json differs'}); use another output_dir, "
                         "or delete that folder's checkpoint-* to start the run over.")  # fmt: skip
    return True


def _config(spec: StudySpec, strategy: Strategy, seed: int, folder: Path, checkpoint_every: int = 0):
    import torch

    from jetrl_trainer import JetGRPOConfig

    fields = dict(
        num_generations=spec.num_generations, per_device_train_batch_size=spec.prompts_per_step * spec.num_generations,
        max_completion_length=spec.completion_length(), temperature=spec.temperature, max_steps=spec.steps,
        learning_rate=spec.learning_rate, lr_scheduler_type="constant", beta=0.0, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), bf16=False,
        gradient_checkpointing=False, disable_tqdm=True,
    )  # fmt: skip
    if checkpoint_every:
        fields.update(save_strategy="steps", save_steps=checkpoint_every)
    fields["save_total_limit"] = 1  # the newest only (a deadline's too): a resume needs no other, each holds the optimizer
    fields.update(spec.trainer_kwargs)
    return JetGRPOConfig(output_dir=str(folder), seed=seed, **strategy.config_kwargs(), **fields)
