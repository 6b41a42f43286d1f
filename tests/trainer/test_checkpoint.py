"""checkpoint.py: a checkpoint-N folder is complete or absent, whatever moment the run is killed at, and
a resume takes the newest complete one (or starts from scratch), never a partial one."""

from __future__ import annotations

import glob
import json
import logging
import multiprocessing
import os
import random
import signal
import struct
import time
from concurrent.futures import Future
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from _trainer_utils import make_trainer, train
from safetensors.torch import load_file, save_file

import _kill_worker
from jetrl_trainer import checkpoint as ckpt
from jetrl_trainer.checkpoint import (
    MANIFEST_NAME,
    StagedCheckpoint,
    checkpoint_state,
    latest_checkpoint,
    resolve_resume,
    rotate_checkpoints,
    verify_checkpoint,
)
from test_trainer_guard import NaNAdvantageTrainer

# --------------------------------------------------------------------------------------------- helpers


def _state(step: int, best: str | None = None) -> SimpleNamespace:
    """Stands in for TrainerState: commit reads best_model_checkpoint and may save it."""

    def save_to_json(path):
        with open(path, "w") as f:
            json.dump({"global_step": step, "best_model_checkpoint": state.best_model_checkpoint}, f)

    state = SimpleNamespace(best_model_checkpoint=best, save_to_json=save_to_json)
    return state


def _write_files(folder: str, step: int) -> None:
    """The files a Trainer checkpoint holds, in their real formats."""
    os.makedirs(folder, exist_ok=True)
    _state(step).save_to_json(os.path.join(folder, "trainer_state.json"))
    save_file({"w": torch.arange(64.0)}, os.path.join(folder, "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, os.path.join(folder, "optimizer.pt"))


def _save(run_dir: str, step: int, counters=None) -> str:
    """One checkpoint written the way the trainer writes it: prepare, files into the staging folder, commit."""
    stage = StagedCheckpoint(str(run_dir), step)
    stage.prepare()
    _write_files(stage.folder, step)
    stage.commit(_state(step), counters or {})
    return stage.final


# --------------------------------------------------------------------------------------------- write


def test_commit_publishes_a_complete_folder_synced_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = ckpt._fsync_path, os.rename
    monkeypatch.setattr(ckpt, "_fsync_path", lambda p, **k: (events.append(("fsync", p)), real_fsync(p, **k)))
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", a)), real_rename(a, b)))
    stage = StagedCheckpoint(str(tmp_path), 7)
    stage.prepare()
    _write_files(stage.folder, 7)
    assert not os.path.exists(stage.final)
    stage.commit(_state(7), {"jetrl/skipped_steps": 2})

    assert sorted(os.listdir(tmp_path)) == ["checkpoint-7"]  # the staging folder is gone
    assert verify_checkpoint(stage.final) is None
    manifest = json.load(open(os.path.join(stage.final, MANIFEST_NAME)))
    assert manifest["files"] == {n: os.path.getsize(os.path.join(stage.final, n))
                                 for n in ("model.safetensors", "optimizer.pt", "trainer_state.json")}  # fmt: skip
    assert checkpoint_state(stage.final) == {"jetrl/skipped_steps": 2}
    renamed = events.index(("rename", stage.folder))
    synced = {p for kind, p in events[:renamed] if kind == "fsync"}
    every_file = {os.path.join(stage.folder, n) for n in [*manifest["files"], MANIFEST_NAME]}
    assert every_file | {stage.folder} <= synced, "every file and the folder are fsynced before the rename"
    assert ("fsync", str(tmp_path)) in events[renamed:], "the parent folder is fsynced after it"


def test_a_save_that_fails_before_the_rename_leaves_no_checkpoint_and_is_cleaned_up(tmp_path, monkeypatch):
    stage = StagedCheckpoint(str(tmp_path), 3)
    stage.prepare()
    _write_files(stage.folder, 3)
    monkeypatch.setattr(os, "rename", mock.Mock(side_effect=OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        stage.commit(_state(3), {})
    monkeypatch.undo()
    assert not os.path.exists(stage.final) and latest_checkpoint(str(tmp_path)) is None
    _save(tmp_path, 4)  # the next save removes the leftover
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]


def test_resaving_a_step_replaces_the_folder_whole(tmp_path):
    _save(tmp_path, 5, {"jetrl/skipped_steps": 1})
    _save(tmp_path, 5, {"jetrl/skipped_steps": 9})
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-5"]
    assert checkpoint_state(str(tmp_path / "checkpoint-5")) == {"jetrl/skipped_steps": 9}


def test_best_model_checkpoint_set_to_the_staging_folder_points_at_the_final_one(tmp_path):
    stage = StagedCheckpoint(str(tmp_path), 2)
    stage.prepare()
    _write_files(stage.folder, 2)
    state = _state(2, best=stage.folder)  # what Trainer._save_checkpoint sets when this step is the best
    stage.commit(state, {})
    assert state.best_model_checkpoint == stage.final
    assert json.load(open(os.path.join(stage.final, "trainer_state.json")))["best_model_checkpoint"] == stage.final
    assert verify_checkpoint(stage.final) is None  # the rewritten file is the one the manifest sized


# --------------------------------------------------------------------------------------------- verify


def _cut(path, keep=0.5):
    os.truncate(path, int(os.path.getsize(path) * keep))


def _header_only(path):  # a safetensors header whose data is cut off
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    os.truncate(path, 8 + n + 4)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: os.remove(d / "trainer_state.json"), "trainer_state.json is missing"),
        (lambda d: _cut(d / "trainer_state.json"), "trainer_state.json has 24 bytes; 49 were written"),
        (lambda d: os.remove(d / "optimizer.pt"), "optimizer.pt is missing"),
        (lambda d: _cut(d / MANIFEST_NAME), f"{MANIFEST_NAME} is unreadable"),
    ],
    ids=["no-state", "cut-state", "missing-file", "bad-manifest"],
)
def test_damaged_checkpoints_fail_to_verify(tmp_path, damage, reason):
    path = _save(tmp_path, 1)
    assert verify_checkpoint(path) is None
    damage(tmp_path / "checkpoint-1")
    problem = verify_checkpoint(path)
    assert problem is not None and problem.startswith(reason), problem


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: None, None),
        (lambda d: os.remove(d / "trainer_state.json"), "trainer_state.json is missing"),
        (lambda d: _cut(d / "trainer_state.json"), "trainer_state.json: not valid JSON"),
        (lambda d: _cut(d / "model.safetensors", 0.01), "model.safetensors: truncated header"),
        (lambda d: _header_only(d / "model.safetensors"), "model.safetensors: truncated data"),
        (lambda d: _cut(d / "optimizer.pt"), "optimizer.pt: truncated (no zip directory)"),
    ],
    ids=["intact", "no-state", "bad-json", "cut-header", "cut-data", "cut-zip"],
)
def test_a_checkpoint_without_manifest_is_checked_by_its_files(tmp_path, damage, reason):
    """Checkpoints written before the manifest existed (or by plain transformers) resume if their files read."""
    _write_files(str(tmp_path / "checkpoint-3"), 3)
    damage(tmp_path / "checkpoint-3")
    problem = verify_checkpoint(str(tmp_path / "checkpoint-3"))
    assert problem == reason if reason is None else problem.startswith(reason), problem


# --------------------------------------------------------------------------------------------- resume


def test_resume_skips_incomplete_checkpoints_logs_them_and_takes_the_newest_complete(tmp_path, caplog):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    _write_files(str(tmp_path / "checkpoint-6"), 6)
    os.remove(tmp_path / "checkpoint-6" / "trainer_state.json")  # a kill before transformers wrote it
    _write_files(str(tmp_path / "checkpoint-8"), 8)
    _cut(tmp_path / "checkpoint-8" / "model.safetensors")  # SafetensorError: incomplete metadata
    with caplog.at_level(logging.WARNING, logger="jetrl_trainer"):
        assert resolve_resume(True, str(tmp_path)) == str(tmp_path / "checkpoint-4")
    skipped = [r.getMessage() for r in caplog.records]
    assert any("checkpoint-8: model.safetensors" in m for m in skipped), skipped
    assert any("checkpoint-6: trainer_state.json is missing" in m for m in skipped), skipped
    # An explicit path that fails falls back to the newest complete checkpoint before it.
    assert resolve_resume(str(tmp_path / "checkpoint-8"), str(tmp_path)) == str(tmp_path / "checkpoint-4")
    assert resolve_resume(str(tmp_path / "checkpoint-2"), str(tmp_path)) == str(tmp_path / "checkpoint-2")


def test_resume_true_without_a_complete_checkpoint_starts_from_scratch(tmp_path, caplog):
    assert resolve_resume(True, str(tmp_path / "never-created")) is None
    _write_files(str(tmp_path / "checkpoint-1"), 1)
    os.remove(tmp_path / "checkpoint-1" / "trainer_state.json")
    with caplog.at_level(logging.WARNING, logger="jetrl_trainer"):
        assert resolve_resume(True, str(tmp_path)) is None
    assert "training starts from scratch" in caplog.text


def test_an_explicit_path_with_nothing_to_fall_back_to_is_refused(tmp_path):
    _write_files(str(tmp_path / "checkpoint-1"), 1)
    _cut(tmp_path / "checkpoint-1" / "optimizer.pt")
    with pytest.raises(ValueError) as err:
        resolve_resume(str(tmp_path / "checkpoint-1"), str(tmp_path))
    assert str(err.value).startswith(f"resume_from_checkpoint={str(tmp_path / 'checkpoint-1')!r} is incomplete or corrupt")


# --------------------------------------------------------------------------------------------- rotation


def test_rotation_keeps_the_new_and_the_best_checkpoint_even_behind_newer_junk(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    os.makedirs(tmp_path / "checkpoint-9")  # junk with a higher number (e.g. a corrupt one a resume skipped)
    rotate_checkpoints(str(tmp_path), 1, keep=(str(tmp_path / "checkpoint-3"), str(tmp_path / "checkpoint-1")))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-3"]  # transformers' would keep 9
    rotate_checkpoints(str(tmp_path), 1, keep=(str(tmp_path / "checkpoint-3"),))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]
    rotate_checkpoints(str(tmp_path), None, keep=())
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]


# --------------------------------------------------------------------------------------------- trainer


def test_trainer_saves_through_the_staging_folder_and_keeps_skipped_steps_across_resume(tmp_path, monkeypatch):
    """Trainer._save_checkpoint writes under _get_output_dir (the contract the staging relies on); the
    skipped-steps counter is saved with the checkpoint and restored by a resume."""
    run = tmp_path / "run"
    staged = []
    real_commit = StagedCheckpoint.commit

    def commit(stage, state, counters):
        staged.append((os.path.exists(stage.final), sorted(os.listdir(stage.folder)), counters))
        real_commit(stage, state, counters)

    monkeypatch.setattr(StagedCheckpoint, "commit", commit)
    common = dict(train_precision="bf16", rollout_precision="bf16", lr_scheduler_type="constant", save_strategy="steps",
                  save_steps=1, max_completion_length=2)  # fmt: skip
    first = make_trainer(run, trainer_cls=NaNAdvantageTrainer, max_steps=2, **common)  # step 1 is skipped
    train(first)
    assert [s[0] for s in staged] == [False, False], "nothing was written to checkpoint-N before the commit"
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state.pth"} <= set(staged[-1][1])
    assert staged[-1][2] == {"jetrl/skipped_steps": 1}
    assert sorted(p for p in os.listdir(run) if p.startswith(("checkpoint", ".jetrl"))) == ["checkpoint-1", "checkpoint-2"]

    resumed = make_trainer(run, max_steps=3, **common)
    resumed.train(resume_from_checkpoint=True)
    last = [log for log in resumed.state.log_history if "loss" in log][-1]
    assert last["step"] == 3 and last["jetrl/skipped_steps"] == 1, "cumulative across the resume, not reset to 0"
    assert checkpoint_state(str(run / "checkpoint-3")) == {"jetrl/skipped_steps": 1}


def test_hub_upload_of_a_checkpoint_reads_the_folder_once_it_is_in_place(tmp_path):
    uploads = []

    def upload_folder(**kwargs):
        uploads.append((kwargs["folder_path"], verify_checkpoint(kwargs["folder_path"])))
        done = Future()
        done.set_result(None)
        return done

    api = mock.MagicMock()
    api.create_repo.return_value = SimpleNamespace(repo_id="someone/tiny")
    api.upload_folder.side_effect = upload_folder
    with mock.patch("transformers.trainer.hf_api", return_value=api):
        trainer = make_trainer(
            tmp_path / "run", train_precision="bf16", rollout_precision="bf16", max_completion_length=2,
            save_strategy="steps", save_steps=1, push_to_hub=True, hub_model_id="someone/tiny", hub_strategy="checkpoint",
        )  # fmt: skip
        train(trainer)
    final = str(tmp_path / "run" / "checkpoint-1")
    assert (final, None) in uploads, f"the checkpoint upload reads the complete final folder; got {uploads}"


# --------------------------------------------------------------------------------------------- kill and resume


def _assert_every_checkpoint_loads(run_dir: str, context: str) -> int:
    """Each visible checkpoint-N loads in full, read with the libraries (not with verify_checkpoint);
    returns the newest N, or 0."""
    steps = []
    for path in glob.glob(os.path.join(run_dir, "checkpoint-*")):
        state = json.load(open(os.path.join(path, "trainer_state.json")))
        load_file(os.path.join(path, "model.safetensors"))
        for name in ("optimizer.pt", "scheduler.pt"):
            torch.load(os.path.join(path, name), weights_only=True)
        torch.load(os.path.join(path, "rng_state.pth"), weights_only=False)
        assert os.path.basename(path) == f"checkpoint-{state['global_step']}", context
        steps.append(state["global_step"])
    return max(steps, default=0)


class _Runs:
    """Trainer processes forked from a server that has the heavy modules imported."""

    def __init__(self, tmp_path):
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["jetrl_trainer.trainer", "jetrl_trainer.tiny", "datasets"])
        self.run_dir, self.tmp = str(tmp_path / "run"), tmp_path
        os.makedirs(self.run_dir)
        self.count = 0

    def start(self, max_steps: int, point: str | None):
        self.count += 1
        self.report, self.log = str(self.tmp / f"report-{self.count}.json"), str(self.tmp / f"log-{self.count}.txt")
        process = self.ctx.Process(
            target=_kill_worker.run, args=(self.run_dir, max_steps, point, self.report, self.log), daemon=True
        )
        process.start()
        return process

    def started_at(self) -> int:
        return json.load(open(self.report))["start_step"]

    def tail(self) -> str:
        return open(self.log).read()[-3000:] if os.path.exists(self.log) else "(no log)"


def test_sigkill_at_any_point_of_a_save_then_resume_continues_from_the_newest_complete_checkpoint(tmp_path):
    """Each trainer process resumes from what the previous one left, then is killed while saving: at 11
    fixed points (kill-worker hooks) and at 5 random delays after a save began. After every kill every
    checkpoint-N loads, and the next process resumes from the newest one (from scratch when there is
    none), never crashing."""
    seed = int(os.environ.get("JETRL_KILL_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    fixed = ["weights", "rng", "renamed", "optimizer", "trainer_state", "renamed", "manifest", "fsync", "rename",
             "renamed", "rotate"]  # fmt: skip
    plan = [*fixed, *(f"random:{rng.uniform(0.0, 0.08):.4f}" for _ in range(5))]  # a save takes 0.03-0.15 s
    runs, newest = _Runs(tmp_path), 0
    for i, point in enumerate(plan):
        context = f"kill {i} at {point} (JETRL_KILL_SEED={seed})"
        process = runs.start(newest + (1 if point in fixed else 4), point)
        process.join(120)
        assert process.exitcode == -signal.SIGKILL, f"{context}: exit code {process.exitcode}\n{runs.tail()}"
        assert runs.started_at() == newest, f"{context}: resumed at {runs.started_at()}, not {newest}\n{runs.tail()}"
        newest = _assert_every_checkpoint_loads(runs.run_dir, context)
    assert newest >= 4, "the fixed kills after the rename published checkpoints"

    process = runs.start(newest + 2, None)  # a last run, not killed
    process.join(120)
    assert process.exitcode == 0, runs.tail()
    assert runs.started_at() == newest
    assert _assert_every_checkpoint_loads(runs.run_dir, "final run") == newest + 2
    entries = sorted(os.listdir(runs.run_dir))  # save_total_limit=2 held; the leftovers of the kills are gone
    assert entries == ["README.md", f"checkpoint-{newest + 1}", f"checkpoint-{newest + 2}"], entries
