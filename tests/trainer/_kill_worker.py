"""A trainer process for the kill-and-resume test (tests/trainer/test_checkpoint.py); not a test module.

`run` resumes a tiny training run from ``out_dir`` (``resume_from_checkpoint=True``), writes the step
it started from to ``report``, and trains on, saving a checkpoint every step. With ``point`` set it
kills itself with SIGKILL at that point of its first checkpoint save; a file being written at that
point is first cut to half its size, as a kill in the middle of the write would leave it:

``weights``, ``optimizer``, ``rng``, ``trainer_state``, ``manifest``: while that file is written;
``fsync``: after two files were fsynced; ``rename`` / ``renamed``: just before / after the staging
folder is renamed into place; ``rotate``: in the middle of deleting an old checkpoint;
``random:<seconds>``: that long after the save began, wherever the save then is.

The test starts it through a ``forkserver`` that has imported torch, transformers, TRL and the
trainer once (a fork takes milliseconds; a fresh interpreter would import them for seconds per kill).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading

import torch
import transformers.modeling_utils
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import TrainerState

from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
from jetrl_trainer import checkpoint as ckpt
from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

POINTS = ("weights", "optimizer", "rng", "trainer_state", "manifest", "fsync", "rename", "renamed", "rotate")
SAVE_TOTAL_LIMIT = 2


def run(out_dir: str, max_steps: int, point: str | None, report: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    if point is not None:
        _install(point)
    trainer = build_trainer(out_dir, max_steps)
    trainer.add_callback(_Report(report, trainer))
    trainer.train(resume_from_checkpoint=True)


def build_trainer(out_dir: str, max_steps: int) -> JetGRPOTrainer:
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    args = JetGRPOConfig(
        output_dir=out_dir, max_steps=max_steps, save_strategy="steps", save_steps=1,
        save_total_limit=SAVE_TOTAL_LIMIT, per_device_train_batch_size=2, num_generations=2, max_completion_length=2,
        train_precision="bf16", rollout_precision="bf16", lr_scheduler_type="constant", learning_rate=1e-2,
        logging_steps=1, report_to="none", bf16=False, use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(64)]})
    return JetGRPOTrainer(
        build_tiny_qwen3(tokenizer), _reward, args=args, train_dataset=prompts, processing_class=tokenizer
    )


def _reward(completions, **kwargs) -> list[float]:
    return [sum(c.encode()) / 255.0 for c in completions]


class _Report(TrainerCallback):
    def __init__(self, path: str, trainer: JetGRPOTrainer) -> None:
        self.path, self.trainer = path, trainer

    def on_train_begin(self, args, state, control, **kwargs):
        with open(self.path, "w") as f:
            json.dump({"start_step": state.global_step, "skipped_steps": self.trainer._guard.skipped_steps}, f)


# --------------------------------------------------------------------------------------------- kill points


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _cut_and_die(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)
    _die()


def _after(original, should_die, action):
    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        if should_die(*args, **kwargs):
            action(*args, **kwargs)
        return out

    return wrapper


def _install(point: str) -> None:
    if point == "weights":
        transformers.modeling_utils.safe_save_file = _after(
            transformers.modeling_utils.safe_save_file, lambda *a, **k: True, lambda t, f, **k: _cut_and_die(f)
        )
    elif point in ("optimizer", "rng"):
        name = {"optimizer": "optimizer.pt", "rng": "rng_state.pth"}[point]
        torch.save = _after(torch.save, lambda obj, f, *a, **k: str(f).endswith(name), lambda o, f, *a, **k: _cut_and_die(f))
    elif point == "trainer_state":
        TrainerState.save_to_json = _after(TrainerState.save_to_json, lambda *a: True, lambda s, path: _cut_and_die(path))
    elif point == "manifest":
        ckpt._write_json = _after(ckpt._write_json, lambda *a: True, lambda path, value: _cut_and_die(path))
    elif point == "fsync":
        calls = iter(range(3))
        ckpt._fsync_path = _after(ckpt._fsync_path, lambda *a, **k: next(calls, 2) == 2, lambda *a, **k: _die())
    elif point in ("rename", "renamed"):
        original = os.rename

        def rename(src, dst):
            staged = os.path.basename(os.path.dirname(src)).startswith(".jetrl-tmp-")
            if staged and point == "rename":
                _die()
            original(src, dst)
            if staged:
                _die()

        os.rename = rename
    elif point.startswith("random:"):
        prepare = ckpt.StagedCheckpoint.prepare
        timer = threading.Timer(float(point.split(":")[1]), _die)

        def start_then_prepare(stage):
            if not timer.is_alive():
                timer.start()
            prepare(stage)

        ckpt.StagedCheckpoint.prepare = start_then_prepare
    elif point == "rotate":
        original_rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if sys._getframe(1).f_code.co_name == "_discard" and os.path.isdir(path):
                first = sorted(os.listdir(path))[0]
                os.remove(os.path.join(path, first))  # a kill midway through the delete
                _die()
            return original_rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree
    else:
        raise ValueError(f"unknown kill point {point!r}; one of {POINTS}")
