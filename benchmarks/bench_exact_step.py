"""A GRPO step with exact on-policy log-probs on and off, ``bf16/bf16`` and ``fp8/fp8``, in one process.

The model is a random Qwen3 of Qwen3-8B's layer shapes (hidden 4096, 32/8 heads of 128, MLP 12288,
vocab 151,936; ``--layers`` of them), BF16 master weights, LoRA r=16 on every projection, the
engine rollout backend with its state kept (``rollout_keep_engine_state``), 8 prompts x 8
completions of ``--new`` tokens, micro-batches of 16. Per variant: seconds per step (mean after the
first, which compiles), split into rollout and the rest (training), rollout tokens/s, peak memory,
``mismatch/logp_abs_diff_max`` and the share of equal bits (exact mode: from its checked first step;
the later ones skip the old-log-prob forward, as ``exact_check_every=10`` does; the plain variants
run that forward every step, ``log_mismatch``'s default). Exact mode
decodes with the model's modules under the exact ops (captured in CUDA graphs on CUDA), not the
engine's fused kernels (docs/performance.md says what that costs and why). ``fp8_exact_kv`` is the
unified flow with the FP8 KV cache (exact by contract).

Usage: ``python benchmarks/bench_exact_step.py [--layers 36] [--new 512] [--steps 3] [--variants ...]``;
``--model FOLDER --device cpu`` runs a local checkpoint (SmolLM2-135M-Instruct's cached copy) on CPU.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _common import QWEN3_8B_SHAPE, dump, environment
from datasets import Dataset
from peft import LoraConfig

from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
from jetrl_trainer.study.recorder import RolloutClock, RunRecorder
from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

VARIANTS = {  # name -> (precision, exact_logprobs, rollout_kv_cache_dtype)
    "bf16": ("bf16", False, "auto"),
    "bf16_exact": ("bf16", True, "auto"),
    "fp8": ("fp8", False, "auto"),
    "fp8_exact": ("fp8", True, "auto"),
    "fp8_exact_kv": ("fp8", True, "fp8"),
}
LORA = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip


def _reward(completions, **kwargs) -> list[float]:
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(t.encode()) / (255 * max(1, len(t.encode()))) for t in texts]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def run(variant: str, args, tokenizer) -> dict:
    precision, exact, kv_cache_dtype = VARIANTS[variant]
    if args.model:  # a local checkpoint (e.g. SmolLM2-135M-Instruct's cached BF16 copy), with its tokenizer
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device)
    else:
        shape = QWEN3_8B_SHAPE if args.shape == "8b" else {}
        model = build_tiny_qwen3(tokenizer, num_hidden_layers=args.layers, max_position_embeddings=8192, seed=0,
                                 dtype=torch.bfloat16, **shape).to(args.device)  # fmt: skip
    # Ragged prompts: 8 distinct, of different lengths.
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": "count: " + " ".join(map(str, range(4 * i)))}]
                                            for i in range(1, 9)] * 8})  # fmt: skip
    torch.cuda.reset_peak_memory_stats() if args.device == "cuda" else None
    with tempfile.TemporaryDirectory() as out:
        config = JetGRPOConfig(
            output_dir=out, per_device_train_batch_size=args.micro, gradient_accumulation_steps=64 // args.micro,
            num_generations=8, max_completion_length=args.new, max_steps=args.steps, logging_steps=1,
            learning_rate=1e-6, report_to="none", bf16=args.device == "cuda", use_cpu=args.device == "cpu",
            save_strategy="no", disable_tqdm=True, seed=0, train_precision=precision, rollout_precision=precision,
            rollout_backend="engine", rollout_keep_engine_state=True, exact_logprobs=exact,
            rollout_kv_cache_dtype=kv_cache_dtype,
            gradient_checkpointing=False,
        )  # fmt: skip
        trainer = JetGRPOTrainer(model, _reward, args=config, train_dataset=prompts, processing_class=tokenizer,
                                 peft_config=LORA)  # fmt: skip
        recorder = RunRecorder(RolloutClock(trainer), total=args.steps, desc=variant, progress=False)
        trainer.add_callback(recorder)
        trainer.train()
        logs = [r for r in trainer.state.log_history if "loss" in r]
    rows = recorder.rows[1:] or recorder.rows  # step 1 compiles kernels
    step_s = sum(r["time/step_s"] for r in rows) / len(rows)
    rollout_s = sum(r["time/rollout_s"] for r in rows) / len(rows)
    tokens = sum(r["completions/mean_length"] for r in rows) / len(rows) * 64
    result = dict(
        step_s=round(step_s, 3), rollout_s=round(rollout_s, 3), training_s=round(step_s - rollout_s, 3),
        rollout_tok_per_s=round(tokens / rollout_s, 1),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device == "cuda" else None,
        # exact: from the checked steps (the first of every exact_check_every); plain: every step
        logp_abs_diff_max=max(r["mismatch/logp_abs_diff_max"] for r in logs if "mismatch/logp_abs_diff_max" in r),
        logp_abs_diff_mean=_mean(r["mismatch/logp_abs_diff_mean"] for r in logs if "mismatch/logp_abs_diff_mean" in r),
        bits_equal_share=min(r["mismatch/logp_bits_equal_share"] for r in logs if "mismatch/logp_bits_equal_share" in r),
        clip_region_max=max(r.get("clip_ratio/region_mean", float("nan")) for r in logs),
    )  # fmt: skip
    del trainer, model
    torch.cuda.empty_cache() if args.device == "cuda" else None
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch (64 rows per step)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", default="8b", choices=["8b", "tiny"], help="8b: Qwen3-8B layer shapes; tiny: CPU smoke")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="a local model folder instead of the random 8B-shaped Qwen3")
    ap.add_argument("--variants", default="bf16,bf16_exact,fp8,fp8_exact", help=f"comma list of {', '.join(VARIANTS)}")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        tokenizer = build_tiny_tokenizer(model_max_length=8192)
    result = dict(benchmark="exact_step", env=environment(), args=vars(args))
    for name in names:
        result[name] = run(name, args, tokenizer)
        print(name, result[name], flush=True)
    for precision in ("bf16", "fp8"):
        if precision in result and f"{precision}_exact" in result:
            result[f"{precision}_exact_over_plain_step"] = round(result[f"{precision}_exact"]["step_s"]
                                                                 / result[precision]["step_s"], 3)  # fmt: skip
    dump(result)


if __name__ == "__main__":
    main()
