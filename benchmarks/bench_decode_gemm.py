"""Decode-sized linears on Qwen3-8B shapes: BF16 ``F.linear``, the general FP8 path, the decode kernel.

Per shape and M (rows = live sequences at a decode step), in one process:

* ``bf16``: ``F.linear`` (cuBLAS);
* ``fp8_general``: what a rollout-phase ``QuantLinear`` ran before the decode kernel, the Triton
  activation quant then ``fp8_gemm_nt`` (``scaled_mm`` when available);
* ``fp8_decode_prequant``: the decode kernel (``fp8_decode_gemm_nt``, split-K) on an activation already
  quantized (what a fused RMSNorm / SwiGLU producer hands over);
* ``fp8_rollout``: what a rollout-phase ``QuantLinear`` runs now for an unquantized activation
  (``quant._dispatch.decode_linear_fp8``: act quant + the decode kernel; the general path above the
  recipe's ``decode_gemm.max_m``).

Times are CUDA-graph replays of 20 back-to-back calls (launch gaps removed, as inside the engine's
graphs). The calls cycle through copies of the weights that together pass three times the L2 cache
(``_common.cold_copies``), so every call reads its weight from DRAM, as a decode step does.
``--warm`` calls one weight back to back instead: the weights that fit in L2 (q/k/v, q/o, k/v of
the 8B shape in FP8; k/v in BF16) then come from L2 after the first call, so those times are too fast.
``bw_frac`` = (weight bytes + activation in + output out) / time over the measured copy
bandwidth. The decode kernel runs with ``DecodeGemmSettings()`` (``kernels/settings.py``), or the
fields ``--decode-gemm`` replaces; ``--sweep`` times a grid of such settings and prints the best.

Usage: ``python benchmarks/bench_decode_gemm.py [--m 1,16,32,64,128] [--decode-gemm waves=1,num_warps=8] [--sweep]``
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
import torch.nn.functional as F

from _common import bench_graph_ms, cold_copies, copy_bandwidth_gbs, cycling, dump, environment, replaced_settings

from jetrl_trainer.kernels import fp8_gemm_nt
from jetrl_trainer.kernels import triton_decode_gemm as dg
from jetrl_trainer.kernels.settings import DecodeGemmSettings
from jetrl_trainer.quant._dispatch import act_quant_fp8, decode_linear_fp8, weight_quant_fp8
from jetrl_trainer.quant.recipe import FP8Recipe

SHAPES = {  # name: (N, K) of Qwen3-8B (hidden 4096, 32/8 heads of 128, intermediate 12288)
    "q/o": (4096, 4096),
    "k/v": (1024, 4096),
    "gate/up": (12288, 4096),
    "down": (4096, 12288),
}


# The engine's grouped launches (engine/projections.py): q/k/v and gate/up of Qwen3-8B, widths and K.
GROUPED = {"q/k/v": ((4096, 1024, 1024), 4096), "gate/up pair": ((12288, 12288), 4096)}

COLD = True  # weights read from DRAM at every call (cold_copies); --warm: one weight, L2-resident when it fits


def _general(x, w_q, w_s):
    return fp8_gemm_nt(act_quant_fp8(x), (w_q, w_s), b_granularity="block", out_dtype=x.dtype)


def _rollout(x, w_q, w_s, recipe: FP8Recipe):
    """What a rollout-phase QuantLinear runs (no bias, no fused producer)."""
    y = decode_linear_fp8(x, w_q, w_s, None, recipe, x.dtype)
    return y if y is not None else _general(x, w_q, w_s)


def _time_into(row: dict, m: int, n: int, k: int, gbs: float, cases) -> None:
    """``row[name_us]`` and ``row[name_bw_frac]`` for each ``(name, fn, weight bytes)`` (graph replays)."""
    for name, fn, wbytes in cases:
        ms = bench_graph_ms(fn)
        moved = wbytes + 2 * m * k + 2 * m * n
        row[f"{name}_us"] = round(ms * 1e3, 2)
        row[f"{name}_bw_frac"] = round(moved / (ms * 1e-3) / 1e9 / gbs, 3)


def measure(m: int, n: int, k: int, gbs: float, settings: DecodeGemmSettings) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    bf16_copies, fp8_copies = cold_copies([w], COLD), cold_copies(weight_quant_fp8(w), COLD)
    x_q, x_s = act_quant_fp8(x)
    row = dict(m=m, n=n, k=k, weight_copies=len(fp8_copies))
    _time_into(row, m, n, k, gbs, (
        ("bf16", cycling(lambda w: F.linear(x, w), bf16_copies), 2 * n * k),
        ("fp8_general", cycling(lambda w_q, w_s: _general(x, w_q, w_s), fp8_copies), n * k),
        ("fp8_decode_prequant", cycling(lambda w_q, w_s: dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, settings=settings),
                                        fp8_copies), n * k),
        ("fp8_rollout", cycling(lambda w_q, w_s: _rollout(x, w_q, w_s, FP8Recipe(decode_gemm=settings)), fp8_copies),
         n * k),
    ))  # fmt: skip
    row["prequant_over_bf16"] = round(row["bf16_us"] / row["fp8_decode_prequant_us"], 2)
    row["rollout_over_bf16"] = round(row["bf16_us"] / row["fp8_rollout_us"], 2)
    row["rollout_over_general"] = round(row["fp8_general_us"] / row["fp8_rollout_us"], 2)
    return row


def _pairs(flat: tuple) -> tuple:
    """``(w_q0, w_s0, w_q1, w_s1, ...)`` -> ``((w_q0, w_s0), (w_q1, w_s1), ...)``."""
    return tuple(zip(flat[::2], flat[1::2]))


def measure_grouped(m: int, widths: tuple[int, ...], k: int, gbs: float, settings: DecodeGemmSettings) -> dict:
    """One grouped launch against the same projections as BF16 ``F.linear``s and as separate decode calls."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in widths]
    bf16_copies = cold_copies(ws, COLD)
    fp8_copies = [_pairs(c) for c in cold_copies([t for w in ws for t in weight_quant_fp8(w)], COLD)]
    x_q, x_s = act_quant_fp8(x)
    n = sum(widths)
    row = dict(m=m, widths=list(widths), k=k, weight_copies=len(fp8_copies))
    _time_into(row, m, n, k, gbs, (
        ("bf16", cycling(lambda *ws: [F.linear(x, w) for w in ws], bf16_copies), 2 * n * k),
        ("fp8_separate_prequant",
         cycling(lambda *wq: [dg.fp8_decode_gemm_nt(x_q, x_s, *w, settings=settings) for w in wq], fp8_copies), n * k),
        ("fp8_grouped", cycling(lambda *wq: dg.fp8_decode_gemm_grouped(x_q, x_s, list(wq), settings=settings),
                                fp8_copies), n * k),
    ))  # fmt: skip
    row["grouped_over_bf16"] = round(row["bf16_us"] / row["fp8_grouped_us"], 2)
    row["grouped_over_separate"] = round(row["fp8_separate_prequant_us"] / row["fp8_grouped_us"], 2)
    return row


# The fields a sweep varies (the rest keep the base settings') and the values it tries by default.
SWEEP_AXES = dict(block_n=(64, 128), waves=(1, 2, 4), swap_below_m=(16, 128), num_warps=(4,), num_stages=(3, 4),
                  min_groups_per_split=(1, 4))  # swap_below_m 16: never swapped (M tiles have 16 rows or more)
# The grouped launches: always swapped (the shipped choice below 64 rows); split lengths around the shipped 4.
GROUPED_AXES = dict(SWEEP_AXES, swap_below_m=(128,), min_groups_per_split=(2, 4, 8))


def parse_grid(text: str) -> dict[str, tuple[int, ...]]:
    """``"block_n=128,256;num_warps=8"`` -> ``{"block_n": (128, 256), "num_warps": (8,)}``."""
    fields = [f.name for f in dataclasses.fields(DecodeGemmSettings)]
    grid = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, _, values = part.partition("=")
        if key not in fields or not values:
            raise SystemExit(f"--sweep-grid: {part!r} is not FIELD=V1,V2 with FIELD one of {', '.join(fields)}")
        grid[key] = tuple(int(v) for v in values.split(","))
    return grid


def sweep(ms: list[int], gbs: float, base: DecodeGemmSettings, grouped: bool = False,
          grid_override: dict | None = None) -> list[dict]:  # fmt: skip
    """Best decode-kernel settings per (shape, M) over a small grid around ``base`` (prequantized
    activation, as the engine's fused producers hand it over); ``grouped``: the engine's grouped
    q/k/v and gate/up launches and the o / down projections, the launches of a decode step.
    ``grid_override`` replaces the values swept for some fields (the others keep the default grid)."""
    axes = {**(GROUPED_AXES if grouped else SWEEP_AXES), **(grid_override or {})}
    grid = [dataclasses.replace(base, **dict(zip(axes, values))) for values in itertools.product(*axes.values())]
    grid = list(dict.fromkeys([*grid, base]))  # the base settings are always timed
    cases = {name: ((n,), k) for name, (n, k) in SHAPES.items()}
    if grouped:
        cases = {**GROUPED, "q/o": ((4096,), 4096), "down": ((4096,), 12288)}
    best = []
    for (name, (widths, k)), m in itertools.product(cases.items(), ms):
        n = sum(widths)
        x_q, x_s = act_quant_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        flat = [t for w in widths for t in weight_quant_fp8(torch.randn(w, k, device="cuda", dtype=torch.bfloat16) * 0.02)]
        copies = [_pairs(c) for c in cold_copies(flat, COLD)]
        results = []
        for settings in grid:
            if len(widths) > 1:
                call = cycling(lambda *wq, s=settings: dg.fp8_decode_gemm_grouped(x_q, x_s, list(wq), settings=s),
                               copies)  # fmt: skip
            else:
                call = cycling(lambda wq, s=settings: dg.fp8_decode_gemm_nt(x_q, x_s, *wq, settings=s), copies)
            try:
                us = bench_graph_ms(call) * 1e3
            except Exception as exc:  # a launch the GPU cannot run (shared memory): skip it
                results.append((float("inf"), settings, type(exc).__name__))
                continue
            results.append((us, settings, None))
        results.sort(key=lambda r: r[0])
        us, settings, _ = results[0]
        default = next((r[0] for r in results if r[1] == base), float("nan"))
        changed = lambda s: {f: v for f, v in dataclasses.asdict(s).items() if v != getattr(base, f)}  # noqa: E731
        best.append(dict(shape=name, m=m, best_us=round(us, 2), best=changed(settings), default_us=round(default, 2),
                         best_bw_frac=round((n * k + 2 * m * k + 2 * m * n) / (us * 1e-6) / 1e9 / gbs, 3),
                         best_tflops=round(2 * m * n * k / (us * 1e-6) / 1e12, 1),
                         runners_up=[(round(r[0], 2), changed(r[1])) for r in results[1:4]]))  # fmt: skip
        print(best[-1], flush=True)
    return best


def measure_epilogue(m: int, n: int, k: int, warps: tuple[int, ...], settings: DecodeGemmSettings) -> dict:
    """The o / down projection and what follows it in a decode step: the GEMM with its split-K
    reduction, the residual add and the next fused RMSNorm + quant (three launches, or four with the
    reduction), against the GEMM's partial sums reduced inside one add + RMSNorm launch, per warp count."""
    from jetrl_trainer.kernels import triton_norm

    x_q, x_s = act_quant_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    copies = cold_copies(weight_quant_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02), COLD)
    h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(n, device="cuda", dtype=torch.bfloat16)

    def separate(w_q, w_s):
        y = dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, settings=settings)
        return triton_norm.rmsnorm_quant_fp8(h + y, norm_w, 1e-6)

    def partials(w_q, w_s):
        return dg.fp8_decode_gemm_partials(x_q, x_s, w_q, w_s, settings=settings)

    def fused(w_q, w_s, num_warps):
        return triton_norm.add_rmsnorm_quant_fp8(h, partials(w_q, w_s), norm_w, 1e-6, num_warps=num_warps)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    row = dict(m=m, n=n, k=k, splits=dg.plan(m, n, k, sms, settings).splits,
               separate_us=round(bench_graph_ms(cycling(separate, copies)) * 1e3, 2),
               gemm_alone_us=round(bench_graph_ms(cycling(partials, copies)) * 1e3, 2))  # fmt: skip
    for w in warps:  # 0: the shipped warps (by row width)
        call = cycling(lambda w_q, w_s, w=w: fused(w_q, w_s, w or None), copies)
        row[f"fused_warps{w or 'default'}_us"] = round(bench_graph_ms(call) * 1e3, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,32,64,128,256")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--decode-gemm", default="",
                    help="the decode kernel's settings: DecodeGemmSettings fields to replace, e.g. "
                         "'min_groups_per_split=1,max_block_m=128' (the base of --sweep too)")  # fmt: skip
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--sweep-grid", default="",
                    help="with --sweep: values to sweep for some settings fields, e.g. 'block_n=128,256;num_warps=4,8' "
                         "(fields of DecodeGemmSettings)")  # fmt: skip
    ap.add_argument("--sweep-m", default="16,64", help="with --sweep: the M values swept (of those in --m)")
    ap.add_argument("--grouped", action="store_true",
                    help="only the engine's grouped launches (q/k/v, gate/up) against BF16 and separate calls; "
                         "with --sweep, sweep those and the o / down projections")  # fmt: skip
    ap.add_argument("--epilogue", action="store_true",
                    help="only the o / down projections with their epilogue: separate launches against the "
                         "split sums reduced in the fused residual add + RMSNorm, per warp count (--warps)")  # fmt: skip
    ap.add_argument("--warps", default="0,4,16", help="with --epilogue: warp counts (0: the shipped default)")
    ap.add_argument("--warm", action="store_true",
                    help="call one weight back to back (read from L2 where it fits) instead "
                         "of cycling through copies that pass the L2 cache")  # fmt: skip
    args = ap.parse_args()
    try:
        settings = replaced_settings(DecodeGemmSettings(), args.decode_gemm)
    except ValueError as exc:
        raise SystemExit(f"--decode-gemm: {exc}") from exc
    global COLD
    COLD = not args.warm
    if args.epilogue:
        warps = tuple(int(w) for w in args.warps.split(","))
        cases = {"o": (4096, 4096), "down": (4096, 12288)}
        rows = [dict(shape=name, **measure_epilogue(m, n, k, warps, settings))
                for name, (n, k) in cases.items() for m in (int(v) for v in args.m.split(","))]  # fmt: skip
        for row in rows:
            print(row, flush=True)
        dump(dict(benchmark="decode_epilogue", env=environment(), cold=COLD, decode_gemm=dataclasses.asdict(settings),
                  rows=rows))  # fmt: skip
        return
    for name in set(SHAPES) - set(args.shapes.split(",")):
        del SHAPES[name]
    ms = [int(v) for v in args.m.split(",")]
    gbs = copy_bandwidth_gbs()
    rows = []
    if args.grouped:
        for (name, (widths, k)), m in itertools.product(GROUPED.items(), ms):
            rows.append(dict(shape=name, **measure_grouped(m, widths, k, gbs, settings)))
            print(rows[-1], flush=True)
    else:
        for (name, (n, k)), m in itertools.product(SHAPES.items(), ms):
            rows.append(dict(shape=name, **measure(m, n, k, gbs, settings)))
            print(rows[-1], flush=True)
    result = dict(benchmark="decode_gemm", env=environment(), copy_gbs=round(gbs, 1),
                  decode_gemm=dataclasses.asdict(settings), cold=COLD, rows=rows)  # fmt: skip
    if args.sweep:
        sweep_ms = [int(v) for v in args.sweep_m.split(",") if int(v) in ms]
        grid = parse_grid(args.sweep_grid)
        result["sweep"] = sweep(sweep_ms, gbs, settings, grouped=args.grouped, grid_override=grid)
    dump(result)


if __name__ == "__main__":
    main()
