"""The exact mode's batch-invariant matmul against cuBLAS at Qwen3-8B's linear shapes.

Every GEMM of the exact decode and the exact training forward on CUDA is
`kernels/triton_invariant_matmul.py` (BF16 operands here). Per shape (q, k/v, o, gate/up, down, LM
head) and row count (``--rows``: 64, a decode step of 64 sequences; 12288, a training micro-batch of
16 sequences of 768 positions), microseconds per call (median) for cuBLAS (``torch.matmul``), the
shipped ``InvariantMatmulSettings`` as the exact ops launch it (its K chunks spread over programs
where the tiles alone leave SMs idle; the wide tile from ``wide_from_rows`` rows; ``wide_from_rows=0``
as a candidate times the narrow tile alone), the same with every chunk summed in program, and each
``--candidates`` setting (``field=value`` pairs joined by ``,``; candidates by ``;``), so one GPU
call can pick the settings. Each invariant figure comes with its ratio to cuBLAS.

``--fp8`` times the exact mode's FP8 GEMM instead: the Triton FP8 GEMM (`kernels/triton_gemm.py`,
what the exact mode's FP8 layers run) with the shipped ``TritonGemmSettings``, the same with its K
groups in one chunk (``split_k_groups`` past K: no split), and ``--candidates`` of that class,
against ``scaled_mm`` (cuBLASLt's blockwise FP8, the kernel path's) and cuBLAS BF16. Its figures
are per call inside a CUDA graph of 20 calls, each reading the next cold copy of the weight, as a
decode step (a graph) reads each layer's weight from DRAM: timed call by call, a decode-sized GEMM
of tens of microseconds measures the host's launch as much as the kernel (session 34, one H200: one
shape's ``scaled_mm`` took 21 to 88 us across four repeats).

Usage: ``python benchmarks/bench_invariant_matmul.py [--rows 64,12288]
[--candidates "split_k=1024;block_m=128,block_n=128"] [--fp8]``.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from _common import bench_graph_ms, bench_ms, cold_copies, cycling, dump, environment

SHAPES = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 12288), "down": (12288, 4096),
          "lm_head": (4096, 151936)}  # name: (K, N)  # fmt: skip


def parse_candidates(text: str) -> list[dict]:
    """``"split_k=1024;block_m=128,block_n=128"`` -> ``[{"split_k": 1024}, {"block_m": 128, "block_n": 128}]``."""
    return [{k: int(v) for k, v in (pair.split("=") for pair in c.split(","))} for c in text.split(";") if c.strip()]


def run_case(rows: int, k: int, n: int, candidates: list[dict]) -> dict:
    from jetrl_trainer.exact.ops import MATMUL
    from jetrl_trainer.kernels.triton_invariant_matmul import invariant_matmul

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1, rows, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(1, k, n, device="cuda", generator=g).bfloat16() * k**-0.5
    us = {"cublas": 1e3 * bench_ms(lambda: torch.matmul(a, b))}
    us["shipped"] = 1e3 * bench_ms(lambda: invariant_matmul(a, b, MATMUL))
    us["shipped_in_program"] = 1e3 * bench_ms(lambda: invariant_matmul(a, b, MATMUL, spread=False))
    for fields in candidates:
        settings = dataclasses.replace(MATMUL, **fields)
        us[",".join(f"{k}={v}" for k, v in fields.items())] = 1e3 * bench_ms(lambda: invariant_matmul(a, b, settings))
    return {name: dict(us=round(t, 1), over_cublas=round(t / us["cublas"], 2)) for name, t in us.items()}


def run_fp8_case(rows: int, k: int, n: int, candidates: list[dict]) -> dict:
    from jetrl_trainer.kernels import fp8_gemm_nt
    from jetrl_trainer.kernels.settings import TritonGemmSettings
    from jetrl_trainer.kernels.triton_gemm import triton_fp8_gemm_nt
    from jetrl_trainer.quant.fp8 import quantize_fp8_blocks, quantize_fp8_groups

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    b = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    (a_q, a_s), (b_q, b_s) = quantize_fp8_groups(a), quantize_fp8_blocks(b)
    shipped = TritonGemmSettings()
    settings = {"shipped": shipped, "one_chunk": dataclasses.replace(shipped, split_k_groups=k // 128 + 1)}
    settings |= {",".join(f"{key}={v}" for key, v in c.items()): dataclasses.replace(shipped, **c) for c in candidates}
    bf16_copies, fp8_copies = cold_copies([b]), cold_copies([b_q, b_s])
    us = {"cublas_bf16": 1e3 * bench_graph_ms(cycling(lambda w: a @ w.t(), bf16_copies)),
          "scaled_mm": 1e3 * bench_graph_ms(cycling(lambda w, ws: fp8_gemm_nt((a_q, a_s), (w, ws), backend="scaled_mm"),
                                                    fp8_copies))}  # fmt: skip
    for name, s in settings.items():
        gemm = lambda w, ws, s=s: triton_fp8_gemm_nt(a_q, a_s, w, ws, "block", torch.bfloat16, settings=s)  # noqa: E731
        us[name] = 1e3 * bench_graph_ms(cycling(gemm, fp8_copies))
    return {name: dict(us=round(t, 1), over_scaled_mm=round(t / us["scaled_mm"], 2)) for name, t in us.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,12288")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--candidates", default="", help='settings to try, e.g. "split_k=1024;block_m=128,block_n=128"')
    ap.add_argument("--fp8", action="store_true", help="the FP8 Triton GEMM (TritonGemmSettings candidates)")
    args = ap.parse_args(argv)
    from jetrl_trainer.exact.ops import MATMUL
    from jetrl_trainer.kernels.settings import TritonGemmSettings

    shipped = TritonGemmSettings() if args.fp8 else MATMUL
    result = dict(benchmark="invariant_matmul", env=environment(), args=vars(args), shipped=dataclasses.asdict(shipped),
                  cases=[])  # fmt: skip
    for rows in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            timer = run_fp8_case if args.fp8 else run_case
            case = dict(rows=rows, shape=name, k=k, n=n, **timer(rows, k, n, parse_candidates(args.candidates)))
            result["cases"].append(case)
            print(case, flush=True)
    dump(result)
    return result


if __name__ == "__main__":
    main()
