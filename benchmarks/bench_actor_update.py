"""The actor update of a GRPO step: JetGRPOTrainer's loss forward, backward and AdamW step, BF16 vs FP8.

Issue 16 measures the training half of a step here, with no rollout in the way. One model per
precision, built the same way from the same seed: an 8B-shaped Qwen3 slice (hidden 4096, 32/8 heads
of 128, MLP 12288, vocab 151936; ``--layers`` decoder layers, 12 by default), BF16 master weights,
full fine-tuning. The trainer is built as users build it (``train_precision="bf16"`` or ``"fp8"``,
so ``lm_head`` and the log-softmax stay BF16/FP32 as the recipe keeps them). Each timed iteration is
``trainer.compute_loss`` on one fixed micro-batch (``--rows`` x (prompt + completion) tokens, random
ids and advantages), ``accelerator.backward`` and ``optimizer.step()`` + ``zero_grad``: the same calls
``Trainer.training_step`` makes, minus GRPO's ``_prepare_inputs``, which would generate.

``--captured`` adds a second row per precision built with the trainer's ``compile_policy_forward``
(the decoder layers under ``torch.compile``, not the LM head and log-softmax, which TRL computes);
the untimed warm-up steps include the compile. ``--compile-mode reduce-overhead`` (the trainer's
``compile_mode``) adds CUDA graphs (inductor's default keeps each custom op's host code per call:
the FP8 quant launches too).
``--profile`` adds the GPU time per kernel kind (the gap to the wall time is host time the GPU waited on).

Usage: ``python benchmarks/bench_actor_update.py [--layers 12] [--rows 4] [--prompt 256] [--completion 1792]
[--captured [--captured-only] [--compile-mode reduce-overhead]] [--precisions bf16,fp8] [--profile]``
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch
from _common import QWEN3_8B_SHAPE, TRAINING_KERNEL_KINDS, dump, environment, kernels_by_kind
from datasets import Dataset

from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer


def _reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def build_trainer(precision: str, args, tokenizer, out: str, captured: bool = False) -> JetGRPOTrainer:
    shape = QWEN3_8B_SHAPE if args.shape == "8b" else {}
    model = build_tiny_qwen3(tokenizer, num_hidden_layers=args.layers, max_position_embeddings=4096, seed=0,
                             dtype=torch.bfloat16 if args.device == "cuda" else torch.float32, **shape)  # fmt: skip
    config = JetGRPOConfig(
        output_dir=out, per_device_train_batch_size=args.rows, num_generations=args.rows,
        max_completion_length=args.completion, learning_rate=1e-6, report_to="none", save_strategy="no",
        bf16=args.device == "cuda", use_cpu=args.device == "cpu", gradient_checkpointing=False, disable_tqdm=True,
        train_precision=precision, rollout_precision=precision, seed=0, compile_policy_forward=captured,
        compile_backend=args.compile_backend, compile_mode=args.compile_mode,
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1="}]] * args.rows})
    trainer = JetGRPOTrainer(model.to(args.device), _reward, args=config, train_dataset=prompts,
                             processing_class=tokenizer)  # fmt: skip
    trainer.create_optimizer()
    trainer._follow_optimizer()  # the weight-cache refresh, as the first training_step registers it
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one micro-batch per update here
    return trainer


def micro_batch(args, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    rows, P, C = args.rows, args.prompt, args.completion
    batch = dict(
        prompt_ids=torch.randint(0, vocab, (rows, P), generator=g), prompt_mask=torch.ones(rows, P, dtype=torch.long),
        completion_ids=torch.randint(0, vocab, (rows, C), generator=g),
        completion_mask=torch.ones(rows, C, dtype=torch.long), advantages=torch.randn(rows, generator=g),
        num_items_in_batch=torch.tensor(rows * C),
    )  # fmt: skip
    return {k: v.to(args.device) for k, v in batch.items()}


def measure(precision: str, args, tokenizer, captured: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(precision, args, tokenizer, out, captured)
        model, inputs = trainer.model, micro_batch(args, min(len(tokenizer), trainer.model.config.vocab_size))
        model.train()
        if captured and trainer.policy_scorer.compiled is None:
            raise RuntimeError("compile_policy_forward fell back to eager (its reason is in the log above)")

        def update():
            loss = trainer.compute_loss(model, inputs, num_items_in_batch=inputs["num_items_in_batch"])
            trainer.accelerator.backward(loss)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            return loss

        for _ in range(args.warmup):
            update()
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            loss = update()
            sync()
            times.append(time.perf_counter() - start)
        times.sort()
        row = dict(precision=precision, captured=captured, ms=round(1e3 * times[len(times) // 2], 2),
                   loss=float(loss.detach()), tokens=args.rows * (args.prompt + args.completion))  # fmt: skip
        if args.profile and args.device == "cuda":
            row["kernels"] = kernels_by_kind(update, 2, TRAINING_KERNEL_KINDS, top=30)
        if args.device == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        del trainer, model
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=1792)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--shape", default="8b", choices=["8b", "tiny"], help="8b: Qwen3-8B layer shapes; tiny: CPU smoke")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks that the script runs")
    ap.add_argument("--captured", action="store_true", help="also time the backbone under torch.compile")
    ap.add_argument("--precisions", default="bf16,fp8", help="comma list of the precisions to time (bf16, fp8)")
    ap.add_argument("--profile", action="store_true", help="add GPU time by kernel kind per update (torch.profiler)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --captured")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode for --captured, e.g. reduce-overhead (CUDA graphs: no host time per launch)")
    ap.add_argument("--captured-only", action="store_true", help="with --captured: skip the eager rows")
    args = ap.parse_args()
    tokenizer = build_tiny_tokenizer(model_max_length=4096)
    modes = ((True,) if args.captured_only else (False, True)) if args.captured else (False,)
    rows = []
    for captured in modes:
        for precision in args.precisions.split(","):
            rows.append(measure(precision, args, tokenizer, captured))
            print(rows[-1], flush=True)  # each row as it lands, so a time limit keeps the finished ones
    ms = {(r["precision"], r["captured"]): r["ms"] for r in rows}
    result = dict(benchmark="actor_update", env=environment(), args=vars(args), rows=rows)
    if ("bf16", False) in ms and ("fp8", False) in ms:
        result["fp8_over_bf16"] = round(ms["bf16", False] / ms["fp8", False], 3)
    if args.captured and len(ms) == 4:
        result["captured_fp8_over_bf16"] = round(ms["bf16", True] / ms["fp8", True], 3)
        result["captured_fp8_over_eager_bf16"] = round(ms["bf16", False] / ms["fp8", True], 3)
    dump(result)


if __name__ == "__main__":
    main()
