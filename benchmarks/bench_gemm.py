"""FP8 blockwise GEMM backends vs BF16 cuBLAS at Qwen3-8B shapes, plus decode-shaped GEMMs.

* Forward (prefill/training) GEMMs, M = 8192 tokens: q/k/v/o/gate/up/down. GEMM only (operands
  quantized beforehand). Target (issue 6): ≥ 1.45× BF16.
* The wgrad form (1×128 × 1×128, contraction over tokens) for two shapes.
* Decode-shaped GEMMs, M ∈ {1, 8, 64, 256}, FP8 weights vs BF16 weights, timed as CUDA-graph
  replays (launch gaps removed), with and without the activation quant; reports the crossover. The
  calls cycle through copies of the weight that pass the L2 cache (``_common.cold_copies``), so each
  reads it from DRAM as a decode step does (q_proj's 17 MB FP8 weight would otherwise stay in L2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _common import bench_graph_ms, bench_ms, cold_copies, cycling, dump, environment, tflops
from jetrl_trainer.kernels import act_quant_fp8, available_gemm_backends, fp8_gemm_nt, weight_quant_fp8

QWEN3_8B = {  # name: (N = out_features, K = in_features)
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (12288, 4096),
    "up_proj": (12288, 4096),
    "down_proj": (4096, 12288),
}
M_TRAIN = 8192
DECODE_M = (1, 8, 64, 256)


def _backends() -> list[str]:
    return [b for b in available_gemm_backends("cuda") if b != "emulated"]


def _forward(backends) -> dict:
    rows, totals = [], {"bf16": 0.0, **{b: 0.0 for b in backends}}
    flops_total = 0.0
    for name, (n, k) in QWEN3_8B.items():
        x = torch.randn(M_TRAIN, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xq, wq = act_quant_fp8(x), weight_quant_fp8(w)
        bf16_ms = bench_ms(lambda: F.linear(x, w))
        row = {"gemm": name, "M": M_TRAIN, "N": n, "K": k, "bf16_ms": round(bf16_ms, 4),
               "bf16_TFLOPS": round(tflops(M_TRAIN, n, k, bf16_ms), 1)}
        totals["bf16"] += bf16_ms
        flops_total += 2.0 * M_TRAIN * n * k
        for b in backends:
            ms = bench_ms(lambda: fp8_gemm_nt(xq, wq, backend=b))
            totals[b] += ms
            row[f"{b}_ms"] = round(ms, 4)
            row[f"{b}_TFLOPS"] = round(tflops(M_TRAIN, n, k, ms), 1)
            row[f"{b}_speedup"] = round(bf16_ms / ms, 3)
        rows.append(row)
    summary = {b: {"total_ms": round(t, 3), "TFLOPS": round(flops_total / (t * 1e-3) / 1e12, 1),
                   "speedup_vs_bf16": round(totals["bf16"] / t, 3)} for b, t in totals.items()}
    return {"rows": rows, "all_seven_gemms": summary, "target_speedup": 1.45}


def _wgrad(backends) -> list[dict]:
    rows = []
    for name in ("q_proj", "gate_proj"):
        n, k = QWEN3_8B[name]
        dyt = act_quant_fp8(torch.randn(n, M_TRAIN, device="cuda", dtype=torch.bfloat16))
        xt = act_quant_fp8(torch.randn(k, M_TRAIN, device="cuda", dtype=torch.bfloat16))
        dyt_bf, xt_bf = (torch.randn(n, M_TRAIN, device="cuda", dtype=torch.bfloat16),
                         torch.randn(k, M_TRAIN, device="cuda", dtype=torch.bfloat16))
        bf16_ms = bench_ms(lambda: dyt_bf @ xt_bf.t())
        row = {"gemm": f"wgrad {name}", "N": n, "K": k, "M(contracted)": M_TRAIN, "bf16_ms": round(bf16_ms, 4)}
        for b in backends:
            ms = bench_ms(lambda: fp8_gemm_nt(dyt, xt, b_granularity="group", backend=b))
            row[f"{b}_TFLOPS"] = round(tflops(n, k, M_TRAIN, ms), 1)
            row[f"{b}_speedup"] = round(bf16_ms / ms, 3)
        rows.append(row)
    return rows


def _decode(backends) -> dict:
    rows = []
    for m in DECODE_M:
        for name in ("q_proj", "gate_proj", "down_proj"):
            n, k = QWEN3_8B[name]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            bf16_copies, fp8_copies = cold_copies([w]), cold_copies(weight_quant_fp8(w))
            xq = act_quant_fp8(x)
            bf16_us = bench_graph_ms(cycling(lambda w: F.linear(x, w), bf16_copies)) * 1e3
            row = {"M": m, "gemm": name, "N": n, "K": k, "bf16_us": round(bf16_us, 2),
                   "bf16_weight_GB/s": round(n * k * 2 / (bf16_us * 1e-6) / 1e9, 1)}
            for b in backends:
                gemm_us = bench_graph_ms(cycling(lambda *wq: fp8_gemm_nt(xq, wq, backend=b), fp8_copies)) * 1e3
                full_us = bench_graph_ms(cycling(lambda *wq: fp8_gemm_nt(act_quant_fp8(x), wq, backend=b), fp8_copies)) * 1e3
                row[f"{b}_us"] = round(gemm_us, 2)
                row[f"{b}_with_act_quant_us"] = round(full_us, 2)
                row[f"{b}_speedup"] = round(bf16_us / gemm_us, 3)
                row[f"{b}_speedup_with_act_quant"] = round(bf16_us / full_us, 3)
            rows.append(row)
    crossover = {}
    for b in backends:
        wins = sorted({r["M"] for r in rows if r[f"{b}_speedup_with_act_quant"] > 1.0})
        crossover[b] = {"M_where_fp8_beats_bf16_incl_act_quant": wins}
    return {"rows": rows, "crossover": crossover}


def run() -> dict:
    torch.manual_seed(0)
    backends = _backends()
    return {"environment": environment(), "backends": backends, "forward_M8192": _forward(backends),
            "wgrad": _wgrad(backends), "decode": _decode(backends)}


if __name__ == "__main__":
    dump(run())
