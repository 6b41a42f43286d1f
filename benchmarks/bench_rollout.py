"""Rollout throughput: HF generate (today's hf backend) against the decode engine, BF16 and FP8.

One process, one model: an 8B-shaped random Qwen3 (36 layers, BF16 master weights) converted with
``quantize_model(train="bf16", rollout="fp8")``, so the "train" phase is BF16 and the "rollout"
phase FP8 on the very same Parameters. Prompts of 128 tokens, 8 distinct prompts x G generations
(GRPO's shape), 256 new tokens, no EOS (a random model never stops), plus a variable-length case
where 3 of 4 rows stop at a random step (the engine's ``row_budgets`` hook), once with every row
in a slot from the start and once with refill: 4x as many sequences as slots, so a finished row's
slot takes the next waiting sequence (how a rollout larger than the KV budget runs).

Reported per run: tok/s of generated tokens, ms per decode step, the fraction of the bandwidth
floor (weights + live KV read per step over the measured copy bandwidth), peak memory, and for the
FP8 engine the unified-flow mismatch (recorded log-probs vs the FP8 training-phase forward). The
fixed-length cases also time the engine as training runs it with ``rollout_keep_engine_state``
("engine_kept": the cache and CUDA graphs kept from a rollout before, so no capture in the timing).

The FP8 linears run the split-K decode GEMM with ``DecodeGemmSettings()`` (``kernels/settings.py``), or
the fields ``--decode-gemm`` replaces (``"max_m=256"``: the decode kernel up to 256 rows).

Usage: ``python benchmarks/bench_rollout.py [--layers 36] [--batches 64,256] [--new 256] [--skip-hf]``
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

import torch
from _common import copy_bandwidth_gbs, dump, environment, kernels_by_kind, replaced_settings
from torch.nn.attention import SDPBackend
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from jetrl_trainer.kernels import available_gemm_backends, use_gemm_backend
from jetrl_trainer.kernels.settings import DecodeGemmSettings
from jetrl_trainer.quant import PrecisionPhases, QuantLinear, quantize_model
from jetrl_trainer.quant.recipe import FP8Recipe
from jetrl_trainer.rollout import HFGenerateBackend, left_pad, position_ids_from_mask
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings

PROMPT, DISTINCT = 128, 8


def build_model(layers: int, decode_gemm: DecodeGemmSettings = DecodeGemmSettings()) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=4096, dtype=torch.bfloat16,
    )  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):  # HF's random init, on the GPU
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    quantize_model(model, train="bf16", rollout=FP8Recipe(decode_gemm=decode_gemm))
    return model.eval()


def weight_bytes(model, fp8: bool) -> int:
    """Parameter bytes a decode step reads: every linear (FP8 + its block scales, or BF16), the LM head
    and the norms. Not the embedding table: a step gathers one row per sequence from it."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.weight.numel() * (1 if fp8 else 2) + (m.weight.numel() // (128 * 128) * 4 if fp8 else 0)
        elif isinstance(m, torch.nn.Linear) or "Norm" in type(m).__name__:
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


def kv_bytes_per_token(model) -> int:
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(100, 150000, (PROMPT,), generator=g).tolist() for _ in range(DISTINCT)]
    return [distinct[i % DISTINCT] for i in range(batch)]


def timed(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start, (torch.cuda.max_memory_allocated() - base) / 2**30


def floor_fraction(model, fp8: bool, batch: int, new: int, seconds: float, gbs: float, kv_fp8: bool = False) -> float:
    # per step: all weights once + the live KV of every row (mean live length prompt + new/2)
    d = model.config.head_dim
    kv = kv_bytes_per_token(model) * ((d + 4) / (2 * d) if kv_fp8 else 1.0)  # FP8: 1 byte + a 4-byte scale per head
    per_step = weight_bytes(model, fp8) + batch * (PROMPT + new / 2) * kv
    return (new * per_step / (gbs * 1e9)) / seconds


def hf_generate(model, ps, config) -> tuple[list[list[int]], list[list[float]]]:
    """The ``hf`` backend's rollout: completions and their recorded log-probs."""
    rollout = HFGenerateBackend(pad_token_id=0, eos_token_ids=[-1]).generate(model, ps, config)
    return rollout.completion_ids, rollout.logprobs


def set_train_recipe(model, recipe: str) -> None:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.set_recipes(train=recipe)


def mismatch(model, ps, completions, logprobs, rows: int = 8) -> float:
    """mean |recorded - FP8 training-phase teacher-forced| over the first ``rows`` rows."""
    ps, completions, logprobs = ps[:rows], completions[:rows], logprobs[:rows]
    ids, mask = left_pad(ps, 0)
    comp = torch.tensor(completions)
    full = torch.cat([ids, comp], 1).cuda()
    full_mask = torch.cat([mask, torch.ones_like(comp)], 1).cuda()
    set_train_recipe(model, "fp8")  # the unified flow: train phase FP8 too
    positions = position_ids_from_mask(full_mask)  # live tokens from 0, as the trainer numbers a padded row
    with torch.no_grad(), PrecisionPhases(model).train():
        logits = model(input_ids=full, attention_mask=full_mask, position_ids=positions,
                       logits_to_keep=comp.shape[1] + 1).logits[:, :-1]  # fmt: skip
        lp = torch.log_softmax(logits.float(), -1).gather(-1, comp.cuda()[..., None])[..., 0]
    set_train_recipe(model, "bf16")
    return (lp.cpu() - torch.tensor(logprobs)).abs().mean().item()


# Engine variants for --variants: the shipped engine against other EngineSettings.
VARIANTS = {
    "shipped": dict(settings={}),
    # Decode attention in 64-position tiles, newest first (flash attention's order), whatever the
    # training forward's SDPA backend (oldest first, 128 positions under cuDNN).
    "flash64": dict(settings=dict(attention_order=SDPBackend.FLASH_ATTENTION)),
}
VARIANT = VARIANTS["shipped"]


def new_engine(model, **kwargs) -> DecodeEngine:
    return DecodeEngine(model, settings=EngineSettings(**VARIANT["settings"]), **kwargs)


@contextlib.contextmanager
def engine_variant(name: str):
    global VARIANT
    saved, VARIANT = VARIANT, VARIANTS[name]
    try:
        yield
    finally:
        VARIANT = saved


def warm_up(model, ps, config, batch: int, kv_cache_dtype: str) -> None:
    """Compile every Triton kernel the timed run can reach, outside the timing: rows that stop one
    step apart walk the live batch down through every CUDA-graph bucket (each a new GEMM M)."""
    rows = min(batch, len(ps))
    short = GenerationConfig(**{**config.to_dict(), "max_new_tokens": rows + 1})
    new_engine(model, kv_cache_dtype=kv_cache_dtype).generate(
        ps[:rows], short, eos_token_ids=[-1], seed=0, max_batch_size=batch, row_budgets=[i + 1 for i in range(rows)]
    )


def run_case(
    model, batch: int, new: int, gbs: float, skip_hf: bool, variable: bool, kv_fp8: bool = False, refill: int = 1,
    kept_state: bool = False,
) -> list[dict]:
    """``refill > 1``: ``refill * batch`` sequences through ``batch`` slots (a finished row's slot
    takes the next waiting sequence), as a rollout larger than the KV budget runs. ``kept_state``: the
    engine also times a rollout on the cache and CUDA graphs kept from the rollout before (backend
    "engine_kept"), what training runs with ``rollout_keep_engine_state``."""
    sequences = batch * refill
    ps = prompts(sequences)
    config = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              pad_token_id=0, eos_token_id=[-1])  # fmt: skip
    budgets = None
    if variable:  # 3 of 4 rows stop early, at a uniformly random step
        g = torch.Generator().manual_seed(1)
        budgets = [new if i % 4 == 0 else int(torch.randint(1, new, (1,), generator=g)) for i in range(sequences)]
    generated = sum(budgets) if budgets else sequences * new
    results = []
    with_hf = not (skip_hf or variable or refill > 1)
    runs = [("engine", "bf16"), ("engine", "fp8")] + ([("hf", "bf16"), ("hf", "fp8")] if with_hf else [])
    runs += [("engine_kept", "bf16"), ("engine_kept", "fp8")] if kept_state else []
    runs += [("engine", "fp8", "fp8")] if kv_fp8 else []  # + an FP8 KV cache
    for backend, precision, *kv in runs:
        phase = "rollout" if precision == "fp8" else "train"
        with torch.no_grad(), PrecisionPhases(model).use(phase):
            if backend.startswith("engine"):
                kept = backend == "engine_kept"
                engine = new_engine(model, kv_cache_dtype=kv[0] if kv else "auto", keep_state=kept)
                fn = lambda: engine.generate(ps, config, eos_token_ids=[-1], seed=0, max_batch_size=batch,  # noqa: E731
                                             row_budgets=budgets)  # fmt: skip
                warm_up(model, ps, config, batch, kv[0] if kv else "auto")
                if kept:
                    fn()  # allocates the cache and captures the graphs; the timed rollout reuses them
            else:
                fn = lambda: hf_generate(model, ps, config)  # noqa: E731
            (ids, lps), seconds, peak = timed(fn)
            if backend == "engine_kept":
                engine.release_state()
        row = dict(case=("variable" if variable else "fixed") + (f"_refill{refill}" if refill > 1 else ""),
                   backend=backend, precision=precision, batch=batch, sequences=sequences,
                   kv_cache="fp8" if kv else "model dtype",
                   new_tokens=new, generated_tokens=generated, seconds=round(seconds, 3),
                   tok_per_s=round(generated / seconds, 1), peak_gib=round(peak, 2))  # fmt: skip
        if backend.startswith("engine"):
            row["engine_stats"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in engine.last_stats.items()}
        if not variable and refill == 1:
            row["ms_per_step"] = round(1e3 * seconds / new, 3)
            row["floor_fraction"] = round(floor_fraction(model, precision == "fp8", batch, new, seconds, gbs, bool(kv)), 3)
        if precision == "fp8" and not variable and refill == 1:  # same measure for both backends
            row["unified_mismatch_mean_abs"] = mismatch(model, ps, ids, lps)
        results.append(row)
        print(row, flush=True)
    return results


_KERNEL_KINDS = (  # (kind, substrings of a kernel name), first match wins
    ("splitk_reduce", ("splitk_reduce",)),  # the decode GEMM's second launch (q/k/v when K is split)
    ("decode_gemm", ("fp8_decode_gemm",)),
    ("attention", ("decode_attention",)),
    ("add_norm_quant", ("add_rmsnorm",)),  # residual add (+ split-K sums) + RMSNorm + quant
    ("fp8_quant", ("act_quant", "quant_kernel")),
    ("norm", ("rmsnorm",)),
    ("swiglu", ("swiglu",)),
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "cublas", "xmma", "scaled_mm", "splitK")),
    ("sampling", ("sort", "cumsum", "scan", "topk", "radix")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "copy", "fill", "index", "cat", "where")),
    ("reduce", ("reduce",)),
)


def kernel_breakdown(step, steps: int = 3) -> dict:
    """GPU time and launches per decode step by kernel kind (torch.profiler over eager steps)."""
    return kernels_by_kind(step, steps, _KERNEL_KINDS)


PROFILED = ("bf16", "fp8", "fp8_general")
# Also accepted by --profile: any name with "_flash64" appended: the attention arithmetic of the
# "flash64" variant.


def profile_step(model, batch: int, new: int, precisions: tuple[str, ...] = PROFILED) -> dict:
    """Where a graphed decode step's time goes: replay alone, the sampler alone, the kernels by kind."""
    from jetrl_trainer.rollout.engine.graphs import DecodeGraphs
    from jetrl_trainer.rollout.engine.kv_cache import KVCache
    from jetrl_trainer.rollout.engine.sampling import TokenSampler

    from _common import bench_ms

    out = {}
    config = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    general = "scaled_mm" if "scaled_mm" in available_gemm_backends("cuda") else "triton"
    for name in precisions:
        precision = name.removesuffix("_flash64")
        forced = use_gemm_backend(general) if precision == "fp8_general" else contextlib.nullcontext()
        phase = "train" if precision.startswith("bf16") else "rollout"
        with torch.no_grad(), PrecisionPhases(model).use(phase), forced:
            settings = VARIANTS["flash64" if name.endswith("_flash64") else "shipped"]["settings"]
            engine = DecodeEngine(model, settings=EngineSettings(**settings))
            v = engine.view
            cache = KVCache(num_layers=len(v.layers), num_slots=batch + 1, max_len=PROMPT + new,
                            num_kv_heads=v.num_kv_heads, head_dim=v.head_dim, dtype=v.dtype, device=v.device)
            cache.lengths[:batch] = PROMPT + new // 2  # a mid-rollout live length
            sampler = TokenSampler(config)
            graphs = DecodeGraphs(engine, cache, sampler, max_rows=batch)
            slots = torch.arange(batch, device="cuda")
            tokens = torch.randint(0, 1000, (batch,), device="cuda")
            seeds, steps = torch.zeros_like(tokens), torch.zeros_like(tokens)
            graphs.step(slots, tokens, seeds, steps)  # capture
            bucket = graphs.buckets[batch]
            lengths = cache.lengths.clone()

            def replay():
                cache.lengths.copy_(lengths)
                bucket.graph.replay()

            logits = torch.randn(batch, model.config.vocab_size, device="cuda")

            def eager_step():
                cache.lengths.copy_(lengths)
                sampler.sample(engine.decode_step(cache, slots, tokens), seeds, steps)

            out[name] = dict(
                replay_ms=round(bench_ms(replay), 3),
                sampler_ms=round(bench_ms(lambda: sampler.sample(logits, seeds, steps)), 3),
                kernels=kernel_breakdown(eager_step),
            )
        # One line per engine on stderr, so a run cut short by a time limit keeps what it measured.
        print(f"profiled b{batch} {name}: replay {out[name]['replay_ms']} ms", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile-only", action="store_true", help="only the per-step profile (no throughput runs)")
    ap.add_argument("--profile", default=",".join(PROFILED),
                    help=f"comma list of the engines the step profile covers ({', '.join(PROFILED)}; '' for none): "
                         "fp8_general on the general GEMM path; any of them + '_flash64': with the flash64 "
                         "variant's attention tiles")  # fmt: skip
    ap.add_argument("--kv-only", action="store_true", help="only the fixed-length engine runs, with an FP8 KV cache too")
    ap.add_argument("--refill", type=int, default=4,
                    help="variable-length case with refill: this many times the batch, through batch slots")
    ap.add_argument("--variable-only", action="store_true",
                    help="only the variable-length cases (and their fixed baseline)")
    ap.add_argument("--variants", default="",
                    help=f"comma list of engine variants ({', '.join(VARIANTS)}): only their fixed-length engine "
                         "runs, BF16 and FP8 (with --kv-only, an FP8 KV cache too for 'shipped'), one row set per variant")  # fmt: skip
    ap.add_argument("--decode-gemm", default="",
                    help="the FP8 rollout recipe's decode-GEMM settings: DecodeGemmSettings fields to replace, e.g. "
                         "'max_m=256' (rows up to which FP8 linears take the split-K decode kernel) or "
                         "'waves=1,num_warps=8'")  # fmt: skip
    args = ap.parse_args()
    try:
        settings = replaced_settings(DecodeGemmSettings(), args.decode_gemm)
    except ValueError as exc:
        raise SystemExit(f"--decode-gemm: {exc}") from exc
    profiled = tuple(filter(None, args.profile.split(",")))  # "": no step profile
    gbs = copy_bandwidth_gbs()
    model = build_model(args.layers, settings)
    launch = dict(decode_max_m=settings.max_m, decode_gemm=dataclasses.asdict(settings))
    if args.profile_only:
        profile = {f"b{b}": profile_step(model, b, args.new, profiled) for b in map(int, args.batches.split(","))}
        dump(dict(benchmark="rollout_profile", env=environment(), layers=args.layers, **launch, step_profile=profile))
        return
    if args.variants:
        rows = []
        for name in args.variants.split(","):
            with engine_variant(name):
                for b in map(int, args.batches.split(",")):
                    for row in run_case(model, b, args.new, gbs, True, False, args.kv_only and name == "shipped"):
                        rows.append(dict(variant=name, **row))
        dump(dict(benchmark="rollout_variants", env=environment(), copy_gbs=round(gbs, 1), layers=args.layers, **launch,
                  variants={n: VARIANTS[n] for n in args.variants.split(",")}, rows=rows))  # fmt: skip
        return
    if args.kv_only:
        rows = [r for b in map(int, args.batches.split(",")) for r in run_case(model, b, args.new, gbs, True, False, True)]
        dump(dict(benchmark="rollout_kv_fp8", env=environment(), layers=args.layers, rows=rows))
        return
    first = int(args.batches.split(",")[0])
    if args.variable_only:
        rows = run_case(model, first, args.new, gbs, True, variable=False)
        rows += run_case(model, first, args.new, gbs, True, variable=True)
        rows += run_case(model, first, args.new, gbs, True, variable=True, refill=args.refill)
        dump(dict(benchmark="rollout_variable", env=environment(), layers=args.layers, rows=rows))
        return
    rows = []
    for batch in map(int, args.batches.split(",")):
        rows += run_case(model, batch, args.new, gbs, args.skip_hf, variable=False, kept_state=True)
    rows += run_case(model, first, args.new, gbs, True, variable=True)
    rows += run_case(model, first, args.new, gbs, True, variable=True, refill=args.refill)
    profile = {f"b{b}": profile_step(model, b, args.new, profiled) for b in map(int, args.batches.split(",")) if profiled}
    print("profile", profile, flush=True)
    by = {(r["case"], r["backend"], r["precision"], r["batch"]): r for r in rows}
    summary = {}
    for batch in map(int, args.batches.split(",")):
        e16, e8 = by.get(("fixed", "engine", "bf16", batch)), by.get(("fixed", "engine", "fp8", batch))
        h16 = by.get(("fixed", "hf", "bf16", batch))
        if e16 and e8:
            summary[f"b{batch}_engine_fp8_over_bf16"] = round(e8["tok_per_s"] / e16["tok_per_s"], 3)
        if e16 and h16:
            summary[f"b{batch}_engine_bf16_over_hf_bf16"] = round(e16["tok_per_s"] / h16["tok_per_s"], 2)
        k16, k8 = by.get(("fixed", "engine_kept", "bf16", batch)), by.get(("fixed", "engine_kept", "fp8", batch))
        if k16 and k8:
            summary[f"b{batch}_engine_kept_fp8_over_bf16"] = round(k8["tok_per_s"] / k16["tok_per_s"], 3)
    dump(dict(benchmark="rollout", env=environment(), copy_gbs=round(gbs, 1), layers=args.layers, rows=rows,
              summary=summary, step_profile=profile))  # fmt: skip


if __name__ == "__main__":
    main()
