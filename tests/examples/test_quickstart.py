"""examples/quickstart.py as a user runs it: a subprocess, offline, writing its metrics and plot.

The fast mode runs in CI. The full run (~30 s on 2 idle cores; asserts that the reward goes up) is
opt-in: ``JETRL_RUN_SLOW=1 pytest tests/examples/test_quickstart.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "quickstart.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _run(*args: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _check_outputs(out: Path, done: subprocess.CompletedProcess, steps: int) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reward before RL:" in done.stdout and "reward after RL:" in done.stdout
    assert "mismatch |logp_train - logp_rollout|" in done.stdout
    assert "GRPO (fp8 rollouts + fp8 training)" in done.stderr  # the tqdm bar
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert 0.0 <= row["reward"] <= 1.0
        assert row["mismatch/logp_abs_diff_mean"] < 1e-2  # unified FP8 flow: at the floor
        assert "corrector/alpha" in row and row["jetrl/skipped_steps"] == 0
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / "summary.json").read_text())


def test_help(tmp_path):
    done = _run("--help", cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and "--fast" in done.stdout and "--output_dir" in done.stdout


def test_fast_mode(tmp_path):
    done = _run("--fast", "--output_dir", str(tmp_path / "out"), cwd=tmp_path, timeout=600)
    summary = _check_outputs(tmp_path / "out", done, steps=4)
    assert 0.0 <= summary["reward_before"] <= 1.0 and 0.0 <= summary["reward_after"] <= 1.0


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JETRL_RUN_SLOW") != "1", reason="full quickstart: set JETRL_RUN_SLOW=1")
def test_full_run_raises_the_reward_within_five_minutes(tmp_path):
    done = _run("--output_dir", str(tmp_path / "out"), cwd=tmp_path, timeout=600)
    summary = _check_outputs(tmp_path / "out", done, steps=100)
    assert summary["reward_after"] > summary["reward_before"]
    assert summary["seconds"] < 300
