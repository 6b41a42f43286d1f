"""Sweep the launch settings of the Triton quant kernels (``QuantKernelSettings``) on this GPU.

Each variant is a ``QuantKernelSettings`` built from the defaults with one entry replaced
(``dataclasses.replace``) and passed to the kernels; nothing global is changed. Prints, per entry,
each value's fraction of the copy bandwidth and the best one, then the winners together as a
``QuantKernelSettings(...)`` expression for the defaults in ``kernels/settings.py``. Bandwidth is
counted as in bench_quant_kernels.py. ``gemm`` times the Triton GEMM backend's tiles above 64 rows
the same way: each a ``TritonGemmSettings`` passed to ``triton_fp8_gemm_nt``.

Usage: ``python tune_quant_kernels.py [NAME ...]`` (names of ``SWEEP`` and ``gemm``; all by default).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from _common import bench_ms, copy_bandwidth_gbs, dump, environment
from jetrl_trainer.kernels import act_quant_fp8, requant_transpose_fp8, transpose_fp8_blocks, weight_quant_fp8
from jetrl_trainer.kernels.settings import QuantKernelSettings, TritonGemmSettings

M, K = 16384, 4096

SWEEP = {  # name: (the QuantKernelSettings fields it sets, the values tried)
    "act": (("act",), [(16, 2, 4), (8, 4, 4), (4, 8, 4), (16, 4, 8), (32, 2, 8), (8, 2, 4)]),
    "act_transposed": (("act_transposed",), [(64, 1, 4), (32, 1, 4), (64, 1, 8), (32, 2, 4), (32, 1, 2)]),
    "weight": (("weight_warps",), [8, 16, 32]),
    "requant": (("requant_block_k", "requant_warps"), [(32, 4), (64, 4), (64, 8), (128, 8), (32, 2), (16, 2)]),
    "transpose": (("transpose",), [(64, 256, 8), (128, 256, 8), (64, 512, 8), (32, 256, 4), (128, 128, 4)]),
}


def variant(base: QuantKernelSettings, name: str, value) -> QuantKernelSettings:
    """``base`` with sweep ``name``'s fields set to ``value``."""
    fields = SWEEP[name][0]
    return dataclasses.replace(base, **(dict(zip(fields, value)) if len(fields) > 1 else {fields[0]: value}))


def run(names: list[str] | tuple[str, ...] = ()) -> dict:
    torch.manual_seed(0)
    copy = copy_bandwidth_gbs()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3 * K, K, device="cuda", dtype=torch.bfloat16)
    xq = act_quant_fp8(x)
    wq = weight_quant_fp8(w)
    s_bytes = M * K // 128 * 4
    work = {  # name: (one call with the given settings, bytes it moves)
        "act": (lambda s: act_quant_fp8(x, settings=s), x.numel() * 3 + s_bytes),
        "act_transposed": (lambda s: act_quant_fp8(x.t(), settings=s), x.numel() * 3 + s_bytes),
        "weight": (lambda s: weight_quant_fp8(w, settings=s), w.numel() * 3),
        "requant": (lambda s: requant_transpose_fp8(*xq, settings=s), x.numel() * 2 + 2 * s_bytes),
        "transpose": (lambda s: transpose_fp8_blocks(*wq, settings=s), w.numel() * 2),
    }
    default = QuantKernelSettings()
    best = default
    result = {"environment": environment(), "copy_GB/s": round(copy, 1)}
    for name, (_, values) in SWEEP.items():
        if names and name not in names:
            continue
        fn, n_bytes = work[name]
        timings = {}
        for value in values:
            settings = variant(default, name, value)
            try:
                ms = bench_ms(lambda: fn(settings), rep_ms=100)
                timings[str(value)] = round(n_bytes / (ms * 1e-3) / 1e9 / copy, 3)
            except Exception as exc:  # a launch that does not compile
                timings[str(value)] = f"{type(exc).__name__}"
        numeric = {k: v for k, v in timings.items() if isinstance(v, float)}
        winner = max(numeric, key=numeric.get) if numeric else None
        result[name] = {"fraction_of_copy": timings, "best": winner}
        if winner is not None:
            best = variant(best, name, values[list(timings).index(winner)])
    result["settings"] = repr(best)  # each entry's winner, the rest the defaults
    print(f"kernels/settings.py defaults: {best!r}", file=sys.stderr)
    if not names or "gemm" in names:
        result["triton_gemm_large"] = _tune_gemm()
    return result


GEMM_SWEEP = [  # (block_m, block_n, group_m, num_warps, num_stages); the first is the default
    (128, 128, 8, 8, 4),
    (128, 256, 8, 8, 3),
    (256, 128, 8, 8, 3),
    (128, 128, 8, 4, 5),
    (64, 256, 8, 4, 4),
    (128, 256, 16, 8, 4),
]


def _tune_gemm() -> dict:
    """TFLOPS of the Triton GEMM at 8192 x 4096 x 4096 for a few tilings."""
    from jetrl_trainer.kernels.triton_gemm import triton_fp8_gemm_nt

    a = act_quant_fp8(torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16))
    b = weight_quant_fp8(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16))
    out = {}
    for tiles in GEMM_SWEEP:
        settings = TritonGemmSettings(*tiles)
        try:
            ms = bench_ms(lambda: triton_fp8_gemm_nt(*a, *b, "block", torch.bfloat16, settings=settings), rep_ms=100)
            out[repr(settings)] = round(2 * 8192 * 4096 * 4096 / (ms * 1e-3) / 1e12, 1)
        except Exception as exc:  # a tiling that does not compile or fit
            out[repr(settings)] = type(exc).__name__
    numeric = {k: v for k, v in out.items() if isinstance(v, float)}
    return {"TFLOPS": out, "best": max(numeric, key=numeric.get) if numeric else None}


if __name__ == "__main__":
    unknown = set(sys.argv[1:]) - set(SWEEP) - {"gemm"}
    if unknown:
        raise SystemExit(f"unknown sweep {sorted(unknown)}; choose from {sorted(SWEEP)} and gemm")
    dump(run(sys.argv[1:]))
