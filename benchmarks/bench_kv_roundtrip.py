"""What the unified FP8 KV cache adds to the training step: the exact training forward and backward of
long sequences, with and without the FP8 cache's roundtrip of every key and value.

In the unified flow with ``rollout_kv_cache_dtype="fp8"`` the training forward reads each key (after
RoPE) and value as the cache stores it (``fp8_kv_roundtrip``, under ``ExactOps``); that quantization
is the only work the FP8 cache adds to training. This times ``exact.training_logprobs`` (the trainer's
exact log-prob forward) over ``--rows`` sequences of ``--prompt`` + ``--completion`` positions, then
the backward of the completion log-probs' sum, once without the roundtrip and once with it, in the
FP8 recipe (``--precision``), on a random Qwen3 of Qwen3-8B's layer shapes (``--layers``). Reports the
median milliseconds of each and the share the roundtrip adds.

Usage: ``python benchmarks/bench_kv_roundtrip.py [--layers 4] [--completion 8192] [--rows 1]
[--gradient-checkpointing]``; ``--shape tiny --device cpu --completion 32`` is a smoke run on CPU. All 36
layers at 8k need ``--gradient-checkpointing`` on an 80 GB card (as a trainer at that length would run):
the roundtrip then also runs in each layer's recompute, as it does in training.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from _common import QWEN3_8B_SHAPE, dump, environment

from jetrl_trainer.exact import ExactOps, training_logprobs
from jetrl_trainer.quant import PrecisionPhases, quantize_model
from jetrl_trainer.rollout.engine.kv_cache import kv_roundtrip
from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer


def build(args):
    positions = args.prompt + args.completion
    tokenizer = build_tiny_tokenizer(model_max_length=positions + 128)
    shape = QWEN3_8B_SHAPE if args.shape == "8b" else {}
    model = build_tiny_qwen3(tokenizer, num_hidden_layers=args.layers, max_position_embeddings=positions + 128,
                             seed=0, dtype=torch.bfloat16, **shape).to(args.device)  # fmt: skip
    if args.precision == "fp8":
        quantize_model(model, train="fp8", rollout="fp8")
    if args.gradient_checkpointing:  # the trainer's setting (TrainingArguments.gradient_checkpointing)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def forward_backward(model, ids, mask, completion: int, roundtrip) -> torch.Tensor:
    """One exact training forward (the completion's log-probs) and the backward of their sum, both under
    the mode as the trainer's ``training_step`` runs them (a checkpointed layer recomputes in the backward)."""
    model.zero_grad(set_to_none=True)
    with ExactOps.entered(True, roundtrip):
        logps, _, _ = training_logprobs(model, ids, mask, completion, temperature=1.0, kv_roundtrip=roundtrip)
        logps.sum().backward()
    return logps.detach()


def timed(fns: dict, iters: int, cuda: bool) -> dict:
    """Median milliseconds of each of ``fns`` over ``iters`` rounds, the configurations alternating
    within a round (clock and allocator state drift alike for both), after one untimed round."""
    samples = {name: [] for name in fns}
    for round_ in range(iters + 1):
        for name, fn in fns.items():
            torch.cuda.synchronize() if cuda else None
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize() if cuda else None
            if round_:
                samples[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(ms) for name, ms in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=1, help="sequences per forward (the trainer's micro-batch)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--precision", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--shape", default="8b", choices=["8b", "tiny"], help="8b: Qwen3-8B layer shapes; tiny: CPU smoke")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute each layer in the backward (the memory a 36-layer 8k step needs)")  # fmt: skip
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    model = build(args)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.rows, args.prompt + args.completion), generator=g).to(args.device)
    mask = torch.ones_like(ids)
    result = dict(benchmark="kv_roundtrip", env=environment(), args=vars(args))
    configs = {"bf16_kv": None, "fp8_kv": kv_roundtrip("fp8")}
    with PrecisionPhases(model).use("train"), torch.autocast(args.device, torch.bfloat16, enabled=cuda):
        logps = {name: forward_backward(model, ids, mask, args.completion, rt) for name, rt in configs.items()}
        torch.cuda.reset_peak_memory_stats() if cuda else None
        fns = {name: partial(forward_backward, model, ids, mask, args.completion, rt) for name, rt in configs.items()}
        for name, ms in timed(fns, args.iters, cuda).items():
            result[name] = dict(ms=round(ms, 2))
            print(name, result[name], flush=True)
    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
    result["roundtrip_added_share"] = round(result["fp8_kv"]["ms"] / result["bf16_kv"]["ms"] - 1, 4)
    # The roundtrip really ran: it moves the log-probs (keys and values rounded to FP8).
    result["logps_moved"] = not torch.equal(logps["bf16_kv"], logps["fp8_kv"])
    dump(result)
    return result


if __name__ == "__main__":
    main()
