"""The K/V roundtrip benchmark (``benchmarks/bench_kv_roundtrip.py``) on CPU at a tiny shape: both exact
training forwards and backwards run and are timed, and the FP8 roundtrip really ran (it moves the log-probs)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
bench = pytest.importorskip("bench_kv_roundtrip")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_both_forwards_run_and_the_roundtrip_moves_the_logprobs(precision):
    result = bench.main(["--shape", "tiny", "--device", "cpu", "--layers", "2", "--prompt", "8", "--completion", "24",
                         "--rows", "2", "--iters", "1", "--precision", precision])  # fmt: skip
    assert result["bf16_kv"]["ms"] > 0 and result["fp8_kv"]["ms"] > 0
    assert result["logps_moved"] is True
    assert result["roundtrip_added_share"] == round(result["fp8_kv"]["ms"] / result["bf16_kv"]["ms"] - 1, 4)


def test_with_gradient_checkpointing_the_recompute_reads_the_roundtrip_too():
    """The layers recompute in the backward (the 36-layer 8k run needs it); the timed steps still move the log-probs."""
    args = ["--shape", "tiny", "--device", "cpu", "--layers", "2", "--prompt", "8", "--completion", "24", "--iters", "1"]
    plain, checkpointed = bench.main(args), bench.main([*args, "--gradient-checkpointing"])
    assert checkpointed["args"]["gradient_checkpointing"] is True and checkpointed["logps_moved"] is True
    assert plain["args"]["gradient_checkpointing"] is False
