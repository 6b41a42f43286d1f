"""CUDA-graph capture and replay of the FP8 path: kernels, GEMM backends, QuantLinear fwd+bwd.

Capture fails on any host sync (``.item()``, ``.cpu()``, autotuning) or CPU-side allocation
decisions that depend on data; replays must reproduce eager results bit for bit on new data.
"""

from __future__ import annotations

import pytest
import torch

from _gpu import gpu_gemm_backends
from jetrl_trainer.kernels import fp8_gemm_nt, reset_kernel_caches, triton_available, use_gemm_backend
from jetrl_trainer.quant.testing import assert_bits_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not triton_available(), reason="needs Triton")]



def _capture(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
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


@pytest.mark.parametrize("backend", gpu_gemm_backends())
def test_quant_and_gemm_capture_and_replay(backend):
    from jetrl_trainer.kernels import act_quant_fp8, requant_transpose_fp8, transpose_fp8_blocks, weight_quant_fp8

    x = torch.randn(300, 640, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 640, device="cuda", dtype=torch.bfloat16) * 0.05
    out = {}

    def step():
        xq = act_quant_fp8(x)
        wq = weight_quant_fp8(w)
        with use_gemm_backend(backend):
            out["y"] = fp8_gemm_nt(xq, wq)
            out["dgrad_b"] = transpose_fp8_blocks(*wq)
            out["wgrad"] = fp8_gemm_nt(act_quant_fp8(x.t()), requant_transpose_fp8(*xq), b_granularity="group")

    graph = _capture(step)
    x.copy_(torch.randn_like(x))
    w.copy_(torch.randn_like(w) * 0.05)
    graph.replay()
    torch.cuda.synchronize()
    captured = {k: (v.clone() if torch.is_tensor(v) else tuple(t.clone() for t in v)) for k, v in out.items()}
    step()  # eager on the same new data
    assert_bits_equal(captured["y"], out["y"], "y")
    assert_bits_equal(captured["wgrad"], out["wgrad"], "wgrad")
    for got, want, what in zip(captured["dgrad_b"], out["dgrad_b"], ("dgrad q", "dgrad scale")):
        assert_bits_equal(got, want, what)


@pytest.mark.parametrize("backend", gpu_gemm_backends())
def test_quant_linear_forward_backward_capture(backend, monkeypatch):
    from jetrl_trainer.quant import QuantLinear

    torch.manual_seed(0)
    layer = QuantLinear(1024, 768, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 100, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 100, 768, device="cuda", dtype=torch.bfloat16)
    out = {}

    monkeypatch.setenv("JETRL_GEMM_BACKEND", backend)  # process-wide: backward runs on autograd's thread
    reset_kernel_caches()  # the variable is read once per process

    def step():
        layer.weight.grad = layer.bias.grad = x.grad = None
        y = layer(x)
        y.backward(dy)
        out["y"] = y

    graph = _capture(step)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        dy.copy_(torch.randn_like(dy))
    graph.replay()
    torch.cuda.synchronize()
    got = [t.detach().clone() for t in (out["y"], x.grad, layer.weight.grad, layer.bias.grad)]
    step()
    want = [out["y"].detach(), x.grad, layer.weight.grad, layer.bias.grad]
    for g, w, what in zip(got, want, ("y", "dx", "dw", "db")):
        assert_bits_equal(g, w, what)
    assert layer.weight_quantizations == 1  # the cached FP8 weight was reused inside the graph
