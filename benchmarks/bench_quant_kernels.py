"""Quant kernels: achieved GB/s against the measured device-to-device copy bandwidth.

Bytes counted: every input read once plus every output written once (the minimum any
implementation must move). Target (issue 6): ≥ 70% of the copy bandwidth. The eager-PyTorch
reference is timed on the same input for comparison.
"""

from __future__ import annotations

import torch

from _common import bench_ms, copy_bandwidth_gbs, dump, environment
from jetrl_trainer.kernels import (
    act_quant_fp8,
    requant_transpose_fp8,
    rmsnorm_quant_fp8,
    swiglu_quant_fp8,
    transpose_fp8_blocks,
    weight_quant_fp8,
)
from jetrl_trainer.quant.fp8 import dequantize_fp8_groups, quantize_fp8_blocks, quantize_fp8_groups
from jetrl_trainer.quant.reference import rmsnorm_reference, swiglu_reference

M, K, K_FF = 16384, 4096, 12288  # 16k tokens of Qwen3-8B: inputs 128-400 MB, well past the 60 MB L2


def _case(name, fast, ref, bytes_moved, copy_gbs):
    ms = bench_ms(fast)
    ref_ms = bench_ms(ref)
    gbs = bytes_moved / (ms * 1e-3) / 1e9
    return {"kernel": name, "ms": round(ms, 4), "GB/s": round(gbs, 1), "fraction_of_copy": round(gbs / copy_gbs, 3),
            "eager_reference_ms": round(ref_ms, 4), "speedup_vs_eager": round(ref_ms / ms, 1)}


def run() -> dict:
    torch.manual_seed(0)
    copy = copy_bandwidth_gbs()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(K_FF, K, device="cuda", dtype=torch.bfloat16) * 0.02
    norm_w = torch.ones(K, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(M // 2, K_FF, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(M // 2, K_FF, device="cuda", dtype=torch.bfloat16)
    xq, xs = act_quant_fp8(x)
    wq, ws = weight_quant_fp8(w)
    s_bytes = M * (K // 128) * 4
    rows = [
        _case("act_quant_fp8 [16384,4096] bf16", lambda: act_quant_fp8(x), lambda: quantize_fp8_groups(x),
              x.numel() * 3 + s_bytes, copy),
        _case("act_quant_fp8 of a transposed view (dY^T)", lambda: act_quant_fp8(x.t()),
              lambda: quantize_fp8_groups(x.t().contiguous()), x.numel() * 3 + s_bytes, copy),
        _case("weight_quant_fp8 [12288,4096] bf16", lambda: weight_quant_fp8(w), lambda: quantize_fp8_blocks(w),
              w.numel() * 3 + ws.numel() * 4, copy),
        _case("requant_transpose_fp8 [16384,4096] fp8", lambda: requant_transpose_fp8(xq, xs),
              lambda: quantize_fp8_groups(dequantize_fp8_groups(xq, xs).t().contiguous()),
              xq.numel() * 2 + 2 * s_bytes, copy),
        _case("transpose_fp8_blocks [12288,4096] fp8", lambda: transpose_fp8_blocks(wq, ws),
              lambda: (wq.t().contiguous(), ws.t().contiguous()), wq.numel() * 2, copy),
        _case("rmsnorm_quant_fp8 [16384,4096] bf16", lambda: rmsnorm_quant_fp8(x, norm_w, 1e-6),
              lambda: quantize_fp8_groups(rmsnorm_reference(x, norm_w, 1e-6)), x.numel() * 5 + s_bytes, copy),
        _case("swiglu_quant_fp8 [8192,12288] bf16", lambda: swiglu_quant_fp8(gate, up),
              lambda: quantize_fp8_groups(swiglu_reference(gate, up)),
              gate.numel() * 7 + gate.shape[0] * (K_FF // 128) * 4, copy),
    ]
    return {"environment": environment(), "copy_GB/s": round(copy, 1), "target_fraction": 0.7, "kernels": rows}


if __name__ == "__main__":
    dump(run())
