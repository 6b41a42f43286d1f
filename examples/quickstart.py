"""jetrl-trainer on a laptop CPU: FP8 GRPO with the unified precision flow.

    python examples/quickstart.py                 # 32 s measured on 2 idle CPU cores; no network, no GPU
    python examples/quickstart.py --fast          # a smoke run (~15 s), used by the tests

A busy machine can take several times longer.

What it does:

1. builds a tiny Qwen3-style model and a character-level tokenizer locally (nothing downloaded);
2. warm-starts it with a short supervised fine-tune on arithmetic answers, so that sampled answers
   already earn some reward (GRPO learns nothing from groups whose rewards are all equal);
3. measures the reward (mean over sampled completions, temperature 1.0, as GRPO samples);
4. runs GRPO with `JetGRPOTrainer`: FP8 training, FP8 rollouts (the same quantized modules in both
   phases), and the AIS corrector switched on (with no mismatch to correct, its gate stays ~0);
5. measures the reward again and prints it next to the mismatch the rollouts showed;
6. writes ``metrics.jsonl`` (one line per step) and ``metrics.png`` (reward and mismatch per step)
   into ``--output_dir``.

On CPU the FP8 arithmetic is emulated (same numbers as the GPU kernels, different speed).
Try ``--train_precision bf16 --rollout_precision fp8 --corrector none`` to see the mismatch of the
common BF16/FP8 baseline instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

# torch / transformers / jetrl_trainer are imported in main(), so that `--help` answers at once.

# Timings of both presets: see the module docstring. The warm start is kept short on purpose: a
# model that already answers most problems leaves GRPO little to show in 100 steps.
PRESETS = {
    "full": dict(warm_start_steps=60, grpo_steps=100, prompts_per_step=8, num_generations=8, eval_prompts=128),
    "fast": dict(warm_start_steps=15, grpo_steps=4, prompts_per_step=2, num_generations=4, eval_prompts=8),
}
LOGGED = (
    "reward", "reward_std", "loss", "mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max", "mismatch/kl_k3",
    "mismatch/ess_ratio", "corrector/alpha", "corrector/weight_mean", "jetrl/skipped_steps", "completions/mean_length",
)  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Offline FP8 GRPO quickstart on a tiny model (CPU, no downloads).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--output_dir", default="runs/quickstart", help="where metrics.jsonl and metrics.png go")
    parser.add_argument("--fast", action="store_true", help="a smoke run, ~15 s (fewer steps, smaller batches)")
    parser.add_argument("--task", default="arithmetic", help="built-in task: arithmetic, countdown or sudoku")
    parser.add_argument("--train_precision", default="fp8", choices=["bf16", "fp8", "nvfp4"])
    parser.add_argument("--rollout_precision", default="fp8", choices=["bf16", "fp8", "nvfp4"])
    parser.add_argument("--corrector", default="ais", help="none, is, tis, mis or ais")
    parser.add_argument("--warm_start_steps", type=int, default=None, help="SFT steps before RL (preset if unset)")
    parser.add_argument("--grpo_steps", type=int, default=None, help="GRPO optimizer steps (preset if unset)")
    parser.add_argument("--learning_rate", type=float, default=3e-4, help="GRPO learning rate (AdamW)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def metrics_callback(path: str, total: int, desc: str):
    """A TrainerCallback: a tqdm bar with the live reward and mismatch, one JSON line per logged step."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class MetricsCallback(TrainerCallback):
        def __init__(self):
            self.rows, self.bar = [], None

        def on_train_begin(self, args, state, control, **kwargs):
            open(path, "w").close()
            self.bar = tqdm(total=total, desc=desc, unit="step")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            row = {"step": state.global_step, **{k: logs[k] for k in LOGGED if k in logs}}
            self.rows.append(row)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.bar.update(state.global_step - self.bar.n)
            dlogp = row.get("mismatch/logp_abs_diff_mean", 0)
            self.bar.set_postfix(reward=f"{row['reward']:.3f}", dlogp=f"{dlogp:.1e}")

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return MetricsCallback()


def plot(rows: list[dict], path: str, args: argparse.Namespace) -> str:
    """Reward and mismatch per step, two panels. Returns the backend used."""
    reward = [r["reward"] for r in rows]
    dlogp = [r.get("mismatch/logp_abs_diff_mean", math.nan) for r in rows]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # a bare `pip install -e .`: a plain PNG without axes labels
        from _png_plot import write_line_panels

        write_line_panels(path, [(reward, False), (dlogp, True)])
        return "plain"
    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, reward, marker="o", alpha=0.5, label="per step")
    window = max(1, len(reward) // 10)
    recent = [reward[max(0, i - window + 1) : i + 1] for i in range(len(reward))]
    smooth = [sum(r) / len(r) for r in recent]
    top.plot(steps, smooth, linewidth=2.5, label=f"mean of last {window}")
    top.legend()
    top.set_ylabel("mean reward")
    top.set_title(f"GRPO: {args.train_precision} training, {args.rollout_precision} rollouts, {args.corrector}")
    bottom.plot(steps, dlogp, marker="o", label="mean")
    bottom.plot(steps, [r.get("mismatch/logp_abs_diff_max", math.nan) for r in rows], marker="x", label="max")
    bottom.set_yscale("symlog", linthresh=1e-7)
    bottom.set_ylabel("|logp train - logp rollout|")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
    from jetrl_trainer.tasks import get_task
    from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer, evaluate_reward, warm_start

    preset = dict(PRESETS["fast" if args.fast else "full"])
    if args.warm_start_steps is not None:
        preset["warm_start_steps"] = args.warm_start_steps
    if args.grpo_steps is not None:
        preset["grpo_steps"] = args.grpo_steps
    os.makedirs(args.output_dir, exist_ok=True)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    task = get_task(args.task)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_qwen3(tokenizer)
    print(f"[1/4] warm start: {preset['warm_start_steps']} SFT steps on '{task.name}' answers")
    warm_start(model, tokenizer, task, steps=preset["warm_start_steps"], seed=args.seed)
    eval_set = task.make_dataset(preset["eval_prompts"], seed=10_000 + args.seed)
    n_eval = 4

    def reward_now() -> float:
        return evaluate_reward(model, tokenizer, task, eval_set, num_generations=n_eval, seed=args.seed)

    before = reward_now()
    print(f"[2/4] reward before RL: {before:.3f}")

    steps, per_step = preset["grpo_steps"], preset["prompts_per_step"]
    config = JetGRPOConfig(
        output_dir=args.output_dir,
        train_precision=args.train_precision,
        rollout_precision=args.rollout_precision,
        corrector=args.corrector,
        num_generations=preset["num_generations"],
        per_device_train_batch_size=per_step * preset["num_generations"],
        max_completion_length=task.max_completion_length,
        max_steps=steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = JetGRPOTrainer(
        model,
        task.reward_fn,
        args=config,
        train_dataset=task.make_dataset(steps * per_step, seed=args.seed + 1),
        processing_class=tokenizer,
    )
    for cb in (PrinterCallback, ProgressCallback):  # our bar replaces the per-step dict dumps
        trainer.remove_callback(cb)
    desc = f"GRPO ({args.rollout_precision} rollouts + {args.train_precision} training)"
    metrics = metrics_callback(os.path.join(args.output_dir, "metrics.jsonl"), steps, desc)
    trainer.add_callback(metrics)
    print(
        f"[3/4] GRPO: {steps} steps x {per_step} prompts x {preset['num_generations']} samples, "
        f"train={args.train_precision} rollout={args.rollout_precision} corrector={args.corrector}"
    )
    trainer.train()

    after = reward_now()
    rows = metrics.rows
    dlogp = [r["mismatch/logp_abs_diff_mean"] for r in rows if "mismatch/logp_abs_diff_mean" in r]
    dmax = [r["mismatch/logp_abs_diff_max"] for r in rows if "mismatch/logp_abs_diff_max" in r]
    print(f"[4/4] reward after RL:  {after:.3f}  (before: {before:.3f}, change: {after - before:+.3f})")
    if dlogp:
        print(
            f"      mismatch |logp_train - logp_rollout|: mean {sum(dlogp) / len(dlogp):.2e}, max {max(dmax):.2e} "
            f"over {len(dlogp)} steps; skipped steps: {int(rows[-1].get('jetrl/skipped_steps', 0))}"
        )
    png = os.path.join(args.output_dir, "metrics.png")
    backend = plot(rows, png, args)
    print(f"      wrote {os.path.join(args.output_dir, 'metrics.jsonl')} and {png}")
    if backend == "plain":
        print("      (install matplotlib for a plot with axes and labels)")
    print(f"      total time: {time.perf_counter() - start:.0f}s")
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump({"reward_before": before, "reward_after": after, "seconds": time.perf_counter() - start}, f)
    return 0


if __name__ == "__main__":
    code = main()
    from jetrl_trainer import exit_process  # a gloo (CPU) launch ends without a race at exit

    exit_process(code)
