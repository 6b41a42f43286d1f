"""Where does the engine's unified-flow mismatch come from? One attention variant at a time.

The unified flow's mismatch is mean |recorded log-prob - FP8 training-phase teacher-forced log-prob|.
The training forward runs transformers' SDPA attention (``is_causal`` and no mask on unpadded
prompts: the flash kernel); the engine's prefill is the model's own forward, so only its decode
attention can sum in another order. This probe measures the mismatch for HF ``generate`` and for
the engine with its split-KV Triton decode attention in several arithmetic orders, and (eager, no
graphs) with unmasked SDPA over the live prefix, as ``generate`` runs on equal-length rows.

Several seeds per variant, since the sampled tokens (and so the mean) differ between runs.
Usage: ``python benchmarks/probe_engine_mismatch.py [--layers 36] [--rows 8] [--new 256] [--seeds 3]``
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from _common import bench_ms, dump, environment
from bench_rollout import build_model, mismatch
from transformers import GenerationConfig

import jetrl_trainer.rollout.engine.engine as engine_module
from jetrl_trainer.quant import precision_phase
from jetrl_trainer.rollout import generate_with_logprobs
from jetrl_trainer.rollout.engine import DecodeEngine

PROMPT = 128


def sdpa_decode(q, k_cache, v_cache, lengths, scaling):
    live = int(lengths.max())
    if int(lengths.min()) != live:
        raise ValueError("the probe's unmasked decode needs equal-length rows")
    out = F.scaled_dot_product_attention(q[:, :, None], k_cache[:, :, :live], v_cache[:, :, :live], scale=scaling,
                                         enable_gqa=True)  # fmt: skip
    return out[:, :, 0]


def kernel_us(options: dict) -> dict:
    """Microseconds per decode-attention call (8B shape: 32 / 8 heads of 128), live length 256 of 384."""
    from jetrl_trainer.kernels.triton_decode_attention import decode_attention

    out = {}
    for batch in (8, 64, 256):
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch + 1, 8, 384, 128, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(batch, device="cuda")
        lengths = torch.full((batch,), 256, device="cuda")
        out[f"b{batch}"] = round(1e3 * bench_ms(lambda: decode_attention(q, k, k, slots, lengths, 0.088, **options)), 1)
    return out


@contextlib.contextmanager
def patched_decode(decode):
    saved = engine_module.decode_attention
    engine_module.decode_attention = decode or saved
    try:
        yield
    finally:
        engine_module.decode_attention = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    model = build_model(args.layers)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(100, 150000, (PROMPT,), generator=g).tolist() for _ in range(args.rows)]
    config = GenerationConfig(max_new_tokens=args.new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              pad_token_id=0, eos_token_id=[-1])  # fmt: skip
    variants = {
        "hf": None,
        "engine (splits 8, block 32)": dict(),
        "engine splits 1": dict(attention=dict(splits=1)),
        "engine flash order, splits 1, block 64": dict(attention=dict(splits=1, block_n=64, flash_order=True)),
        "engine flash order, splits 1, block 128": dict(attention=dict(splits=1, block_n=128, flash_order=True)),
        "engine flash order, splits 8, block 64": dict(attention=dict(splits=8, block_n=64, flash_order=True)),
        "engine eager, sdpa decode": dict(decode=sdpa_decode, graphs=False, seeds=1),
    }
    rows = {}
    for name, spec in variants.items():
        values, first = [], []
        for seed in range((spec or {}).get("seeds", args.seeds)):
            with torch.no_grad(), precision_phase("rollout"):
                if spec is None:
                    torch.manual_seed(seed)
                    ids, lps = generate_with_logprobs(model, ps, config, pad_token_id=0, eos_token_ids=[-1])
                else:
                    with patched_decode(spec.get("decode")):
                        engine = DecodeEngine(model, cuda_graphs=spec.get("graphs", True))
                        engine.attention_options = spec.get("attention", {})
                        ids, lps = engine.generate(ps, config, eos_token_ids=[-1], seed=seed)
            values.append(mismatch(model, ps, ids, lps, rows=args.rows))
            # the first token comes from the prefill logits alone; the rest from decode steps
            first.append(mismatch(model, ps, [r[:1] for r in ids], [r[:1] for r in lps], rows=args.rows))
        rows[name] = dict(mean_abs=[round(x, 4) for x in values], mean=round(statistics.mean(values), 4),
                          first_token=round(statistics.mean(first), 4))  # fmt: skip
        if spec is not None and "decode" not in spec:
            rows[name]["kernel_us"] = kernel_us(spec.get("attention", {}))
        print(name, rows[name], flush=True)
    dump(dict(benchmark="engine_mismatch_probe", env=environment(), layers=args.layers, rows_per_run=args.rows,
              new_tokens=args.new, variants=rows))  # fmt: skip


if __name__ == "__main__":
    main()
