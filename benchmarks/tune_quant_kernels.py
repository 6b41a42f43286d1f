"""Sweep the launch parameters of the Triton quant kernels (``triton_quant.LAUNCH``) on this GPU.

Prints, per kernel, the time of each configuration and the best one; the winners are written
into ``LAUNCH`` by hand. Bandwidth is counted as in bench_quant_kernels.py.

Usage: ``python tune_quant_kernels.py [NAME ...]`` (names of ``SWEEP`` and ``gemm``; all by default).
"""

from __future__ import annotations

import sys

import torch

from _common import bench_ms, copy_bandwidth_gbs, dump, environment
from jetrl_trainer.kernels import act_quant_fp8, requant_transpose_fp8, transpose_fp8_blocks, weight_quant_fp8
from jetrl_trainer.kernels import cuda_requant_transpose, fp8_gemm_nt, triton_gemm, triton_quant

M, K = 16384, 4096

SWEEP = {
    "act": [(16, 2, 4), (8, 4, 4), (4, 8, 4), (16, 4, 8), (32, 2, 8), (8, 2, 4)],
    "act_t": [(64, 1, 4), (32, 1, 4), (64, 1, 8), (32, 2, 4), (32, 1, 2)],
    "weight": [(8,), (16,), (32,)],
    "requant_t": [(32, 4, False, False), (32, 4, True, False), (64, 4, True, False), (128, 8, True, False),
                  (32, 2, True, False), (16, 2, False, False), (32, 4, False, True), (64, 4, False, True),
                  (64, 8, False, True), (128, 8, False, True), (32, 2, False, True), (16, 2, False, True)],
    "transpose": [(64, 256, 8), (128, 256, 8), (64, 512, 8), (32, 256, 4), (128, 128, 4)],
}


def run(names: list[str]) -> dict:
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
    }
    result = {"environment": environment(), "copy_GB/s": round(copy, 1)}
    for name, configs in SWEEP.items():
        if names and name not in names:
            continue
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
        if name == "requant_t" and cuda_requant_transpose.kernel(torch.cuda.current_device()) is None:
            timings["cuda"] = "unavailable (NVRTC; the log says why)"
        elif name == "requant_t":  # beside the Triton launches: the hand-written CUDA kernel, same bytes
            triton_quant.REQUANT_TRANSPOSE_CUDA = True
            try:
                timings["cuda"] = round(n_bytes / (bench_ms(fn, rep_ms=100) * 1e-3) / 1e9 / copy, 3)
            finally:
                triton_quant.REQUANT_TRANSPOSE_CUDA = False
        numeric = {k: v for k, v in timings.items() if isinstance(v, float)}
        result[name] = {"fraction_of_copy": timings, "best": max(numeric, key=numeric.get) if numeric else None}
    if not names or "gemm" in names:
        result["triton_gemm_large"] = _tune_gemm()
    return result


GEMM_SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=5),
    dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=16, num_warps=8, num_stages=4),
]


def _tune_gemm() -> dict:
    """TFLOPS of the Triton GEMM at 8192 x 4096 x 4096 for a few tilings."""
    a = act_quant_fp8(torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16))
    b = weight_quant_fp8(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16))
    original, out = dict(triton_gemm.LARGE), {}
    for cfg in GEMM_SWEEP:
        triton_gemm.LARGE.clear()
        triton_gemm.LARGE.update(cfg)
        try:
            ms = bench_ms(lambda: fp8_gemm_nt(a, b, backend="triton"), rep_ms=100)
            out[str(tuple(cfg.values()))] = round(2 * 8192 * 4096 * 4096 / (ms * 1e-3) / 1e12, 1)
        except Exception as exc:
            out[str(tuple(cfg.values()))] = type(exc).__name__
    triton_gemm.LARGE.clear()
    triton_gemm.LARGE.update(original)
    numeric = {k: v for k, v in out.items() if isinstance(v, float)}
    return {"TFLOPS": out, "best": max(numeric, key=numeric.get) if numeric else None}


if __name__ == "__main__":
    unknown = set(sys.argv[1:]) - set(SWEEP) - {"gemm"}
    if unknown:
        raise SystemExit(f"unknown sweep {sorted(unknown)}; choose from {sorted(SWEEP)} and gemm")
    dump(run(sys.argv[1:]))
