"""Compare low-precision GRPO strategies on one task: the papers' comparison, on your model and machine.

    python examples/compare_strategies.py --fast                      # smoke run: 2 strategies, 3 steps
    python examples/compare_strategies.py --task countdown            # every strategy, 3 seeds (CPU, tiny model)
    python examples/compare_strategies.py --task sudoku --stress      # longer completions, weaker warm start, T=1.3
    python examples/compare_strategies.py --model tiny-llada --task countdown --max_completion_length 16
    python examples/compare_strategies.py --model Qwen/Qwen3-0.6B-Base --dtype bfloat16 --warm_start_steps 0
    python examples/compare_strategies.py --gpu --task countdown      # a local 0.3B Qwen3 on CUDA, engine rollouts

Strategies are ``train_precision/rollout_precision[+corrector]``: by default ``bf16/bf16``,
``bf16/fp8`` with no corrector, ``is``, ``tis``, ``mis`` and ``ais``, and ``fp8/fp8`` with none and
``ais`` (``--nvfp4`` adds ``nvfp4/nvfp4`` and ``bf16/nvfp4+ais``). Each runs once per seed, from the
same warm-started weights and on the same prompts in the same order. ``--output_dir`` gets one
``<strategy>/seed<k>/metrics.jsonl`` per run, ``study.md`` (the table) and ``study.png`` (the
plots). Run it again with the same flags to resume: finished runs are skipped.

``--model tiny-<arch>`` builds a tiny model locally (nothing is downloaded) and warm-starts it on
the task; any other value is a checkpoint id or folder, used as it is. Every flag is also a YAML key
(``--config study.yaml``). docs/study.md reports the CPU runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

# torch / transformers / jetrl_trainer are imported in main(), so that `--help` answers at once.

# The full CPU preset fits every strategy x 3 seeds of one task in about 10 minutes on 2 cores
# (docs/study.md). 300 warm-start steps: with fewer, countdown groups mostly earn equal rewards.
FULL = dict(steps=40, prompts_per_step=4, num_generations=8, eval_prompts=64, warm_start_steps=300, seeds="0,1,2",
            sft_examples=1024, temperature=1.0, learning_rate=2e-4, eval_samples=0)  # fmt: skip
FAST = dict(steps=3, prompts_per_step=2, num_generations=4, eval_prompts=16, warm_start_steps=10, seeds="0",
            sft_examples=128, strategies="bf16/fp8+ais,fp8/fp8")  # fmt: skip
# The mismatch grows with the completion length, with the entropy of an undertrained policy, and
# with the temperature: all three at once.
STRESS = dict(max_completion_length=64, warm_start_steps=40, temperature=1.3)
# The GPU preset (issue 14): a ~0.3B Qwen3 built locally (hidden 1024, 24 layers, 16/8 heads of 64,
# the tiny tokenizer), BF16 master weights, SFT warm start on the GPU, a 256-token budget, the decode
# engine for rollouts, two seeds. Every strategy x 2 seeds took about 12 minutes on one H200
# (docs/study.md); at this learning rate 32 steps barely move the reward, so raise --steps to learn.
GPU = dict(model_overrides="hidden_size=1024,intermediate_size=3072,num_hidden_layers=24,num_attention_heads=16,"
           "num_key_value_heads=8,head_dim=64,max_position_embeddings=2048", dtype="bfloat16", device="cuda",
           rollout_backend="engine", max_completion_length=256, steps=32, prompts_per_step=8, num_generations=8,
           warm_start_steps=300, warm_start_lr=3e-4, learning_rate=2e-5, seeds="0,1", checkpoint_every=10)  # fmt: skip
TINY_PREFIX = "tiny-"


@dataclass
class CompareArguments:
    """Options of the strategy study (docs/study.md)."""

    output_dir: str = field(default="runs/study", metadata={"help": "Folder of the runs, study.md and study.png."})
    task: str = field(
        default="countdown",
        metadata={"help": "Built-in task: countdown, sudoku, arithmetic, reverse or chain (long completions, e.g. "
                          "--difficulty max_digits=200 for reverse, min_terms=14,max_terms=18,digits=3 for chain)."},
    )  # fmt: skip
    model: str = field(
        default="tiny-qwen3",
        metadata={"help": "'tiny-<arch>' (a local tiny model, warm-started; arch in jetrl_trainer._choices.TINY_ARCHS) "
                          "or a checkpoint id / folder (used as it is)."},
    )  # fmt: skip
    dtype: str | None = field(default=None, metadata={"help": "Dtype of the model's master weights, e.g. bfloat16 "
                                                              "(preset float32; --gpu bfloat16)."})
    model_overrides: str | None = field(
        default=None,
        metadata={"help": "Tiny models only: config fields as k=v pairs for a larger local model, e.g. "
                          "'hidden_size=1024,num_hidden_layers=24' (--gpu: a ~0.3B Qwen3)."},
    )  # fmt: skip
    device: str | None = field(
        default=None,
        metadata={"help": "Where a tiny model is built and warm-started: 'cpu' (preset) or 'cuda' (--gpu). GRPO runs "
                          "on CUDA whenever it is available."},
    )  # fmt: skip
    rollout_backend: str | None = field(
        default=None, metadata={"help": "JetGRPOConfig.rollout_backend of every run, e.g. 'engine' (unset: 'auto')."}
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute each layer in the backward (transformers' gradient checkpointing): a 0.3B run of "
                          "16 prompts x 8 completions of 266 tokens otherwise holds 57 GiB, so runs side by side on "
                          "an 80 GB GPU need it."},
    )  # fmt: skip
    warm_start_lr: float | None = field(
        default=None, metadata={"help": "Peak learning rate of a tiny model's SFT warm start (preset 3e-3)."}
    )
    strategies: str | None = field(
        default=None,
        metadata={"help": "Comma-separated 'train/rollout[+corrector][@exact|@plain]' names (@exact / @plain pin "
                          "exact log-probs on or off for a unified strategy); unset = every strategy of "
                          "jetrl_trainer._choices.STUDY_STRATEGIES (--gpu: GPU_STUDY_STRATEGIES)."},
    )  # fmt: skip
    nvfp4: bool = field(default=False, metadata={"help": "Add nvfp4/nvfp4 and bf16/nvfp4+ais (emulated, slow)."})
    seeds: str | None = field(default=None, metadata={"help": "Comma-separated seeds (preset: 0,1,2; --fast: 0)."})
    steps: int | None = field(default=None, metadata={"help": "GRPO steps per run (preset: 40; --fast: 3)."})
    prompts_per_step: int | None = field(default=None, metadata={"help": "Prompts per GRPO step (preset: 4)."})
    num_generations: int | None = field(default=None, metadata={"help": "Completions per prompt (preset: 8)."})
    max_completion_length: int | None = field(
        default=None,
        metadata={"help": "Completion budget in tokens; unset = the task's (--gpu: at least 256; --stress: 64)."},
    )
    temperature: float | None = field(default=None, metadata={"help": "Rollout temperature (preset 1.0; --stress 1.3)."})
    learning_rate: float | None = field(default=None, metadata={"help": "GRPO learning rate, AdamW, constant (preset 2e-4)."})
    warm_start_steps: int | None = field(
        default=None, metadata={"help": "SFT steps of a tiny model before GRPO (preset: 300; --stress: 40; --fast: 10)."}
    )
    eval_prompts: int | None = field(default=None, metadata={"help": "Held-out prompts, greedy (preset: 64)."})
    eval_phase: str = field(
        default="train",
        metadata={"help": "Precision of the evaluation: 'train' (the learner) or 'rollout' (the sampler)."},
    )
    eval_samples: int | None = field(
        default=None,
        metadata={"help": "Also score this many completions per held-out prompt sampled at the rollout temperature "
                          "(a nearly greedy warm start can learn to sample its greedy answer more often without "
                          "changing it; preset 0: greedy only)."},
    )  # fmt: skip
    sft_examples: int | None = field(default=None, metadata={"help": "Problems in the warm-start pool (preset 1024)."})
    difficulty: str | None = field(
        default=None, metadata={"help": "The task's difficulty knobs as k=v pairs, e.g. 'holes=8' or 'max_count=4'."}
    )
    diffusion_steps: int | None = field(
        default=None, metadata={"help": "LLaDA only: denoising steps per completion (unset = half its length)."}
    )
    num_threads: int | None = field(
        default=None,
        metadata={"help": "torch CPU threads; 1 is fastest for tiny models on a shared machine (idle threads spin)."},
    )
    fast: bool = field(default=False, metadata={"help": "Smoke run: tiny sizes, 3 steps, 2 strategies, 1 seed."})
    stress: bool = field(
        default=False,
        metadata={"help": "Make the mismatch matter: 64-token completions, a 40-step warm start, temperature 1.3."},
    )
    report_only: bool = field(
        default=False,
        metadata={"help": "Run nothing: write study.md and study.png from the finished runs in --output_dir and list "
                          "the missing ones (e.g. after a GPU session ran out before the last run)."},
    )  # fmt: skip
    start_cache: str | None = field(
        default=None,
        metadata={"help": "A folder for each seed's warm-started model: the first process to need it builds and "
                          "saves it, the others load it, so processes run side by side start from the same bits "
                          "and build it once (a LLaDA warm start on a GPU is not bit-reproducible across processes). "
                          "Tiny models only."},
    )  # fmt: skip
    checkpoint_every: int | None = field(
        default=None,
        metadata={"help": "Save each run's state every this many steps (the newest kept, deleted when the run "
                          "finishes), so that a run cut off after one continues from it when the command runs "
                          "again, to the numbers it would have had (0: none; the GPU preset's: 10)."},
    )  # fmt: skip
    stop_after_seconds: float | None = field(
        default=None,
        metadata={"help": "End this call after about this many seconds: the run in progress saves a checkpoint and "
                          "stops after its current step, no run starts after it, and the table covers the finished "
                          "runs. The same command continues the rest (for a machine lent for a fixed time)."},
    )  # fmt: skip
    gpu: bool = field(
        default=False,
        metadata={"help": "The GPU preset: a local ~0.3B Qwen3 (BF16) warm-started on CUDA, 256-token completions, "
                          "the decode engine, 32 steps, 2 seeds, a checkpoint every 10 steps (docs/study.md, GPU results)."},
    )  # fmt: skip


def parse(argv: list[str] | None = None) -> CompareArguments:
    from trl import TrlParser  # light: torch stays unimported

    (args,) = TrlParser((CompareArguments,)).parse_args_and_config(sys.argv[1:] if argv is None else argv)
    preset = {**FULL, **(GPU if args.gpu else {}), **(FAST if args.fast else {}), **(STRESS if args.stress else {})}
    preset.setdefault("dtype", "float32")
    preset.setdefault("device", "cpu")
    preset.setdefault("warm_start_lr", 3e-3)
    # The GPU preset's budget is room for long answers, not a cap: a task whose answers run longer (chain at
    # its default difficulty: 266 tokens) keeps its own. --stress's 64 stays a cap (that is its point).
    budget_floor = args.max_completion_length is None and args.gpu and not args.stress
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if budget_floor:
        args.max_completion_length = max(args.max_completion_length, _task_budget(args.task, args.difficulty))
    return args


def _task_budget(task: str, difficulty: str | None) -> int:
    from jetrl_trainer.tasks import get_task

    return get_task(task).completion_budget(**_pairs(difficulty))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s.strip())


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _pairs(text: str | None, flag: str = "--difficulty", example: str = "holes=8") -> dict:
    pairs = [p.split("=", 1) for p in (text or "").split(",") if p.strip()]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"{flag} takes k=v pairs separated by commas, e.g. '{example}'; got {text!r}.")
    return {k.strip(): _number(v.strip()) for k, v in pairs}


def build(args: CompareArguments):
    """The `StudySpec` and model builder these arguments describe."""
    from jetrl_trainer._choices import GPU_STUDY_STRATEGIES, STUDY_STRATEGIES, STUDY_STRATEGIES_NVFP4
    from jetrl_trainer.study import PretrainedModel, StudySpec, TinyModel

    default = GPU_STUDY_STRATEGIES if args.gpu else STUDY_STRATEGIES  # the GPU study pins exactness on or off
    strategies = args.strategies.split(",") if args.strategies else list(default)
    strategies += list(STUDY_STRATEGIES_NVFP4) if args.nvfp4 else []
    trainer_kwargs = {} if args.diffusion_steps is None else {"diffusion_steps": args.diffusion_steps}
    if args.rollout_backend is not None:
        trainer_kwargs["rollout_backend"] = args.rollout_backend
    if args.gradient_checkpointing:
        trainer_kwargs["gradient_checkpointing"] = True
    spec = StudySpec(
        task=args.task, strategies=tuple(strategies), seeds=_ints(args.seeds), steps=args.steps,
        prompts_per_step=args.prompts_per_step, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, temperature=args.temperature,
        learning_rate=args.learning_rate, eval_prompts=args.eval_prompts, eval_phase=args.eval_phase,
        eval_samples=args.eval_samples,
        sft_examples=args.sft_examples, difficulty=_pairs(args.difficulty), trainer_kwargs=trainer_kwargs,
    )  # fmt: skip
    if args.device == "cuda" and not args.report_only:  # a report reads files only
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda (or --gpu) needs a CUDA device; add --device cpu to run it here (slowly).")
    if args.model.startswith(TINY_PREFIX):
        overrides = _pairs(args.model_overrides, "--model_overrides", "hidden_size=1024")
        model = TinyModel(args.model.removeprefix(TINY_PREFIX), warm_start_steps=args.warm_start_steps,
                          warm_start_lr=args.warm_start_lr, dtype=args.dtype, device=args.device,
                          config_overrides=tuple(sorted(overrides.items())))  # fmt: skip
    else:
        model = PretrainedModel(args.model, dtype=args.dtype)
    return spec, model


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import time

    import torch

    from jetrl_trainer.study import run_study

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    start = time.perf_counter()
    try:
        spec, model = build(args)
        print(f"study: {spec.task}, {len(spec.strategies)} strategies x {len(spec.seeds)} seeds, {spec.steps} steps "
              f"-> {args.output_dir}")  # fmt: skip
        out = run_study(spec, model, args.output_dir, run=not args.report_only, start_cache=args.start_cache,
                        checkpoint_every=args.checkpoint_every or 0,
                        stop_after_seconds=args.stop_after_seconds)  # fmt: skip
    except ValueError as err:  # bad names, or a folder holding runs of other settings
        raise SystemExit(f"error: {err}") from None
    print(out.table.read_text())
    stopped = f", stopped {len(out.stopped)} (run again to continue)" if out.stopped else ""
    print(f"wrote {out.table} and {out.plot}; ran {len(out.ran)}, skipped {len(out.skipped)} finished{stopped}; "
          f"{time.perf_counter() - start:.0f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
