"""Run every GPU benchmark in one process; write one JSON file and the decode-crossover plot.

Usage (on the GPU machine): ``python benchmarks/run_all.py OUT_DIR [name ...]``; names are the
module suffixes (``quant_kernels gemm quant_linear decoder_layer``), default all. Prints a short
summary table last.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback

ALL = ("probe_scaled_mm", "tune_quant_kernels", "quant_kernels", "gemm", "quant_linear", "decoder_layer")


def _plot_decode(gemm: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = gemm["decode"]["rows"]
    backends = gemm["backends"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, name in zip(axes, ("q_proj", "gate_proj", "down_proj")):
        sel = [r for r in rows if r["gemm"] == name]
        ms = [r["M"] for r in sel]
        for b in backends:
            ax.plot(ms, [r[f"{b}_speedup"] for r in sel], "o-", label=f"{b} (GEMM only)")
            ax.plot(ms, [r[f"{b}_speedup_with_act_quant"] for r in sel], "x--", label=f"{b} + act quant")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name} (N={sel[0]['N']}, K={sel[0]['K']})")
        ax.set_xlabel("M (tokens in the decode step)")
    axes[0].set_ylabel("speedup vs BF16 weights")
    axes[0].legend(fontsize=7)
    fig.suptitle("FP8-weight decode GEMMs vs BF16 (CUDA-graph replay), H200")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _headline(results: dict) -> None:
    """The few numbers the issue's targets are about (full detail is in results.json)."""
    for k, v in results.get("probe_scaled_mm", {}).get("raw_scaled_mm", {}).items():
        print("probe", k, v)
    for k, v in results.get("tune_quant_kernels", {}).items():
        if isinstance(v, dict) and "fraction_of_copy" in v:
            print("tune", k, v["best"], v["fraction_of_copy"])
    r = results.get("quant_kernels", {})
    for k in r.get("kernels", []):
        print(f"quant {k['kernel']:<45} {k['GB/s']:>8} GB/s  {k['fraction_of_copy']:.2f} of copy  x{k['speedup_vs_eager']} vs eager")
    g = results.get("gemm", {})
    for b, v in g.get("forward_M8192", {}).get("all_seven_gemms", {}).items():
        print(f"gemm fwd M=8192 {b:<10} {v['TFLOPS']:>7} TFLOPS  {v['speedup_vs_bf16']}x bf16")
    for row in g.get("wgrad", []):
        print("gemm", {k: v for k, v in row.items() if "speedup" in k or k == "gemm"})
    for row in g.get("decode", {}).get("rows", []):
        print("decode", {k: v for k, v in row.items() if k in ("M", "gemm") or "speedup" in k})
    if "triton_gemm_large" in results.get("tune_quant_kernels", {}):
        print("tune triton gemm", results["tune_quant_kernels"]["triton_gemm_large"])
    q = results.get("quant_linear", {})
    for line in q.get("cpu_profile_k_proj", []):
        print("cpu", line)
    for row in q.get("rows", []):
        print("QuantLinear", {k: v for k, v in row.items() if "speedup" in k or k == "layer"})
    if "all_seven_layers" in q:
        print("QuantLinear fwd+bwd", q["all_seven_layers"])
    d = results.get("decoder_layer", {})
    if "ms" in d:
        print("decoder layer", d["ms"], d["speedup_vs_bf16"], d.get("memory"))
        print("decoder layer graphed", d.get("cuda_graph_ms"), d.get("cuda_graph_speedup_vs_bf16"), "fused:", d.get("fp8_fused_norms"))
    for name, v in results.items():
        if "error" in v:
            print(name, "ERROR", v["error"])


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    names = sys.argv[2:] or ALL
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    results, summary = {}, []
    for name in names:
        t0 = time.time()
        try:
            module = name if name.startswith(("probe_", "tune_")) else f"bench_{name}"
            results[name] = importlib.import_module(module).run()
            status = "ok"
        except Exception as exc:  # keep the other benchmarks' numbers
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            status = "FAILED"
        summary.append((name, status, round(time.time() - t0, 1)))
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    if "gemm" in results and "decode" in results["gemm"]:
        try:
            _plot_decode(results["gemm"], os.path.join(out_dir, "decode_crossover.png"))
        except Exception as exc:
            print("plot failed:", exc)
    _headline(results)
    for row in summary:
        print("%-16s %-7s %6.1fs" % row)


if __name__ == "__main__":
    main()
