"""Sweep the launch parameters of the Triton quant kernels (``triton_quant.LAUNCH``) on this GPU.

Prints, per kernel, the time of each configuration and the best one; the winners are written
into ``LAUNCH`` by hand. Bandwidth is counted as in bench_quant_kernels.py.
"""

from __future__ import annotations

import torch

from _common import bench_ms, copy_bandwidth_gbs, dump, environment
from jetrl_trainer.kernels import act_quant_fp8, act_quant_fp8_both, requant_transpose_fp8, transpose_fp8_blocks, weight_quant_fp8
from jetrl_trainer.kernels import triton_quant

M, K = 16384, 4096

SWEEP = {
    "act": [(8, 2, 4), (16, 2, 4), (16, 4, 8), (32, 2, 8), (32, 4, 8), (8, 4, 4), (4, 8, 4), (64, 1, 8), (16, 1, 4)],
    "act_t": [(32, 1, 4), (64, 1, 4), (64, 1, 8), (128, 1, 8), (64, 2, 8), (128, 2, 8), (256, 1, 8)],
    "weight": [(4,), (8,), (16,)],
    "requant_t": [(32, 4), (64, 4), (64, 8), (128, 8), (128, 4), (32, 2)],
    "transpose": [(64, 64, 4), (128, 128, 8), (32, 128, 4), (128, 32, 4), (64, 128, 4), (128, 64, 4), (64, 256, 8)],
    "both": [(4,), (8,), (16,)],
}


def run() -> dict:
    torch.manual_seed(0)
    copy = copy_bandwidth_gbs()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3 * K, K, device="cuda", dtype=torch.bfloat16)
    xq = act_quant_fp8(x)
    wq = weight_quant_fp8(w)
    s_bytes = M * K // 128 * 4
    work = {
        "act": (lambda: act_quant_fp8(x), x.numel() * 3 + s_bytes),
        "act_t": (lambda: act_quant_fp8(x.t()), x.numel() * 3 + s_bytes),
        "weight": (lambda: weight_quant_fp8(w), w.numel() * 3),
        "requant_t": (lambda: requant_transpose_fp8(*xq), x.numel() * 2 + 2 * s_bytes),
        "transpose": (lambda: transpose_fp8_blocks(*wq), w.numel() * 2),
        "both": (lambda: act_quant_fp8_both(x), x.numel() * 4 + 2 * s_bytes),
    }
    result = {"environment": environment(), "copy_GB/s": round(copy, 1)}
    for name, configs in SWEEP.items():
        fn, n_bytes = work[name]
        original = triton_quant.LAUNCH[name]
        timings = {}
        for cfg in configs:
            triton_quant.LAUNCH[name] = cfg
            try:
                ms = bench_ms(fn, rep_ms=100)
                timings[str(cfg)] = round(n_bytes / (ms * 1e-3) / 1e9 / copy, 3)
            except Exception as exc:  # a config that does not compile
                timings[str(cfg)] = f"{type(exc).__name__}"
        triton_quant.LAUNCH[name] = original
        numeric = {k: v for k, v in timings.items() if isinstance(v, float)}
        result[name] = {"fraction_of_copy": timings, "best": max(numeric, key=numeric.get) if numeric else None}
    return result


if __name__ == "__main__":
    dump(run())
