"""What a run records per step: the logged metrics, and the step time split into rollout and training.

The split needs no TRL code: every rollout goes through ``trainer.rollout_backend.generate``, so
`RolloutClock` wraps that one method on the trainer's backend instance, and `RunRecorder` (a
`TrainerCallback`) times each optimizer step from ``on_step_begin`` to ``on_step_end``. The
training share is the rest of the step: rewards, old/sampling log-probs, corrector, loss, backward
and the optimizer. (For a diffusion LM the rollout-precision likelihood is a scorer forward, so it
counts as training, not rollout.)
"""

from __future__ import annotations

import math
import time
from typing import Any

from transformers import TrainerCallback

__all__ = ["RolloutClock", "RunRecorder"]


class RolloutClock:
    """Seconds spent in ``trainer.rollout_backend.generate`` since the last :meth:`take`."""

    def __init__(self, trainer: Any):
        backend = trainer.rollout_backend
        inner = backend.generate
        self.seconds = 0.0

        def timed_generate(*args: Any, **kwargs: Any):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        backend.generate = timed_generate  # an instance attribute: shadows the method of this backend only

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class RunRecorder(TrainerCallback):
    """One row per logged step: every numeric log, plus ``time/step_s``, ``time/rollout_s``, ``time/train_s``.

    Shows a tqdm bar with the live reward and mean |Δlogp|. Rows stay in memory; the runner
    writes them once the run is complete, so a half-finished run leaves no metrics file. Each row's
    timings also go into the trainer's ``log_history``, which a checkpoint saves: a run resumed from
    one starts with the rows logged before it (``restored`` of them).
    """

    def __init__(self, clock: RolloutClock, *, total: int, desc: str, progress: bool = True):
        self.clock, self.total, self.desc, self.progress = clock, total, desc, progress
        self.rows: list[dict[str, float]] = []
        self.restored = 0
        self._bar, self._step_start, self._timing = None, 0.0, {}

    def on_train_begin(self, args, state, control, **kwargs):
        from tqdm.auto import tqdm

        self.rows = [_row(entry) for entry in state.log_history if "reward" in entry]  # a resume's earlier steps
        self.restored = len(self.rows)
        self._bar = tqdm(total=self.total, initial=state.global_step, desc=self.desc, unit="step",
                         disable=not self.progress)  # fmt: skip

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.take()
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step = time.perf_counter() - self._step_start
        rollout = self.clock.take()
        self._timing = {"time/step_s": step, "time/rollout_s": rollout, "time/train_s": step - rollout}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:  # the end-of-training summary has no reward
            return
        entry = state.log_history[-1]  # Trainer.log appended this step's {**logs, "step"} just before
        entry.update(self._timing)  # saved with a checkpoint, so a resume gets its rows back from there
        self.rows.append(_row(entry))
        self._bar.update(state.global_step - self._bar.n)
        self._bar.set_postfix(reward=f"{logs['reward']:.3f}", dlogp=f"{logs.get('mismatch/logp_abs_diff_mean', 0):.1e}")

    def on_train_end(self, args, state, control, **kwargs):
        self._bar.close()


def _row(logged: dict[str, Any]) -> dict[str, float]:
    """A metrics row from one ``log_history`` entry: its step, then every finite number."""
    numeric = {k: float(v) for k, v in logged.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    return {"step": int(logged["step"]), **{k: v for k, v in numeric.items() if k != "step"}}
