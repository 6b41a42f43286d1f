"""A settings sweep across study folders: one row and one curve per finished run, from its files.

A learning-rate (or temperature, or prompts-per-step) sweep runs one study per setting, each in its
own output folder, often as parallel processes sharing a start (`start_cache.py`). `sweep_report`
reads every finished run in those folders and writes what picks the setting: a JSON of per-run
figures, a Markdown table and a plot of the smoothed training reward against the step beside the
held-out accuracy before and after GRPO. Every number comes from the runs' ``metrics.jsonl`` and
``result.json``, so the report can be rebuilt from committed files.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ._files import read_run
from .plot import _save_small, _trailing_mean

__all__ = ["SweepRun", "load_sweep", "sweep_report"]

# The settings a sweep varies, as recorded in each run's result.json
SWEPT = ("learning_rate", "temperature", "prompts_per_step", "steps")


@dataclass(frozen=True)
class SweepRun:
    folder: str  # the output folder's name: the sweep's label for the setting
    strategy: str
    seed: int
    settings: dict  # SWEPT's values
    accuracy_before: float
    accuracy_after: float
    eval_prompts: int
    reward_first: float  # mean training reward over the first `window` steps
    reward_last: float  # ... and the last
    mean_completion_tokens: float
    seconds_per_step: float  # median
    rewards: list[float]  # per step, for the plot
    sampled_before: float | None = None  # held-out accuracy of sampled completions (StudySpec.eval_samples)
    sampled_after: float | None = None


def load_sweep(folders: Sequence[str | os.PathLike], window: int = 30) -> list[SweepRun]:
    """Every finished run (``<folder>/<strategy>/seed<k>/``) in ``folders``, in folder order."""
    runs = []
    for folder in map(Path, folders):
        found = sorted(p.parent for p in folder.glob("*/seed*/result.json"))
        if not found:
            raise ValueError(f"{folder} holds no finished run (<strategy>/seed<k>/result.json).")
        for run_folder in found:
            loaded = read_run(run_folder)
            if loaded is None:
                continue  # unfinished: the study reruns it
            rows, result = loaded
            rewards = [r["reward"] for r in rows]
            head, tail = rewards[: min(window, len(rewards))], rewards[-min(window, len(rewards)) :]
            lengths = [r["completions/mean_length"] for r in rows if "completions/mean_length" in r]
            runs.append(SweepRun(
                folder=folder.name, strategy=result["strategy"], seed=result["seed"],
                settings={k: result["settings"].get(k) for k in SWEPT},
                accuracy_before=result["eval_before"]["accuracy"], accuracy_after=result["eval_after"]["accuracy"],
                eval_prompts=result["eval_after"]["n"], reward_first=statistics.fmean(head),
                reward_last=statistics.fmean(tail),
                mean_completion_tokens=statistics.fmean(lengths) if lengths else 0.0,
                seconds_per_step=statistics.median(r["time/step_s"] for r in rows), rewards=rewards,
                sampled_before=result["eval_before"].get("sampled_accuracy"),
                sampled_after=result["eval_after"].get("sampled_accuracy"),
            ))  # fmt: skip
    return runs


def _table(runs: list[SweepRun], window: int) -> str:
    sampled = any(r.sampled_after is not None for r in runs)  # the column only where some run measured it
    lines = [f"| run | strategy | seed | learning rate | temperature | prompts × steps "
             f"| held-out accuracy before → after |{' sampled accuracy before → after |' if sampled else ''} "
             f"training reward, first → last {window} steps | completion tokens | s / step |",
             "|---|---|---|---|---|---|---|" + ("---|" if sampled else "") + "---|---|---|"]  # fmt: skip
    for r in runs:
        s = r.settings
        drawn = ""
        if sampled:
            drawn = (f" {100 * r.sampled_before:.1f}% → **{100 * r.sampled_after:.1f}%** |"
                     if r.sampled_after is not None else " – |")  # fmt: skip
        lines.append(f"| {r.folder} | `{r.strategy}` | {r.seed} | {s['learning_rate']:g} | {s['temperature']:g} | "
                     f"{s['prompts_per_step']} × {s['steps']} | {100 * r.accuracy_before:.1f}% → "
                     f"**{100 * r.accuracy_after:.1f}%** (n={r.eval_prompts}) |{drawn} {r.reward_first:.3f} → "
                     f"{r.reward_last:.3f} | {r.mean_completion_tokens:.0f} | {r.seconds_per_step:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _plot(runs: list[SweepRun], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for i, r in enumerate(runs):
        colour = plt.get_cmap("tab10")(i % 10)
        label = f"{r.folder} ({r.strategy}, seed {r.seed})"
        curves.plot(range(1, len(r.rewards) + 1), _trailing_mean(r.rewards, window), color=colour, label=label)
        bars.plot([0, 1], [100 * r.accuracy_before, 100 * r.accuracy_after], "-o", color=colour, label=label)
    curves.set(xlabel="GRPO step", ylabel=f"training reward (trailing mean of {window})")
    bars.set(xticks=[0, 1], xticklabels=["before GRPO", "after"], ylabel="held-out accuracy, greedy (%)",
             xlim=(-0.3, 1.3))  # fmt: skip
    for ax in (curves, bars):
        ax.grid(alpha=0.3)
    curves.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    _save_small(fig, path)
    plt.close(fig)


def sweep_report(folders: Sequence[str | os.PathLike], out: str | os.PathLike, window: int = 30) -> list[SweepRun]:
    """Write ``<out>.json``, ``<out>.md`` and ``<out>.png`` for the finished runs in ``folders``."""
    runs = load_sweep(folders, window)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = [{k: v for k, v in asdict(r).items() if k != "rewards"} for r in runs]
    out.with_suffix(".json").write_text(json.dumps(figures, indent=1) + "\n")
    out.with_suffix(".md").write_text(_table(runs, window))
    _plot(runs, out.with_suffix(".png"), window)
    return runs
