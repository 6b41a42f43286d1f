"""Long rollouts on the decode engine: BF16, FP8 linears with the BF16 cache, FP8 linears with the FP8 cache
(on the kernel path, and under the exact contract as the unified flow runs it).

A random Qwen3 of Qwen3-8B's layer shapes (``--layers``), prompts of ``--prompt`` tokens, ``--new`` new
tokens per sequence (8,192; 16,384 at fewer sequences). Every configuration decodes the same
``--sequences`` sequences (0: as many as fit, in one wave) through as many slots as its cache format fits in ``--kv-gib`` (default:
the memory free once the configuration's weights exist, its FP8 weight cache included, less
``--margin-gib`` for activations and graphs, and with ``--card-gib`` less the memory this card has
beyond a card of that size, so an H200 can stand in for an 80 GB H100), a finished sequence's slot refilled by a waiting one, as
``rollout_kv_cache_gib`` runs a rollout. Per configuration: the slots, the largest batch that fits
that budget at 8k and 16k new tokens, tok/s, ms per decode step, peak memory, the KV cache's bytes,
(CUDA) where a decode step's GPU time goes at mid-length, by kernel kind, and the unified mismatch of
the first ``--mismatch-rows`` sequences: their recorded log-probs against the unified flow's training
forward in the rollout's recipe (the exact training forward, through the cache's rounding, for the
exact configurations; the model's plain forward for the others). ``fp8_kv_exact`` decodes
under the exact contract, as the unified flow with the FP8 cache does, and ``bf16_exact`` as the
unified BF16 flow with ``exact_logprobs``; the others run the engine's kernel path.

Usage: ``python benchmarks/bench_long_rollout.py [--new 8192] [--sequences 64] [--configs bf16,fp8_kv,...]``;
``--shape tiny --device cpu --new 64`` is a smoke run on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from _common import QWEN3_8B_SHAPE, dump, environment
from transformers import GenerationConfig

from jetrl_trainer.exact import ExactOps
from jetrl_trainer.quant import PrecisionPhases, quantize_model
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings
from jetrl_trainer.rollout.engine.kv_cache import KVCache, kv_roundtrip
from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

CONFIGS = {  # name -> (phase whose recipe the rollout runs, KV cache dtype, exact decode)
    "bf16": ("train", "auto", False),
    "fp8": ("rollout", "auto", False),
    "fp8_kv": ("rollout", "fp8", False),
    "bf16_exact": ("train", "auto", True),
    # Under the exact contract (the unified flow with the FP8 cache always is): the model's modules under the
    # exact ops, captured on CUDA, not the kernel path the rows above time.
    "fp8_kv_exact": ("rollout", "fp8", True),
}
ATTENTION_KINDS = (("attention", ("decode_attention", "exact_attention")),
                   ("gemm", ("gemm", "matmul", "sm90", "nvjet", "cutlass")), ("quant", ("quant",)))  # fmt: skip


def build(args):
    tokenizer = build_tiny_tokenizer(model_max_length=args.prompt + args.new + 128)
    shape = QWEN3_8B_SHAPE if args.shape == "8b" else {}
    model = build_tiny_qwen3(tokenizer, num_hidden_layers=args.layers, max_position_embeddings=args.prompt + args.new + 128,
                             seed=0, dtype=torch.bfloat16, **shape).to(args.device)  # fmt: skip
    quantize_model(model, train="bf16", rollout="fp8")
    return model.eval()


def slots_that_fit(model, kv_dtype: str, per_sequence: int, budget_bytes: int) -> int:
    c = model.config
    token = KVCache.bytes_per_token(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                                    head_dim=c.head_dim, dtype=torch.bfloat16, fp8=kv_dtype == "fp8")  # fmt: skip
    return budget_bytes // (per_sequence * token)


def attention_share(engine: DecodeEngine, model, slots: int, length: int) -> dict:
    """GPU time of one eager decode step at ``length`` live positions, by kernel kind (CUDA); an exact
    engine's step runs under the exact ops, as its ``generate`` runs it."""
    from _common import kernels_by_kind

    v = engine.view
    cache = KVCache(num_layers=len(v.layers), num_slots=slots, max_len=length + 2, num_kv_heads=v.num_kv_heads,
                    head_dim=v.head_dim, dtype=v.dtype, device=v.device, fp8=engine.kv_fp8)  # fmt: skip
    rows = torch.arange(slots, device=v.device)
    tokens = torch.randint(0, 1000, (slots,), device=v.device)

    def step():
        cache.lengths.fill_(length)
        with ExactOps.entered(engine.settings.exact, kv_roundtrip(engine.kv_cache_dtype)):
            engine.decode_step(cache, rows, tokens)

    kinds = kernels_by_kind(step, 2, ATTENTION_KINDS, top=8)
    attention = kinds["by_kind"].get("attention", {}).get("ms", 0.0)
    return dict(step_gpu_ms=kinds["gpu_ms"], attention_ms=attention, launches=kinds["launches"],
                attention_share=round(attention / kinds["gpu_ms"], 3) if kinds["gpu_ms"] else None,
                by_kind=kinds["by_kind"], top=kinds["top"])  # fmt: skip


def unified_mismatch(model, phase: str, kv_dtype: str, exact: bool, prompts, ids, recorded, rows: int) -> dict:
    """|recorded - training forward| over the completions of the first ``rows`` sequences, one forward
    per sequence (an 8k-token row's FP32 logits over 151,936 tokens take 5 GiB)."""
    from jetrl_trainer.exact import training_logprobs
    from jetrl_trainer.exact.ops import token_logprobs

    device = next(model.parameters()).device
    diffs = []
    for prompt, completion, logps in list(zip(prompts, ids, recorded))[:rows]:
        input_ids = torch.tensor([list(prompt) + list(completion)], device=device)
        mask, width = torch.ones_like(input_ids), len(completion)
        with torch.no_grad(), PrecisionPhases(model).use(phase):
            if exact:
                forward = training_logprobs(model, input_ids, mask, width, temperature=1.0,
                                            kv_roundtrip=kv_roundtrip(kv_dtype))[0]  # fmt: skip
            else:
                logits = model(input_ids=input_ids, attention_mask=mask, logits_to_keep=width + 1).logits[:, :-1]
                forward = token_logprobs(logits.float(), input_ids[:, -width:], 1.0)
                del logits
        diffs.append(forward[0].float().cpu() - torch.tensor(logps, dtype=torch.float32))
    d = torch.cat(diffs).abs()
    return dict(rows=rows, tokens=d.numel(), logp_abs_diff_mean=float(d.mean()), logp_abs_diff_max=float(d.max()),
                bits_equal_share=round(float((d == 0).float().mean()), 6))  # fmt: skip


def free_budget(args) -> int:
    """The KV budget: ``--kv-gib``, else the device's free memory less ``--margin-gib`` (1 GiB on CPU) and,
    with ``--card-gib``, less whatever this card holds beyond a card of that size: the figures for an 80 GB
    H100 (79.1 GiB) can then be taken on an H200 (139.8 GiB)."""
    if args.kv_gib is not None:
        return int(args.kv_gib * 2**30)
    if args.device != "cuda":
        return 2**30
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    beyond = 0 if args.card_gib is None else max(0, total - int(args.card_gib * 2**30))
    return int(free - args.margin_gib * 2**30 - beyond)


def run(name: str, model, args, budget_bytes: int | None = None) -> dict:
    """One configuration. ``budget_bytes`` None: `free_budget`, measured once the configuration's own weights
    exist (the FP8 recipe's weight cache, about half the BF16 weights, is filled by its first call)."""
    phase, kv_dtype, exact = CONFIGS[name]
    per_sequence = args.prompt + args.new
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(100, 150, (args.prompt,), generator=g).tolist() for _ in range(8)]
    config = GenerationConfig(max_new_tokens=args.new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    cuda = args.device == "cuda"
    with torch.no_grad(), PrecisionPhases(model).use(phase):
        engine = DecodeEngine(model, kv_cache_dtype=kv_dtype, settings=EngineSettings(exact=exact))
        if budget_bytes is None:
            engine.generate(distinct[:1], GenerationConfig(max_new_tokens=2, do_sample=False), eos_token_ids=[-1], seed=0)
            budget_bytes = free_budget(args)
        fits = {f"{n // 1024}k": slots_that_fit(model, kv_dtype, args.prompt + n, budget_bytes)
                for n in (8192, 16384)}  # fmt: skip
        fit = slots_that_fit(model, kv_dtype, per_sequence, budget_bytes)
        sequences = args.sequences or fit  # 0: as many as fit, one wave
        prompts = [distinct[i % 8] for i in range(sequences)]
        slots = min(sequences, fit)
        if slots < 1:
            return dict(slots=0, kv_budget_gib=round(budget_bytes / 2**30, 2),
                        note=f"one sequence of {per_sequence} positions does not fit in {budget_bytes / 2**30:.1f} GiB")  # fmt: skip
        warm = GenerationConfig(**{**config.to_dict(), "max_new_tokens": 8})  # compiles and captures outside the timing
        engine.generate(prompts[:slots], warm, eos_token_ids=[-1], seed=0, max_batch_size=slots)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        ids, recorded = engine.generate(prompts, config, eos_token_ids=[-1], seed=1, max_batch_size=slots)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        generated = sum(map(len, ids))
        waves = -(-sequences // slots)
        result = dict(
            kv_cache=kv_dtype, kv_budget_gib=round(budget_bytes / 2**30, 2), slots=slots, largest_batch=fits,
            sequences=sequences, generated_tokens=generated,
            seconds=round(seconds, 2), tok_per_s=round(generated / seconds, 1),
            ms_per_step=round(1e3 * seconds / (waves * args.new), 3),
            peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            kv_cache_gib=round(engine.last_stats["kv_cache_bytes"] / 2**30, 2), decode_path=engine.settings.decode_path,
        )  # fmt: skip
        if cuda:
            result["mid_length_step"] = attention_share(engine, model, slots, args.prompt + args.new // 2)
    del engine
    torch.cuda.empty_cache() if cuda else None
    if args.mismatch_rows:
        result["unified_mismatch"] = unified_mismatch(model, phase, kv_dtype, exact, prompts, ids, recorded,
                                                      args.mismatch_rows)  # fmt: skip
    return result


def ratios_to_bf16(result: dict, names: list[str]) -> dict:
    """Each configuration's tok/s over BF16's from the same run (the targets' ratios), where both decoded."""
    bf16 = result.get("bf16", {}).get("tok_per_s")
    return {f"{name}_over_bf16_tok_per_s": round(result[name]["tok_per_s"] / bf16, 3)
            for name in names if name != "bf16" and bf16 and result[name].get("tok_per_s")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=8192)
    ap.add_argument("--sequences", type=int, default=64,
                    help="sequences every configuration decodes; 0: as many as each configuration's budget fits")
    ap.add_argument("--kv-gib", type=float, default=None, help="KV budget; default: free memory less --margin-gib")
    ap.add_argument("--margin-gib", type=float, default=8.0)
    ap.add_argument("--card-gib", type=float, default=None,
                    help="budget as on a card of this many GiB (79.1: an H100 80GB) where this card is larger")
    ap.add_argument("--mismatch-rows", type=int, default=2, help="sequences whose unified mismatch is measured (0: none)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--shape", default="8b", choices=["8b", "tiny"], help="8b: Qwen3-8B layer shapes; tiny: CPU smoke")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--exact-split-keys", type=int, default=None,
                    help="the exact attention's split_keys for the exact configurations' decode and training forward "
                         "alike (ExactAttentionSettings; default: the shipped one)")  # fmt: skip
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; choose from {', '.join(CONFIGS)}")
    if args.exact_split_keys is not None:  # both phases read this one object at each call
        from jetrl_trainer.exact import ops

        ops.ATTENTION = dataclasses.replace(ops.ATTENTION, split_keys=args.exact_split_keys)
    model = build(args)
    result = dict(benchmark="long_rollout", env=environment(), args=vars(args))
    for name in names:
        result[name] = run(name, model, args)
        print(name, result[name], flush=True)
    result.update(ratios_to_bf16(result, names))
    dump(result)


if __name__ == "__main__":
    main()
