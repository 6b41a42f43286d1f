"""Checkpoints that survive a kill: staged, fsynced and renamed into place whole; verified on resume.

transformers' ``Trainer._save_checkpoint`` writes ``checkpoint-N`` file by file straight into its
final folder, without fsync, and ``get_last_checkpoint`` resumes from the highest N it finds, so a
run killed while saving leaves a half-written folder that the next ``resume_from_checkpoint=True``
picks and crashes on. TRL 1.16 inherits this. How we depart from it:

* **write**: the Trainer's own saving code runs unchanged, but into a staging folder
  ``<run_dir>/.jetrl-tmp-checkpoint-N/checkpoint-N`` (the trainer points ``_get_output_dir`` there
  while it saves). When every process has written its files, the main process adds a manifest
  (``jetrl_checkpoint.json``: every file with its size, plus the trainer's own counters), fsyncs
  each file and folder, and renames the folder to ``<run_dir>/checkpoint-N``, then fsyncs
  ``run_dir``. The rename is the commit point: a ``checkpoint-N`` folder is complete or absent.
* **rotate** (``save_total_limit``) after the new checkpoint is in place, oldest first by step, never
  the one just written nor the best one; a folder is renamed aside before it is deleted, so a kill
  mid-delete leaves no partial ``checkpoint-N`` behind.
* **resume**: a checkpoint that fails `verify_checkpoint` is skipped with a warning, and training
  resumes from the newest one that passes (or starts from scratch when ``resume_from_checkpoint=True``
  finds none).

Folders named ``.jetrl-tmp-*`` / ``.jetrl-trash-*`` are leftovers of a killed save; the next save
removes them. Re-saving an existing ``checkpoint-N`` (after resuming from an older one) moves the old
folder aside just before the new one is renamed in; a kill between the two renames leaves no
``checkpoint-N``, and a resume then takes the newest other complete checkpoint.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Iterable
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

__all__ = [
    "MANIFEST_NAME",
    "StagedCheckpoint",
    "checkpoint_state",
    "latest_checkpoint",
    "resolve_resume",
    "rotate_checkpoints",
    "verify_checkpoint",
]

logger = logging.getLogger("jetrl_trainer")

MANIFEST_NAME = "jetrl_checkpoint.json"
TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
_STAGING, _TRASH = ".jetrl-tmp-", ".jetrl-trash-"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip format


class StagedCheckpoint:
    """One ``checkpoint-{step}`` of ``run_dir`` while it is written.

    ``root`` stands in for ``run_dir`` while the Trainer saves (so its files land in ``folder``);
    ``final`` is where `commit` puts the folder. Only the ``main`` process touches the file system.
    """

    def __init__(self, run_dir: str, step: int, *, main: bool = True) -> None:
        self.run_dir, self.main = run_dir, main
        name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        self.root = os.path.join(run_dir, _STAGING + name)
        self.folder = os.path.join(self.root, name)
        self.final = os.path.join(run_dir, name)

    def prepare(self) -> None:
        """Remove the leftovers of killed saves and create the staging folder (before anyone writes)."""
        if not self.main:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        for entry in os.listdir(self.run_dir):
            if entry.startswith((_STAGING, _TRASH)):
                shutil.rmtree(os.path.join(self.run_dir, entry), ignore_errors=True)
        os.makedirs(self.root)

    def relocate(self, path: str | None) -> str | None:
        """``path`` inside the staging folder, as it will be once committed (other paths unchanged)."""
        norm = os.path.normpath(path) if path else path
        if norm and (norm == self.folder or norm.startswith(self.folder + os.sep)):
            return self.final + norm[len(self.folder) :]
        return path

    def commit(self, state: Any, counters: dict[str, Any]) -> None:
        """Write the manifest, fsync everything and rename the folder into place (after every process wrote).

        ``state`` is the Trainer's ``TrainerState``: a ``best_model_checkpoint`` that the Trainer set to
        the staging folder is pointed at ``final`` (on every process) and rewritten in the checkpoint.
        """
        best = state.best_model_checkpoint
        state.best_model_checkpoint = self.relocate(best)
        if not self.main:
            return
        if best != state.best_model_checkpoint:
            state.save_to_json(os.path.join(self.folder, TRAINER_STATE_NAME))
        files = {rel: os.path.getsize(os.path.join(self.folder, rel)) for rel in _files(self.folder)}
        _write_json(os.path.join(self.folder, MANIFEST_NAME), {"format": 1, "files": files, "state": counters})
        _fsync_tree(self.folder)
        _replace_dir(self.folder, self.final)
        os.rmdir(self.root)


def verify_checkpoint(path: str) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is.

    Checks that ``trainer_state.json`` exists, that every file the manifest lists is there with the
    size it was written with (checkpoints written before the manifest existed have none), and that
    each JSON, safetensors and zip-format torch file is readable (JSON parses, the safetensors header
    parses and fits the file, the zip directory is there). Reads headers only, not the tensors.
    """
    if not os.path.isdir(path):
        return "not a folder"
    if not os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
        return f"{TRAINER_STATE_NAME} is missing"
    manifest = os.path.join(path, MANIFEST_NAME)
    if os.path.exists(manifest):
        try:
            listed = _read_json(manifest)["files"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"{MANIFEST_NAME} is unreadable ({err})"
        for rel, size in listed.items():
            full = os.path.join(path, rel)
            if not os.path.isfile(full):
                return f"{rel} is missing"
            if os.path.getsize(full) != size:
                return f"{rel} has {os.path.getsize(full)} bytes; {size} were written"
    for rel in _files(path):
        problem = _check_file(os.path.join(path, rel))
        if problem:
            return f"{rel}: {problem}"
    return None


def latest_checkpoint(folder: str, *, before: int | None = None) -> str | None:
    """The ``checkpoint-N`` of ``folder`` with the highest N (below ``before``) that verifies, or None.

    Each checkpoint skipped on the way is logged with the reason.
    """
    for step, path in sorted(_checkpoints(folder), reverse=True):
        if before is not None and step >= before:
            continue
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        logger.warning("jetrl: skipping incomplete or corrupt checkpoint %s: %s", path, problem)
    return None


def resolve_resume(resume: str | bool, output_dir: str) -> str | None:
    """The checkpoint to resume from for ``Trainer.train(resume_from_checkpoint=resume)``.

    ``True``: the newest complete checkpoint of ``output_dir``, or None (train from scratch, with a
    warning) when there is none. A path: that checkpoint if it verifies, else the newest complete one
    before it in the same folder; a ``ValueError`` when there is none.
    """
    if resume is True:
        found = latest_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if found is None:
            logger.warning("jetrl: no complete checkpoint in %s; training starts from scratch.", output_dir)
        return found
    resume = os.fspath(resume)
    problem = verify_checkpoint(resume)
    if problem is None:
        return resume
    logger.warning("jetrl: resume_from_checkpoint=%s is incomplete or corrupt: %s", resume, problem)
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(resume)))
    parent = os.path.dirname(os.path.normpath(resume))
    found = latest_checkpoint(parent, before=int(match.group(1))) if match and os.path.isdir(parent) else None
    if found is None:
        raise ValueError(
            f"resume_from_checkpoint={resume!r} is incomplete or corrupt ({problem}) and no complete checkpoint "
            "precedes it in the same folder; pass another checkpoint, or resume_from_checkpoint=None to start over."
        )
    logger.warning("jetrl: resuming from %s instead.", found)
    return found


def checkpoint_state(path: str) -> dict[str, Any]:
    """The trainer counters saved with the checkpoint at ``path`` (empty for one without a manifest)."""
    manifest = os.path.join(path, MANIFEST_NAME)
    return dict(_read_json(manifest).get("state", {})) if os.path.exists(manifest) else {}


def rotate_checkpoints(run_dir: str, limit: int | None, *, keep: Iterable[str | None] = ()) -> None:
    """Delete the oldest ``checkpoint-N`` folders (by N) until at most ``limit`` remain; never those in ``keep``.

    Called once the new checkpoint is in place (it belongs in ``keep``). ``None`` or ``<= 0``: keep all.
    """
    if not limit or limit <= 0:
        return
    protected = {os.path.normpath(p) for p in keep if p}
    checkpoints = [path for _, path in sorted(_checkpoints(run_dir))]
    excess = len(checkpoints) - max(limit, len(protected.intersection(checkpoints)))
    for path in checkpoints:
        if excess <= 0:
            break
        if path not in protected:
            logger.info("jetrl: deleting %s (save_total_limit=%d)", path, limit)
            _discard(path)
            excess -= 1


# --------------------------------------------------------------------------------------------- helpers


def _checkpoints(folder: str) -> list[tuple[int, str]]:
    found = []
    for entry in os.listdir(folder):
        match = _CHECKPOINT.match(entry)
        if match and os.path.isdir(os.path.join(folder, entry)):
            found.append((int(match.group(1)), os.path.normpath(os.path.join(folder, entry))))
    return found


def _files(folder: str) -> list[str]:
    """Every file under ``folder``, relative, sorted."""
    out = []
    for dirpath, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(dirpath, n), folder) for n in names]
    return sorted(out)


def _check_file(path: str) -> str | None:
    size = os.path.getsize(path)
    if path.endswith(".json"):
        try:
            _read_json(path)
        except (OSError, ValueError) as err:
            return f"not valid JSON ({err})"
    elif path.endswith(".safetensors"):
        return _check_safetensors(path, size)
    elif path.endswith((".pt", ".pth", ".bin")):
        if size == 0:
            return "empty"
        with open(path, "rb") as f:
            is_zip = f.read(4) == _ZIP_MAGIC
        if is_zip and not zipfile.is_zipfile(path):  # the zip directory is written last
            return "truncated (no zip directory)"
    return None


def _check_safetensors(path: str, size: int) -> str | None:
    """An 8-byte header length, a JSON header, and data that reaches the last tensor's end offset."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "truncated header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return "truncated header"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "unreadable header"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) > size:
        return "truncated data"
    return None


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)


def _fsync_path(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError as err:
        # Some file systems cannot fsync a directory; the files themselves are synced already.
        if not directory or err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _fsync_tree(folder: str) -> None:
    """fsync every file, then every folder bottom-up, so the rename publishes data that is on disk."""
    for rel in _files(folder):
        _fsync_path(os.path.join(folder, rel))
    for dirpath, _, _ in sorted(os.walk(folder), key=lambda item: -item[0].count(os.sep)):
        _fsync_path(dirpath, directory=True)


def _replace_dir(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` (same file system), moving an existing ``dst`` aside first."""
    parent = os.path.dirname(dst)
    trash = os.path.join(parent, _TRASH + os.path.basename(dst))
    replacing = os.path.exists(dst)
    if replacing:
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(dst, trash)
    os.rename(src, dst)
    _fsync_path(parent, directory=True)
    if replacing:
        shutil.rmtree(trash, ignore_errors=True)


def _discard(path: str) -> None:
    """Delete a folder so that a kill midway leaves no partial folder under its name."""
    trash = os.path.join(os.path.dirname(path), _TRASH + os.path.basename(path))
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    _fsync_path(os.path.dirname(path), directory=True)
    shutil.rmtree(trash, ignore_errors=True)
