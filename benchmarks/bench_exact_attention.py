"""Decode attention over a long KV cache: the exact kernel against the kernel path's split-KV kernel.

One decode step's attention for one layer of Qwen3-8B's shape (32 query heads, 8 KV heads of 128):
``--rows`` rows, each over ``--lengths`` live positions of its cache slot, with the BF16 cache and the
FP8 one (E4M3 values, one FP32 scale per position and head). Two kernels read the cache in place:

* ``split_kv``: the engine's kernel path (``kernels/triton_decode_attention.py``), its KV split
  planned for this GPU (the rollout outside the exact contract);
* ``exact_fp32``: the exact attention (``kernels/triton_exact_attention.py``) as the exact decode
  launches it (one program per row and KV head walking every key in order; the training forward's
  arithmetic), its products in FP32 FMA (``ExactAttentionSettings(dot="fp32")``);
* ``exact_bf16``: the same with the products on tensor cores (``dot="bf16"``; what the shipped
  ``dot="auto"`` runs for a BF16 model's queries, as here);
* ``exact_bf16_split{N}`` for each ``N`` of ``--splits``: the same with ``split_keys=N``, each row's
  keys in splits of ``N`` positions, one program each, merged in order by a second launch.

Per case: microseconds per call (median), the bytes of live K, V and scales read, and GB/s. The exact
kernel has no split, so with few rows it leaves SMs idle; this measures where that costs.

``--training BxS,...``: one layer's attention in a training micro-batch of ``B`` sequences of ``S``
positions (causal, the first row left-padded by an eighth), BF16: the exact forward (the kernel) and
its backward (torch's fused SDPA backward after recomputing its forward), beside the plain training
forward's attention, SDPA with the padding mask, forward and backward (``plain_fwd_bwd``); and the
exact forward with each ``--splits`` value (``exact_fwd_split{N}``), which the training forward
would run too wherever the decode does.

Usage: ``python benchmarks/bench_exact_attention.py [--rows 8,64] [--lengths 1024,4096,8192,16384]``;
``python benchmarks/bench_exact_attention.py --training 4x800,1x8448``; ``--splits 512,1024`` (or ``""``).
"""

from __future__ import annotations

import argparse

import torch
from _common import bench_ms, dump, environment

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def cache(rows: int, length: int, fp8: bool, seed: int = 0) -> dict:
    """One layer of the engine's slot cache (`KVCache`, its own format) with ``rows`` slots of ``length``
    positions, all live, and one query per row: ``q``, ``k``, ``v`` and, FP8, ``k_scale`` / ``v_scale``."""
    from jetrl_trainer.rollout.engine.kv_cache import KVCache

    kv = KVCache(num_layers=1, num_slots=rows, max_len=length, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                 dtype=torch.bfloat16, device=torch.device("cuda"), fp8=fp8)  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = dict(q=torch.randn(rows, HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16))
    for name in ("k", "v"):
        values, scales = kv.encode(torch.randn(rows, KV_HEADS, length, HEAD_DIM, generator=g, device="cuda",
                                               dtype=torch.bfloat16))  # fmt: skip
        out[name] = getattr(kv, name)[0].copy_(values)
        if scales is not None:
            out[f"{name}_scale"] = getattr(kv, f"{name}_scale")[0].copy_(scales)
    return out


def live_bytes(c: dict) -> int:
    return sum(t.numel() * t.element_size() for name, t in c.items() if name != "q")


def run_case(rows: int, length: int, fp8: bool, splits: tuple[int, ...] = ()) -> dict:
    import dataclasses
    from functools import partial

    from jetrl_trainer.exact.ops import ATTENTION
    from jetrl_trainer.kernels.triton_decode_attention import decode_attention
    from jetrl_trainer.kernels.triton_exact_attention import exact_attention

    c = cache(rows, length, fp8)
    slots = torch.arange(rows, device="cuda")
    lengths = torch.full((rows,), length, device="cuda")
    scale = HEAD_DIM**-0.5
    scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"]) if fp8 else {}
    first, last = torch.zeros(rows, dtype=torch.long, device="cuda"), (lengths - 1)[:, None]
    q4 = c["q"][:, :, None]
    calls = {
        "split_kv": lambda: decode_attention(c["q"], c["k"], c["v"], slots, lengths, scale, **scales),
        **{f"exact_{dot}": partial(exact_attention, q4, c["k"], c["v"], first, last, scale,
                                   dataclasses.replace(ATTENTION, dot=dot), kv_rows=slots, **scales)
           for dot in ("fp32", "bf16")},
        **{f"exact_bf16_split{n}": partial(exact_attention, q4, c["k"], c["v"], first, last, scale,
                                           dataclasses.replace(ATTENTION, dot="bf16", split_keys=n), kv_rows=slots,
                                           **scales)
           for n in splits},
    }  # fmt: skip
    n_bytes = live_bytes(c)
    result = dict(rows=rows, length=length, kv="fp8" if fp8 else "bf16", live_mib=round(n_bytes / 2**20, 1))
    for name, fn in calls.items():
        us = 1e3 * bench_ms(fn)
        result[name] = dict(us=round(us, 1), gb_per_s=round(n_bytes / (us * 1e-6) / 1e9, 1))
    for name in ("exact_fp32", "exact_bf16", *(f"exact_bf16_split{n}" for n in splits)):
        result[f"{name}_over_split_kv"] = round(result[name]["us"] / result["split_kv"]["us"], 2)
    return result


def run_training_case(batch: int, positions: int, splits: tuple[int, ...] = ()) -> dict:
    import dataclasses

    from jetrl_trainer.exact import ops

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, HEADS, positions, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, KV_HEADS, positions, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))  # fmt: skip
    grad = torch.randn_like(q)
    t = torch.arange(positions, device="cuda")
    first = torch.zeros(batch, dtype=torch.long, device="cuda")
    first[0] = positions // 8
    valid = (t[None, None, :] >= first[:, None, None]) & (t[None, None, :] <= t[None, :, None])  # (B, S, T)
    first, last = ops._key_runs(valid)
    scale = HEAD_DIM**-0.5
    settings = ops._attention_settings(q)
    bf16_dot = ops._triton_attention().uses_tensor_cores(settings, q.dtype)
    group = HEADS // KV_HEADS
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def plain_fwd_bwd():
        qd, kd, vd = leaves
        o = torch.nn.functional.scaled_dot_product_attention(
            qd, kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1), attn_mask=valid[:, None], scale=scale)
        torch.autograd.grad(o, leaves, grad)

    calls = {
        "exact_fwd": lambda: ops._triton_attention().exact_attention(q, k, v, first, last, scale, settings),
        "exact_bwd": lambda: ops._fused_backward(q, k, v, first, last, grad, scale, bf16_dot=bf16_dot),
        "plain_fwd_bwd": plain_fwd_bwd,
        **{f"exact_fwd_split{n}": (lambda split=dataclasses.replace(settings, split_keys=n):
                                   ops._triton_attention().exact_attention(q, k, v, first, last, scale, split))
           for n in splits},
    }  # fmt: skip
    result = dict(batch=batch, positions=positions)
    for name, fn in calls.items():
        result[name] = dict(ms=round(bench_ms(fn), 3))
    exact = result["exact_fwd"]["ms"] + result["exact_bwd"]["ms"]
    result["exact_over_plain"] = round(exact / result["plain_fwd_bwd"]["ms"], 2)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,64", help="comma list: rows (sequences) per decode step")
    ap.add_argument("--lengths", default="1024,4096,8192,16384", help="comma list: live positions per row")
    ap.add_argument("--kv", default="bf16,fp8", help="comma list of cache formats: bf16, fp8")
    ap.add_argument("--training", default="", help="comma list of BxS: the training attention instead of decode")
    ap.add_argument("--splits", default="512,1024,2048",
                    help="comma list of ExactAttentionSettings.split_keys to time beside the whole-row kernel")  # fmt: skip
    args = ap.parse_args(argv)
    splits = tuple(int(n) for n in args.splits.split(",") if n)
    result = dict(benchmark="exact_attention", env=environment(), args=vars(args), cases=[])
    if args.training:
        for shape in args.training.split(","):
            case = run_training_case(*map(int, shape.split("x")), splits)
            print(case, flush=True)
            result["cases"].append(case)
            torch.cuda.empty_cache()
        dump(result)
        return result
    for kv in args.kv.split(","):
        for rows in map(int, args.rows.split(",")):
            for length in map(int, args.lengths.split(",")):
                case = run_case(rows, length, kv == "fp8", splits)
                print(case, flush=True)
                result["cases"].append(case)
                torch.cuda.empty_cache()
    dump(result)
    return result


if __name__ == "__main__":
    main()
