"""A GRPO step on the GPU with the ``hf`` rollout backend against the ``engine`` backend.

Same model, data, seeds and config in one process; only ``rollout_backend`` differs. The model is
a random Qwen3 built locally (``jetrl_trainer.tiny``'s tokenizer, so its vocabulary is small),
BF16 master weights, the unified FP8 flow (``train_precision = rollout_precision = "fp8"``). A
random model never emits EOS, so every completion runs to ``max_completion_length``: both backends
generate about the same number of tokens (a tiny vocabulary makes an early EOS likely, so the
rollout tokens/s is reported beside the time). Time in rollout is what ``trainer.rollout_backend.generate``
takes (``jetrl_trainer.study.recorder``); the rest of the step is training (log-probs, loss,
backward, optimizer). Step 1 includes Triton compiles, so the steps after it are what counts.

Usage: ``python benchmarks/bench_grpo_step.py [--layers 24] [--hidden 2048] [--new 256] [--steps 3]``
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _common import dump, environment
from datasets import Dataset

from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
from jetrl_trainer.study.recorder import RolloutClock, RunRecorder
from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer


def length_reward(completions, **kwargs) -> list[float]:
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(t.encode()) / (255 * max(1, len(t.encode()))) for t in texts]


# Backend variants: name -> JetGRPOConfig fields. "engine_kept" keeps the engine's KV cache and CUDA
# graphs between rollouts (rollout_keep_engine_state), so only the first rollout captures.
BACKENDS = {
    "hf": dict(rollout_backend="hf"),
    "engine": dict(rollout_backend="engine"),
    "engine_kept": dict(rollout_backend="engine", rollout_keep_engine_state=True),
}


def run(backend: str, args, tokenizer) -> list[dict]:
    torch.manual_seed(0)
    model = build_tiny_qwen3(
        tokenizer, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128, num_key_value_heads=max(1, args.hidden // 512), head_dim=128,
        max_position_embeddings=2048,
    ).to(args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i} + {3 * i} = ?"}] for i in range(64)]})
    with tempfile.TemporaryDirectory() as out:
        config = JetGRPOConfig(
            output_dir=out, per_device_train_batch_size=args.prompts * args.generations,
            num_generations=args.generations, max_completion_length=args.new, max_steps=args.steps, logging_steps=1,
            learning_rate=1e-6, report_to="none", bf16=args.device == "cuda", use_cpu=args.device == "cpu", save_strategy="no", disable_tqdm=True, seed=0,
            train_precision="fp8", rollout_precision="fp8", gradient_checkpointing=False, **BACKENDS[backend],
        )  # fmt: skip
        trainer = JetGRPOTrainer(model, length_reward, args=config, train_dataset=prompts, processing_class=tokenizer)
        recorder = RunRecorder(RolloutClock(trainer), total=args.steps, desc=backend, progress=False)
        trainer.add_callback(recorder)
        trainer.train()
    keep = ("time/", "step", "completions/mean_length", "rollout/engine_")
    rows = [{k: round(v, 4) for k, v in r.items() if k.startswith(keep)} for r in recorder.rows]
    for row in rows:  # a random model may stop early, and differently per backend: compare tokens/s too
        row["rollout_tok_per_s"] = round(row["completions/mean_length"] * config.per_device_train_batch_size
                                         / row["time/rollout_s"], 1)  # fmt: skip
    del trainer, model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks that the script runs")
    ap.add_argument("--backends", default="hf,engine,engine_kept", help=f"comma list of {', '.join(BACKENDS)}")
    args = ap.parse_args()
    names = args.backends.split(",")
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"unknown --backends {unknown}; choose from {', '.join(BACKENDS)}")
    tokenizer = build_tiny_tokenizer()
    result = dict(benchmark="grpo_step", env=environment(), args=vars(args))
    for backend in names:
        result[backend] = run(backend, args, tokenizer)
        print(backend, result[backend], flush=True)
    later = {b: result[b][1:] or result[b] for b in names}
    mean = {b: sum(r["time/rollout_s"] for r in rows) / len(rows) for b, rows in later.items()}
    result["rollout_s_after_step_1"] = {b: round(v, 3) for b, v in mean.items()}
    tps = {b: sum(r["rollout_tok_per_s"] for r in rows) / len(rows) for b, rows in later.items()}
    for engine in ("engine", "engine_kept"):
        if "hf" in names and engine in names:
            result[f"hf_over_{engine}_rollout_time"] = round(mean["hf"] / mean[engine], 2)
            result[f"{engine}_over_hf_rollout_tok_per_s"] = round(tps[engine] / tps["hf"], 2)
    if "engine" in names and "engine_kept" in names:
        result["engine_over_engine_kept_rollout_time"] = round(mean["engine"] / mean["engine_kept"], 3)
    dump(result)


if __name__ == "__main__":
    main()
