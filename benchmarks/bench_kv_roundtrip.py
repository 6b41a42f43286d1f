"""What the unified FP8 KV cache adds to the training step: the exact training forward and backward of
long sequences, with and without the FP8 cache's roundtrip of every key and value.

In the unified flow with ``rollout_kv_cache_dtype="fp8"`` the training forward reads each key (after
RoPE) and value as the cache stores it (``fp8_kv_roundtrip``, under ``ExactOps``); that quantization
is the only work the FP8 cache adds to training. This times ``exact.training_logprobs`` (the trainer's
exact log-prob forward) over ``--rows`` sequences of ``--prompt`` + ``--completion`` positions, then
the backward of the completion log-probs' sum, once without the roundtrip and once with it, in the
FP8 recipe (``--precision``), on a random Qwen3 of Qwen3-8B's layer shapes (``--layers``). Reports the
median milliseconds of each and the share the roundtrip adds.

Usage: ``python benchmarks/bench_kv_roundtrip.py [--layers 4] [--completion 8192] [--rows 1]``;
``--shape tiny --device cpu --completion 32`` is a smoke run on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import QWEN3_8B_SHAPE, dump, environment

from jetrl_trainer.exact import training_logprobs
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
    return model.train()


def forward_backward(model, ids, mask, completion: int, roundtrip) -> torch.Tensor:
    """One exact training forward (the completion's log-probs) and the backward of their sum."""
    model.zero_grad(set_to_none=True)
    logps, _, _ = training_logprobs(model, ids, mask, completion, temperature=1.0, kv_roundtrip=roundtrip)
    logps.sum().backward()
    return logps.detach()


def timed(fn, iters: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls after one untimed call (compiles kernels)."""
    fn()
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize() if cuda else None
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize() if cuda else None
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)


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
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    model = build(args)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.rows, args.prompt + args.completion), generator=g).to(args.device)
    mask = torch.ones_like(ids)
    result = dict(benchmark="kv_roundtrip", env=environment(), args=vars(args))
    logps = {}
    with PrecisionPhases(model).use("train"), torch.autocast(args.device, torch.bfloat16, enabled=cuda):
        for name, roundtrip in (("bf16_kv", None), ("fp8_kv", kv_roundtrip("fp8"))):
            logps[name] = forward_backward(model, ids, mask, args.completion, roundtrip)
            torch.cuda.reset_peak_memory_stats() if cuda else None
            ms = timed(lambda: forward_backward(model, ids, mask, args.completion, roundtrip), args.iters, cuda)
            peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
            result[name] = dict(ms=round(ms, 2), peak_gib=peak)
            print(name, result[name], flush=True)
    result["roundtrip_added_share"] = round(result["fp8_kv"]["ms"] / result["bf16_kv"]["ms"] - 1, 4)
    # The roundtrip really ran: it moves the log-probs (keys and values rounded to FP8).
    result["logps_moved"] = not torch.equal(logps["bf16_kv"], logps["fp8_kv"])
    dump(result)
    return result


if __name__ == "__main__":
    main()
