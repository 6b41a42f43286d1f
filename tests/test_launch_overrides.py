"""Launch-option overrides by name (kernels/launch_overrides.py): parsed, validated, applied and restored."""

from __future__ import annotations

import pytest

from jetrl_trainer.kernels import triton_decode_attention, triton_decode_gemm
from jetrl_trainer.kernels.launch_overrides import launch_overrides, parse_launch_overrides


def test_names_pick_the_kernel_and_the_tables_come_back():
    gemm, attention = parse_launch_overrides(["BALANCE=1", " attention.REAL_ROWS=1", "", "PREFETCH_AHEAD=4"])
    assert gemm == {"BALANCE": 1, "PREFETCH_AHEAD": 4} and attention == {"REAL_ROWS": 1}
    saved = dict(triton_decode_gemm.LAUNCH), dict(triton_decode_attention.LAUNCH)
    with launch_overrides(gemm, attention):
        assert triton_decode_gemm.LAUNCH["BALANCE"] == 1 and triton_decode_attention.LAUNCH["REAL_ROWS"] == 1
        assert triton_decode_gemm.plan(64, 4096, 12288, sms=132)["SPLITS"] == 4  # the plan sees the override
    assert (dict(triton_decode_gemm.LAUNCH), dict(triton_decode_attention.LAUNCH)) == saved


@pytest.mark.parametrize("bad", ["NOPE=1", "attention.NOPE=1", "BALANCE", "BALANCE=yes", "attention.BALANCE=1"])
def test_unknown_keys_and_non_integers_are_refused_with_the_keys_that_exist(bad):
    with pytest.raises(ValueError, match="BALANCE") as caught:
        parse_launch_overrides([bad])
    assert repr(bad) in str(caught.value) and "REAL_ROWS" in str(caught.value)
