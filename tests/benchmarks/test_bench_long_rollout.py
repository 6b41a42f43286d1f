"""The long-rollout benchmark (``benchmarks/bench_long_rollout.py``) on CPU at a tiny shape: every
configuration decodes the same sequences, each through the slots its cache format fits in the budget
(the FP8 cache holds more), refilled; tokens, seconds and slots are reported."""

from __future__ import annotations

import argparse
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
bench = pytest.importorskip("bench_long_rollout")


def test_the_fp8_cache_gets_more_slots_from_the_same_budget_and_every_configuration_decodes_everything():
    args = argparse.Namespace(layers=2, prompt=32, new=16, sequences=6, shape="tiny", device="cpu")
    model = bench.build(args)
    budget = 4 * (args.prompt + args.new) * 2 * 2 * 2 * 32 * 2  # four BF16 sequences of the tiny model
    rows = {name: bench.run(name, model, args, budget) for name in bench.CONFIGS}
    assert {name: row["slots"] for name, row in rows.items()} == {"bf16": 4, "fp8": 4, "fp8_kv": 6}
    assert all(row["generated_tokens"] == 6 * 16 and row["tok_per_s"] > 0 for row in rows.values())
    assert bench.run("bf16", model, args, budget // 8)["slots"] == 0  # not one sequence: said, not run
