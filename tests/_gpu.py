"""Helpers for GPU tests: parametrization that skips with the real reason, and CUDA-graph capture.

A parameter list built from what this machine has comes out empty without a GPU, and pytest then
reports only "got empty parameter set". ``gpu_gemm_backends`` puts one skipped parameter in its place.
"""

from __future__ import annotations

import pytest
import torch

from jetrl_trainer.kernels import available_gemm_backends


def gpu_gemm_backends() -> list:
    """The GPU GEMM backends available on ``cuda`` (opt-in ones included, "emulated" left out), or
    one skipped parameter that says why there are none."""
    if not torch.cuda.is_available():
        reason = "no CUDA device"
    else:
        names = [b for b in available_gemm_backends("cuda") if b != "emulated"]
        if names:
            return names
        major, minor = torch.cuda.get_device_capability()
        reason = (
            f"no GPU GEMM backend on this SM{major}{minor} device: scaled_mm needs SM90 with torch >= 2.9 "
            "built for CUDA >= 12.9, triton needs Triton and SM >= 8.9"
        )
    return [pytest.param(None, id="none", marks=pytest.mark.skip(reason=reason))]


def capture_graph(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after ``warmup`` eager calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, cuBLAS handles) off the capture stream
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
