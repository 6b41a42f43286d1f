"""Where does the engine's unified-flow mismatch come from? One component at a time.

The unified flow's mismatch is mean |recorded log-prob - FP8 training-phase teacher-forced log-prob|.
The training forward runs transformers' SDPA attention (``is_causal``, no mask on unpadded prompts;
on the H200 with torch 2.11 torch picks cuDNN for it); the engine's prefill is the model's own
forward. This probe measures the mismatch for HF ``generate`` and for the engine: with the decode
kernel's tiles matched to the training forward's backend (the default) or in another order, and,
without graphs, the engine's kernel path as it is or with SDPA for the attention kernel, or its eager
path. ``--attention-backend`` forces one SDPA backend on every
call (the teacher-forced forward, the prefill and ``generate``'s decode).

Several seeds per variant, since the sampled tokens (and so the mean) differ between runs.
Usage: ``python benchmarks/probe_engine_mismatch.py [--layers 36] [--rows 8] [--new 256] [--seeds 3]
[--attention-backend FLASH_ATTENTION] [--only "hf|engine"] [--ragged]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics

import torch
import torch.nn.functional as F
from _common import bench_ms, dump, environment
from torch.nn.attention import SDPBackend, sdpa_kernel
from bench_rollout import build_model, hf_generate, mismatch
from transformers import GenerationConfig

import jetrl_trainer.rollout.engine.attention as engine_attention
from jetrl_trainer.kernels.settings import DecodeAttentionSettings
from jetrl_trainer.quant import PrecisionPhases
from jetrl_trainer.quant.fp8 import quantize_fp8_groups
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings

PROMPT = 128
RAGGED = [256, 200, 131, 100, 77, 40, 250, 129]  # --ragged: pads 0, 56, 125, 156, 179, 216, 6, 127


@contextlib.contextmanager
def unaligned_tiles():
    """The engine as before it lined its attention tiles up with the padded rows: every pad count 0."""
    from jetrl_trainer.rollout.engine.kv_cache import KVCache

    store = KVCache.store_encoded
    KVCache.store_encoded = lambda self, *a, pad=0, **kw: store(self, *a, pad=0, **kw)
    try:
        yield
    finally:
        KVCache.store_encoded = store


def sdpa_decode(q, k_cache, v_cache, lengths, scaling):
    live = int(lengths.max())
    if int(lengths.min()) != live:
        raise ValueError("the probe's unmasked decode needs equal-length rows")
    out = F.scaled_dot_product_attention(q[:, :, None], k_cache[:, :, :live], v_cache[:, :, :live], scale=scaling,
                                         enable_gqa=True)  # fmt: skip
    return out[:, :, 0]


def sdpa_kernel_attention(q, k_cache, v_cache, slots, lengths, scale, **options):
    """A stand-in for the Triton decode kernel in the engine's kernel path (eager, equal-length rows):
    unmasked SDPA over the live prefix, as ``generate`` runs it; with ``quantize_output``, also the
    output's 1x128 FP8 quantization (the reference of the kernel's)."""
    out = sdpa_decode(q, k_cache[slots], v_cache[slots], lengths, scale)
    scale_format = options.get("quantize_output")
    if scale_format is None:
        return out
    return (out, *quantize_fp8_groups(out.reshape(out.shape[0], -1), 128, scale_format=scale_format))


def kernel_us(engine: DecodeEngine, cache: int = 384) -> dict:
    """Microseconds per decode-attention call as ``engine`` launches it (8B shape: 32 / 8 heads of 128), live
    length 2/3 of ``cache`` (caches past 512 positions are split over several programs at small batches)."""
    from jetrl_trainer.kernels.triton_decode_attention import decode_attention

    options = dict(engine.attention_arithmetic, settings=engine.settings.attention)
    out = {}
    for batch in (8, 64, 256):
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch + 1, 8, cache, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        slots = torch.arange(batch, device="cuda")
        lengths = torch.full((batch,), 2 * cache // 3, device="cuda")
        # distinct keys and values: one tensor as both would serve the values from L2 (bench_ms flushes it per call)
        out[f"b{batch}"] = round(1e3 * bench_ms(lambda: decode_attention(q, k, v, slots, lengths, 0.088, **options)), 1)
    return out


@contextlib.contextmanager
def patched_decode(decode, kernel_attention=None):
    """The eager path's decode attention, and the kernel path's attention kernel, replaced."""
    from jetrl_trainer.kernels import triton_decode_attention as kernel_module

    saved, saved_kernel = engine_attention.decode_attention, kernel_module.decode_attention
    engine_attention.decode_attention = decode or saved
    kernel_module.decode_attention = kernel_attention or saved_kernel
    try:
        yield
    finally:
        engine_attention.decode_attention, kernel_module.decode_attention = saved, saved_kernel


def build_engine(model, spec: dict) -> DecodeEngine:
    """The engine a variant names: ``spec["settings"]``, EngineSettings' keywords (``decode_path="kernels"``:
    the kernel path's launches made eagerly, without graphs)."""
    return DecodeEngine(model, settings=EngineSettings(**spec.get("settings", {})))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--attention-backend", default="default",
                    help="an SDPBackend name (e.g. FLASH_ATTENTION) for every SDPA call: the teacher-forced forward, "
                         "the prefill and generate's decode")  # fmt: skip
    ap.add_argument("--only", default="", help="variant names to run, separated by |  (default: all)")
    ap.add_argument("--ragged", action="store_true",
                    help="prompts of 8 lengths from 40 to 256 tokens (left pads 0 to 216 in the training forward), "
                         "and the engine also with its attention tiles not lined up with the padded rows")  # fmt: skip
    args = ap.parse_args()
    model = build_model(args.layers)
    g = torch.Generator().manual_seed(0)
    lengths = RAGGED if args.ragged else [PROMPT]
    ps = [torch.randint(100, 150000, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(args.rows)]
    config = GenerationConfig(max_new_tokens=args.new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              pad_token_id=0, eos_token_id=[-1])  # fmt: skip
    eager = dict(decode_path="kernels")
    variants = {
        "hf": None,
        "engine": dict(),
        "engine, 64-position tiles in flash order": dict(settings=dict(attention_order=SDPBackend.FLASH_ATTENTION)),
        "engine, 128-position tiles oldest first": dict(settings=dict(attention_order=SDPBackend.CUDNN_ATTENTION)),
        # One pass over each row's KV whatever the batch: the order the training forward sums in; differs
        # from "engine" only where the cache passes 512 positions and the batch is small (--new > 384).
        "engine, one KV split": dict(settings=dict(attention=DecodeAttentionSettings(min_tiles_per_split=1 << 20))),
        # Isolation: the kernel path without graphs, one component changed at a time.
        "kernel path eager": dict(settings=eager),
        "kernel path eager, SDPA attention": dict(settings=eager, kernel_attention=sdpa_kernel_attention),
        "engine eager (model's RoPE), SDPA attention": dict(decode=sdpa_decode, settings=dict(decode_path="torch")),
    }
    if args.ragged:
        variants["engine, tiles not lined up with the padded rows"] = dict(unaligned=True)
    if args.only:
        variants = {n: variants[n] for n in args.only.split("|")}
    rows = {}
    backend = contextlib.nullcontext
    if args.attention_backend != "default":
        backend = functools.partial(sdpa_kernel, getattr(SDPBackend, args.attention_backend))
    for name, spec in variants.items():
        try:
            rows[name] = measure(model, ps, config, spec, args, backend)
        except RuntimeError as error:  # e.g. a forced SDPA backend that refuses this call
            rows[name] = dict(error=str(error).splitlines()[0][:300])
        print(name, rows[name], flush=True)
    dump(dict(benchmark="engine_mismatch_probe", env=environment(), layers=args.layers, rows_per_run=args.rows,
              attention_backend=args.attention_backend, new_tokens=args.new, variants=rows))  # fmt: skip


def measure(model, ps, config, spec, args, backend) -> dict:
    """Mean |Δlogp| of one variant over ``args.seeds`` rollouts (and of the first token alone)."""
    values, first = [], []
    for seed in range((spec or {}).get("seeds", args.seeds)):
        with torch.no_grad(), PrecisionPhases(model).rollout(), backend():
            if spec is None:
                torch.manual_seed(seed)
                ids, lps = hf_generate(model, ps, config)
            else:
                aligned = unaligned_tiles() if spec.get("unaligned") else contextlib.nullcontext()
                with patched_decode(spec.get("decode"), spec.get("kernel_attention")), aligned:
                    engine = build_engine(model, spec)
                    ids, lps = engine.generate(ps, config, eos_token_ids=[-1], seed=seed)
        with backend():
            values.append(mismatch(model, ps, ids, lps, rows=args.rows))
            # the first token comes from the prefill logits alone; the rest from decode steps
            first.append(mismatch(model, ps, [r[:1] for r in ids], [r[:1] for r in lps], rows=args.rows))
    row = dict(mean_abs=[round(x, 4) for x in values], mean=round(statistics.mean(values), 4),
               first_token=round(statistics.mean(first), 4))  # fmt: skip
    settings = (spec or {}).get("settings", {})
    if spec is not None and not ({"decode", "kernel_attention", "unaligned"} & spec.keys()) and "decode_path" not in settings:
        row["kernel_us"] = kernel_us(build_engine(model, spec), cache=max(map(len, ps)) + args.new)  # as the engine sizes it
    return row


if __name__ == "__main__":
    main()
