"""``study.md``: one row per strategy, every number computed from the runs' metrics and results.

Per run: the final reward is the mean ``reward`` of the last ``spec.window`` steps; the mismatch is
the mean over steps of ``mismatch/logp_abs_diff_mean`` and the max over steps of
``mismatch/logp_abs_diff_max``; the times are the run's median seconds per step (a median, because
the shared machines this runs on stall now and then). Per strategy: mean ± sample std over seeds
for the rewards, the mean over seeds for times and mean mismatch, the max for the max mismatch. The
accuracy gain is paired: each seed's after minus its own before (the same start and held-out prompts),
then the mean over seeds with a 95% Student-t interval, so that a gain is read against its spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._files import read_run, run_dir
from .spec import StudySpec

__all__ = ["Run", "StrategyRow", "format_row", "load_runs", "summarize", "write_table"]

DLOGP_MEAN, DLOGP_MAX = "mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max"


@dataclass(frozen=True)
class Run:
    strategy: str
    seed: int
    rows: list[dict[str, float]]
    result: dict[str, Any]


@dataclass(frozen=True)
class StrategyRow:
    strategy: str
    seeds: int
    final_reward: tuple[float, float]  # (mean, std) over seeds
    eval_before: tuple[float, float]  # greedy accuracy on held-out prompts
    eval_after: tuple[float, float]
    eval_reward_after: tuple[float, float]  # mean reward of those greedy answers
    dlogp_mean: float
    dlogp_max: float
    rollout_s: float  # per step
    train_s: float
    eval_gain: tuple[float, float | None] | None = None  # paired after - before: (mean, 95% half-width)
    sampled_before: tuple[float, float] | None = None  # accuracy of sampled answers (StudySpec.eval_samples)
    sampled_after: tuple[float, float] | None = None
    sampled_gain: tuple[float, float | None] | None = None


def load_runs(output_dir, spec: StudySpec) -> list[Run]:
    """The finished runs of ``spec``'s strategies and seeds found in ``output_dir``."""
    runs = []
    for strategy in spec.strategy_objects:
        for seed in spec.seeds:
            found = read_run(run_dir(output_dir, strategy.slug, seed))
            if found is not None:
                runs.append(Run(strategy.name, seed, *found))
    return runs


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


# Student's t, two-sided 95%, by degrees of freedom; beyond 30 the value at 30 (slightly wide).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def mean_interval(values: list[float]) -> tuple[float, float | None]:
    """``(mean, half-width of its 95% Student-t interval)``; no interval from a single value."""
    if len(values) < 2:
        return statistics.fmean(values), None
    t = _T975[min(len(values) - 1, len(_T975)) - 1]
    return statistics.fmean(values), t * statistics.stdev(values) / len(values) ** 0.5


def _paired_gain(runs: list[Run], key: str) -> tuple[float, float | None] | None:
    if not all(key in r.result["eval_after"] and key in r.result["eval_before"] for r in runs):
        return None
    return mean_interval([r.result["eval_after"][key] - r.result["eval_before"][key] for r in runs])


def _column(rows: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def summarize(runs: list[Run], window: int) -> list[StrategyRow]:
    """One row per strategy, in the order the strategies first appear in ``runs``."""
    table = []
    for name in dict.fromkeys(r.strategy for r in runs):
        mine = [r for r in runs if r.strategy == name]
        table.append(StrategyRow(
            strategy=name,
            seeds=len(mine),
            final_reward=_mean_std([statistics.fmean(_column(r.rows, "reward")[-window:]) for r in mine]),
            eval_before=_mean_std([r.result["eval_before"]["accuracy"] for r in mine]),
            eval_after=_mean_std([r.result["eval_after"]["accuracy"] for r in mine]),
            eval_gain=_paired_gain(mine, "accuracy"),
            eval_reward_after=_mean_std([r.result["eval_after"]["reward"] for r in mine]),
            dlogp_mean=statistics.fmean(statistics.fmean(_column(r.rows, DLOGP_MEAN) or [0.0]) for r in mine),
            dlogp_max=max(max(_column(r.rows, DLOGP_MAX) or [0.0]) for r in mine),
            rollout_s=statistics.fmean(statistics.median(_column(r.rows, "time/rollout_s")) for r in mine),
            train_s=statistics.fmean(statistics.median(_column(r.rows, "time/train_s")) for r in mine),
            sampled_before=_sampled(mine, "eval_before"), sampled_after=_sampled(mine, "eval_after"),
            sampled_gain=_paired_gain(mine, "sampled_accuracy"),
        ))  # fmt: skip
    return table


def _sampled(runs: list[Run], when: str) -> tuple[float, float] | None:
    found = [r.result[when]["sampled_accuracy"] for r in runs if "sampled_accuracy" in r.result[when]]
    return _mean_std(found) if len(found) == len(runs) else None


def _pm(pair: tuple[float, float] | None) -> str:
    if pair is None:
        return "–"
    return f"{pair[0]:.3f} ± {pair[1]:.3f}"


def _points(gain: tuple[float, float | None] | None) -> str:
    if gain is None:
        return "–"
    mean, half = gain
    return f"{100 * mean:+.1f}" + ("" if half is None else f" ± {100 * half:.1f}")


def format_row(row: StrategyRow, sampled: bool = False) -> str:
    cells = [f"`{row.strategy}`", str(row.seeds), _pm(row.final_reward), _pm(row.eval_before), _pm(row.eval_after),
             _points(row.eval_gain), _pm(row.eval_reward_after),
             *((_pm(row.sampled_before), _pm(row.sampled_after), _points(row.sampled_gain)) if sampled else ()),
             f"{row.dlogp_mean:.2e}", f"{row.dlogp_max:.2e}", f"{row.rollout_s:.2f}", f"{row.train_s:.2f}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def _header(sampled: bool) -> str:
    columns = ["strategy", "seeds", "final reward", "eval acc. before RL", "eval acc. after RL", "eval gain (points)",
               "eval reward after RL",
               *(["sampled acc. before RL", "sampled acc. after RL", "sampled gain (points)"] if sampled else []),
               "mean \\|Δlogp\\|", "max \\|Δlogp\\|", "rollout s/step", "training s/step"]  # fmt: skip
    return "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"


def write_table(
    runs: list[Run], path: Path, spec: StudySpec, model: dict[str, Any], missing: Sequence[str] = ()
) -> None:
    rows = summarize(runs, spec.window)
    n_eval = runs[0].result["eval_after"]["n"] if runs else 0
    sampled = spec.eval_samples > 0
    shown = ", ".join(f"{k}={v}" for k, v in model.items() if k != "builder")
    text = f"""# Strategy study: {spec.task}

Model: `{model['builder'].rsplit('.', 1)[-1]}({shown})`. {spec.steps} GRPO steps x {spec.prompts_per_step} prompts x \
{spec.num_generations} completions of at most {spec.completion_length()} tokens, temperature {spec.temperature}, \
learning rate {spec.learning_rate}; seeds {', '.join(map(str, spec.seeds))}.

* final reward: mean training reward of the last {spec.window} steps of a run; mean ± sample std over seeds.
* eval acc.: share of {n_eval} held-out prompts (never seen in the warm start or GRPO) answered exactly \
(reward 1.0), greedy decoding, {spec.eval_phase}-phase precision; eval reward: the mean task reward of those \
answers; mean ± sample std over seeds. eval gain: after minus before per seed, in accuracy points, mean over \
seeds ± the half-width of its 95% Student-t interval (none from one seed).{_sampled_note(spec) if sampled else ""}
* mean / max |Δlogp|: `{DLOGP_MEAN}` averaged over steps and seeds / `{DLOGP_MAX}` maxed over steps and seeds.
* s/step: median over the steps of a run, mean over seeds; rollout = `rollout_backend.generate`, training = the rest \
of the optimizer step.

{_header(sampled)}
""" + "".join(format_row(r, sampled) + "\n" for r in rows) + _mixed_starts_note(runs) + _missing_note(missing)  # fmt: skip
    path.write_text(text)


def _sampled_note(spec: StudySpec) -> str:
    return (f"\n* sampled acc.: the same share over {spec.eval_samples} completions per held-out prompt sampled at "
            f"temperature {spec.temperature}, as the rollouts sample (fixed draws: the same before and after RL).")


def _missing_note(missing: Sequence[str]) -> str:
    return f"\n**Not run:** {', '.join(missing)} (this table covers the finished runs only).\n" if missing else ""


def mixed_start_seeds(runs: list[Run]) -> list[int]:
    """The seeds whose runs began from different weights (a resumed, rebuilt GPU warm start)."""
    starts: dict[int, set[str]] = {}
    for run in runs:
        if "start_fingerprint" in run.result:
            starts.setdefault(run.seed, set()).add(run.result["start_fingerprint"])
    return sorted(seed for seed, found in starts.items() if len(found) > 1)


def _mixed_starts_note(runs: list[Run]) -> str:
    mixed = mixed_start_seeds(runs)
    if not mixed:
        return ""
    return (f"\n**Warning:** the runs of seed(s) {', '.join(map(str, mixed))} began from different weights (the "
            "study was resumed and the warm start was rebuilt, not bit for bit), so their rows compare slightly "
            "different starts.\n")  # fmt: skip
