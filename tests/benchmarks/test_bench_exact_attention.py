"""The decode attention benchmark (``benchmarks/bench_exact_attention.py``; CUDA kernels only): both kernels
run over both cache formats and give the attention of the same rows."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
bench = pytest.importorskip("bench_exact_attention")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_both_kernels_time_the_same_attention(fp8):
    from jetrl_trainer.exact.ops import ATTENTION
    from jetrl_trainer.kernels.triton_decode_attention import decode_attention
    from jetrl_trainer.kernels.triton_exact_attention import exact_attention

    c = bench.cache(4, 300, fp8)
    slots, lengths = torch.arange(4, device="cuda"), torch.full((4,), 300, device="cuda")
    scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"]) if fp8 else {}
    split = decode_attention(c["q"], c["k"], c["v"], slots, lengths, 0.088, **scales)
    exact = exact_attention(c["q"][:, :, None], c["k"], c["v"], torch.zeros(4, dtype=torch.long, device="cuda"),
                            (lengths - 1)[:, None], 0.088, ATTENTION, kv_rows=slots, **scales)[:, :, 0]  # fmt: skip
    assert torch.allclose(split.float(), exact.float(), atol=2e-2, rtol=2e-2)
    result = bench.main(["--rows", "4", "--lengths", "1024", "--kv", "fp8" if fp8 else "bf16", "--splits", "512"])
    case = result["cases"][0]
    names = ("split_kv", "exact_fp32", "exact_bf16", "exact_bf16_split512")
    assert all(case[name]["us"] > 0 for name in names) and case["live_mib"] > 0
