"""QuantLinear forward + backward (all quantization included) vs BF16 ``nn.Linear``, Qwen3-8B shapes.

M = 8192 tokens. Two FP8 timings per layer:
* ``weight_cached``: the FP8 weight comes from the per-step cache (as for every forward after the
  first in an optimizer step, e.g. the rollout's quantization reused by training);
* ``weight_cached_transposing``: the same with ``cache_transposed_weight = False`` (dgrad transposes
  the FP8 weight in every backward, as before that cache existed), timed in the same run;
* ``weight_requantized``: the cache is invalidated every iteration, so the 128×128 weight quant is
  paid once per fwd+bwd — the cost of one training step per layer;
* ``cuda_graph``: ``weight_requantized`` captured and replayed as one CUDA graph (no launch gaps).

``--refresh`` times only the weight-cache refresh after an optimizer step (FP8 weight and dgrad's
transposed copy, written into the cached tensors) against the way it ran before (fresh tensors
copied over the cached ones), and the re-quantized fwd+bwd both ways, in one run.
WGrad's ``dY.t()`` goes to the act-quant kernel as a strided view (no transposed copy).
Target (issue 6): ≥ 1.4× BF16 (Jet-RL reports 1.54× for the actor update; moonshot ≥ 1.6×).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from _common import bench_graph_ms, bench_ms, dump, environment, profile_kernels
from bench_gemm import M_TRAIN, QWEN3_8B
from jetrl_trainer.quant import QuantLinear, invalidate_weight_caches


def _step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, requantize: bool = False):
    def fn():
        if requantize:
            invalidate_weight_caches(layer)
        layer.weight.grad = None
        x.grad = None
        layer(x).backward(dy)

    return fn


def run() -> dict:
    torch.manual_seed(0)
    rows = []
    totals = {"bf16": 0.0, "fp8_cached": 0.0, "fp8_cached_transposing": 0.0, "fp8_requant": 0.0, "graphed_bf16": 0.0, "graphed_fp8": 0.0}
    for name, (n, k) in QWEN3_8B.items():
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        qlin = QuantLinear.from_linear(lin, {"train": "fp8", "rollout": "fp8"})
        x = torch.randn(M_TRAIN, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M_TRAIN, n, device="cuda", dtype=torch.bfloat16)
        bf16 = bench_ms(_step(lin, x, dy))
        cached = bench_ms(_step(qlin, x, dy))
        qlin.cache_transposed_weight = False
        transposing = bench_ms(_step(qlin, x, dy))
        qlin.cache_transposed_weight = True
        requant = bench_ms(_step(qlin, x, dy, requantize=True))
        graphed_fp8 = bench_graph_ms(_step(qlin, x, dy, requantize=True), calls=3, replays=10)
        graphed_bf16 = bench_graph_ms(_step(lin, x, dy), calls=3, replays=10)
        totals["graphed_bf16"] += graphed_bf16
        totals["graphed_fp8"] += graphed_fp8
        totals["bf16"] += bf16
        totals["fp8_cached"] += cached
        totals["fp8_cached_transposing"] += transposing
        totals["fp8_requant"] += requant
        rows.append({"layer": name, "N": n, "K": k, "bf16_ms": round(bf16, 3), "fp8_weight_cached_ms": round(cached, 3),
                     "fp8_weight_cached_transposing_ms": round(transposing, 3),
                     "fp8_weight_requantized_ms": round(requant, 3), "speedup_cached": round(bf16 / cached, 3),
                     "speedup_requantized": round(bf16 / requant, 3),
                     "cuda_graph_bf16_ms": round(graphed_bf16, 3), "cuda_graph_fp8_ms": round(graphed_fp8, 3),
                     "speedup_cuda_graph": round(graphed_bf16 / graphed_fp8, 3)})
    summary = {"speedup_cached": round(totals["bf16"] / totals["fp8_cached"], 3),
               "speedup_cached_transposing": round(totals["bf16"] / totals["fp8_cached_transposing"], 3),
               "speedup_requantized": round(totals["bf16"] / totals["fp8_requant"], 3),
               "speedup_cuda_graph": round(totals["graphed_bf16"] / totals["graphed_fp8"], 3),
               **{f"{k}_total_ms": round(v, 3) for k, v in totals.items()}}
    return {"environment": environment(), "M": M_TRAIN, "rows": rows, "all_seven_layers": summary,
            "target_speedup": 1.4,
            "kernel_breakdown_us": {name: _breakdown(*QWEN3_8B[name]) for name in ("gate_proj", "k_proj")},
            "cpu_profile_k_proj": _cpu_profile(*QWEN3_8B["k_proj"])}


def _fp8_layer(n: int, k: int):
    """An [n, k] FP8 QuantLinear, its M_TRAIN-token input and output gradient."""
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    qlin = QuantLinear.from_linear(lin, {"train": "fp8", "rollout": "fp8"})
    x = torch.randn(M_TRAIN, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return qlin, x, torch.randn(M_TRAIN, n, device="cuda", dtype=torch.bfloat16)


def _requantized_fp8_step(n: int, k: int):
    """One FP8 fwd+bwd of an [n, k] QuantLinear on M_TRAIN tokens, weight re-quantized every call."""
    return _step(*_fp8_layer(n, k), requantize=True)


def _cpu_profile(n: int, k: int, iters: int = 20) -> list[str]:
    """Host-side cost of an eager FP8 fwd+bwd (the GPU work of k_proj is far smaller)."""
    import cProfile
    import io
    import pstats

    step = _requantized_fp8_step(n, k)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    return [line[:150] for line in buf.getvalue().splitlines() if line.strip()][:30]


def _breakdown(n: int, k: int, iters: int = 5) -> dict:
    """CUDA time per kernel name for one FP8 fwd+bwd (weight re-quantized), from the profiler."""
    times: dict[str, float] = {}
    for evt in profile_kernels(_requantized_fp8_step(n, k), iters, warmup=3):
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if t > 0:
            times[evt.key[:90]] = round(t / iters, 1)
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:14])


@contextlib.contextmanager
def _refresh_by_copy():
    """The refresh as it ran before quantizing into the cache: fresh tensors, then copied over it."""
    import jetrl_trainer.quant.linear as linear

    saved = linear.weight_quant_fp8, linear.transpose_fp8_blocks
    linear.weight_quant_fp8 = lambda w, scale_format="fp32", *, out=None, **launch: saved[0](w, scale_format, **launch)
    linear.transpose_fp8_blocks = lambda q, s, *, out=None, **launch: saved[1](q, s, **launch)
    try:
        yield
    finally:
        linear.weight_quant_fp8, linear.transpose_fp8_blocks = saved


def run_refresh() -> dict:
    from jetrl_trainer.quant.recipe import get_recipe

    recipe, rows = get_recipe("fp8"), []
    for name, (n, k) in QWEN3_8B.items():
        layer, x, dy = _fp8_layer(n, k)
        step = _step(layer, x, dy, requantize=True)
        step()  # fills both caches

        def refresh(layer=layer):
            invalidate_weight_caches(layer)
            layer.transposed_fp8_weight(recipe, layer.quantized_weight(recipe))

        row = {"layer": name, "N": n, "K": k}
        for mode, ctx in (("into_cache", contextlib.nullcontext), ("fresh_then_copy", _refresh_by_copy)):
            with ctx():
                row[f"refresh_{mode}_us"] = round(1000 * bench_ms(refresh), 1)
                row[f"fwd_bwd_requantized_{mode}_ms"] = round(bench_ms(step), 3)
        rows.append(row)
    total = {key: round(sum(r[key] for r in rows), 3) for key in rows[0] if key.endswith(("_us", "_ms"))}
    return {"environment": environment(), "M": M_TRAIN, "rows": rows, "all_seven_layers": total}


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    dump(run_refresh() if "--refresh" in args else run())
