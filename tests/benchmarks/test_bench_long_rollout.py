"""The long-rollout benchmark (``benchmarks/bench_long_rollout.py``) on CPU at a tiny shape: every
configuration decodes the same sequences, each through the slots its cache format fits in the budget
(the FP8 cache holds more), refilled; tokens, seconds and slots are reported, and the unified mismatch,
exactly 0 under the exact contract and not on the kernel path."""

from __future__ import annotations

import argparse
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
bench = pytest.importorskip("bench_long_rollout")


def test_the_fp8_cache_gets_more_slots_from_the_same_budget_and_every_configuration_decodes_everything():
    args = argparse.Namespace(layers=2, prompt=32, new=16, sequences=6, shape="tiny", device="cpu", mismatch_rows=2)
    model = bench.build(args)
    budget = 4 * (args.prompt + args.new) * 2 * 2 * 2 * 32 * 2  # four BF16 sequences of the tiny model
    rows = {name: bench.run(name, model, args, budget) for name in bench.CONFIGS}
    assert {name: row["slots"] for name, row in rows.items()} == {"bf16": 4, "fp8": 4, "fp8_kv": 6, "bf16_exact": 4, "fp8_kv_exact": 6}
    assert all(row["generated_tokens"] == 6 * 16 and row["tok_per_s"] > 0 for row in rows.values())
    mismatch = {name: row["unified_mismatch"] for name, row in rows.items()}
    assert all(m["tokens"] == 2 * 16 for m in mismatch.values())
    assert all(mismatch[n]["logp_abs_diff_max"] == 0 and mismatch[n]["bits_equal_share"] == 1 for n in ("bf16_exact", "fp8_kv_exact"))
    assert all(mismatch[n]["logp_abs_diff_max"] > 0 for n in ("fp8", "fp8_kv"))  # the kernel path is not exact
    # the largest batch at 8k / 16k new tokens from the same budget: the FP8 cache holds about twice the BF16 one
    bf16, fp8 = rows["bf16"]["largest_batch"], rows["fp8_kv"]["largest_batch"]
    assert bf16 == {"8k": budget // ((32 + 8192) * 512), "16k": budget // ((32 + 16384) * 512)}
    assert fp8 == {n: bench.slots_that_fit(model, "fp8", 32 + 1024 * int(n[:-1]), budget) for n in fp8}
    big = 2**40  # at a budget where the counts are large: the FP8 cache (a byte and a per-vector scale) fits ~1.8x
    per_8k = {dtype: bench.slots_that_fit(model, dtype, 32 + 8192, big) for dtype in ("auto", "fp8")}
    assert 1.7 * per_8k["auto"] <= per_8k["fp8"] <= 2 * per_8k["auto"]
    assert bench.run("bf16", model, args, budget // 8)["slots"] == 0  # not one sequence: said, not run


def test_without_a_budget_each_configuration_measures_its_own_after_its_weights_exist():
    args = argparse.Namespace(layers=2, prompt=8, new=4, sequences=2, shape="tiny", device="cpu", kv_gib=None,
                              margin_gib=0.0, mismatch_rows=0)  # fmt: skip
    row = bench.run("fp8_kv", bench.build(args), args)
    assert row["kv_budget_gib"] == 1.0 and row["slots"] == 2 and row["generated_tokens"] == 2 * 4  # CPU: 1 GiB
    assert "unified_mismatch" not in row  # --mismatch-rows 0


def test_sequences_zero_decodes_as_many_as_each_configurations_budget_fits_in_one_wave():
    args = argparse.Namespace(layers=2, prompt=8, new=4, sequences=0, shape="tiny", device="cpu", mismatch_rows=0)
    model = bench.build(args)
    budget = 3 * (args.prompt + args.new) * 2 * 2 * 2 * 32 * 2  # three BF16 sequences of the tiny model
    bf16, fp8 = bench.run("bf16", model, args, budget), bench.run("fp8_kv", model, args, budget)
    assert (bf16["slots"], bf16["sequences"], bf16["generated_tokens"]) == (3, 3, 3 * 4)
    assert fp8["slots"] == fp8["sequences"] == bench.slots_that_fit(model, "fp8", 12, budget) > 3


def test_card_gib_takes_the_budget_a_smaller_card_would_leave(monkeypatch):
    """On a 139.8 GiB card with 120 GiB free, ``--card-gib 79.1`` leaves what the 79.1 GiB card would:
    120 - 8 (margin) - 60.7 (the memory beyond it); on a card no larger than that, nothing is taken."""
    gib = 2**30
    args = argparse.Namespace(kv_gib=None, device="cuda", margin_gib=8.0, card_gib=79.1)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench.torch.cuda, "mem_get_info", lambda: (120 * gib, int(139.8 * gib)))
    assert bench.free_budget(args) == 120 * gib - 8 * gib - (int(139.8 * gib) - int(79.1 * gib))
    monkeypatch.setattr(bench.torch.cuda, "mem_get_info", lambda: (60 * gib, int(79.1 * gib)))
    assert bench.free_budget(args) == 52 * gib
    assert bench.free_budget(argparse.Namespace(**{**vars(args), "card_gib": None})) == 52 * gib


def test_each_configuration_is_compared_with_bf16_from_the_same_run():
    result = {"bf16": {"tok_per_s": 2000.0}, "fp8": {"tok_per_s": 2500.0}, "fp8_kv_exact": {"tok_per_s": 3600.0},
              "fp8_kv": {"slots": 0}}  # not one sequence fitted: no tok/s, no ratio
    assert bench.ratios_to_bf16(result, ["bf16", "fp8", "fp8_kv_exact", "fp8_kv"]) == {
        "fp8_over_bf16_tok_per_s": 1.25, "fp8_kv_exact_over_bf16_tok_per_s": 1.8}
    assert bench.ratios_to_bf16({"fp8": {"tok_per_s": 2500.0}}, ["fp8"]) == {}  # no BF16 row in this run
