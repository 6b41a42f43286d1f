"""The benchmarks' helpers (CPU): copies that pass the L2 cache, calls that cycle through them, and the
kernel-settings variants a benchmark builds from its command line."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from jetrl_trainer.kernels.settings import DecodeAttentionSettings, DecodeGemmSettings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import cold_copies, cycling, replaced_settings  # noqa: E402


def test_cold_copies_pass_three_times_the_l2_cache_in_distinct_memory():
    w, s = torch.randn(64, 128), torch.randn(1, 1)  # 32,772 bytes
    copies = cold_copies([w, s], l2_bytes=100_000)
    assert len(copies) == 10  # ceil(300,000 / 32,772)
    assert copies[0][0] is w and copies[0][1] is s  # the originals come first
    assert len({c[0].data_ptr() for c in copies}) == len(copies)
    assert all(torch.equal(c[0], w) and torch.equal(c[1], s) for c in copies)
    assert cold_copies([w], l2_bytes=1000) == [(w,)]  # already past three L2s: no copy
    assert cold_copies([w, s], cold=False) == [(w, s)]
    assert len(cold_copies([w], l2_bytes=100_000, read_bytes=50_000)) == 6  # a call reads part of them


def test_cycling_calls_each_copy_in_turn():
    seen = []
    call = cycling(lambda a, b: seen.append((a, b)), [(1, 2), (3, 4), (5, 6)])
    for _ in range(7):
        call()
    assert seen == [(1, 2), (3, 4), (5, 6), (1, 2), (3, 4), (5, 6), (1, 2)]


def test_replaced_settings_build_the_variant_a_benchmark_compares():
    assert replaced_settings(DecodeGemmSettings(), "") == DecodeGemmSettings()
    assert replaced_settings(DecodeGemmSettings(), " waves=1, num_warps=8") == DecodeGemmSettings(waves=1, num_warps=8)
    assert replaced_settings(DecodeAttentionSettings(), "loop_stages=1") == DecodeAttentionSettings(loop_stages=1)
    for bad in ("nope=1", "waves", "waves=x", "WAVES=1"):
        with pytest.raises(ValueError, match="FIELD=<int>"):
            replaced_settings(DecodeGemmSettings(), bad)
    with pytest.raises(ValueError, match="positive"):  # the settings' own validation
        replaced_settings(DecodeGemmSettings(), "waves=0")

