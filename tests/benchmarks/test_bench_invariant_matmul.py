"""The invariant matmul benchmark (``benchmarks/bench_invariant_matmul.py``): its candidate settings
parse, and on the GPU every variant times the same shapes against cuBLAS."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
bench = pytest.importorskip("bench_invariant_matmul")


def test_candidates_parse():
    assert bench.parse_candidates("split_k=1024;block_m=128,block_n=128;") == [
        {"split_k": 1024}, {"block_m": 128, "block_n": 128}]  # fmt: skip
    assert bench.parse_candidates("") == []


@pytest.mark.gpu
def test_every_variant_is_timed():
    result = bench.main(["--rows", "64", "--shapes", "k/v", "--candidates", "split_k=1024"])
    case = result["cases"][0]
    assert {"cublas", "shipped", "shipped_in_program", "split_k=1024"} <= set(case)
    assert all(case[name]["us"] > 0 for name in ("cublas", "shipped", "shipped_in_program", "split_k=1024"))


@pytest.mark.gpu
def test_every_fp8_variant_is_timed():
    result = bench.main(["--rows", "64", "--shapes", "down", "--fp8", "--candidates", "split_k_groups=8"])
    case = result["cases"][0]
    names = ("cublas_bf16", "scaled_mm", "shipped", "one_chunk", "split_k_groups=8")
    assert set(names) <= set(case) and all(case[name]["us"] > 0 for name in names)
