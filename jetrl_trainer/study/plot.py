"""``study.png``: reward, mismatch and AIS gates per step, a line per strategy, a band over seeds.

Line: the mean over seeds at each step. Band: the min-max over seeds. The reward is smoothed
first (a trailing mean over ``spec.window`` steps, per seed), since one step's reward is a mean over
only ``prompts_per_step x num_generations`` completions. The AIS panels show only the strategies
that log the gates (``+ais``).
"""

from __future__ import annotations

import math
from pathlib import Path

from .spec import StudySpec
from .summary import Run

__all__ = ["PANELS", "plot_study"]

# (metric, axis label, y scale)
PANELS: tuple[tuple[str, str, str], ...] = (
    ("reward", "reward (smoothed)", "linear"),
    ("mismatch/logp_abs_diff_mean", "mean |Δlogp|", "symlog"),
    ("mismatch/kl_k3", "KL k3", "symlog"),
    ("mismatch/ess_ratio", "ESS ratio", "linear"),
    ("corrector/alpha", "AIS α", "linear"),
    ("corrector/alpha_ess", "AIS α_ess", "linear"),
    ("corrector/alpha_mis", "AIS α_mis", "linear"),
    ("corrector/alpha_var", "AIS α_var", "linear"),
)


def _trailing_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]  # fmt: skip


def _series(run: Run, key: str, window: int) -> dict[int, float]:
    points = [(r["step"], r[key]) for r in run.rows if key in r and math.isfinite(r[key])]
    values = [v for _, v in points]
    if key == "reward":
        values = _trailing_mean(values, window)
    return {step: v for (step, _), v in zip(points, values)}


def _draw(ax, runs: list[Run], key: str, window: int, colour) -> bool:
    per_seed = [_series(r, key, window) for r in runs]
    steps = sorted(set().union(*per_seed))
    if not steps:
        return False
    at = [[s[t] for s in per_seed if t in s] for t in steps]
    ax.plot(steps, [sum(v) / len(v) for v in at], color=colour, linewidth=1.6, label=runs[0].strategy)
    ax.fill_between(steps, [min(v) for v in at], [max(v) for v in at], color=colour, alpha=0.18, linewidth=0)
    return True


def plot_study(runs: list[Run], path: Path, spec: StudySpec) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.strategy for r in runs))
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(4, 2, figsize=(12, 13), sharex=True)
    for ax, (key, label, scale) in zip(axes.flat, PANELS):
        drawn = [_draw(ax, [r for r in runs if r.strategy == n], key, spec.window, colours[n]) for n in names]
        ax.set_ylabel(label)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-6)
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # ESS ~0.9999 reads as itself, not as an offset
        if not any(drawn):
            ax.text(0.5, 0.5, "no run logs this metric", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("GRPO step")
    seeds = ", ".join(map(str, spec.seeds))
    fig.suptitle(f"{spec.task}, {spec.completion_length()}-token completions, T={spec.temperature}, {spec.steps} steps. "
                 f"Line = mean over seeds ({seeds}), band = min-max over seeds; reward = trailing mean of {spec.window} "
                 "steps", y=0.995, fontsize=10)  # fmt: skip
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:  # none before the first run has finished (a call stopped or --report_only on a new folder)
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(names)), frameon=False,
                   bbox_to_anchor=(0.5, 0.975))  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.925))
    _save_small(fig, path)
    plt.close(fig)


def _save_small(fig, path: Path) -> None:
    """A palette PNG: a quarter of the bytes of matplotlib's RGBA one, so the docs can commit a few."""
    import io

    from PIL import Image  # a dependency of matplotlib

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    image = Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(path, optimize=True)
