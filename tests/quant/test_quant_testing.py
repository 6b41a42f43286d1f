"""jetrl_trainer.quant.testing: the bit-equality and relative-error helpers themselves."""

from __future__ import annotations

import math

import pytest
import torch

from jetrl_trainer.quant import testing
from jetrl_trainer.quant.testing import assert_bits_equal, relative_error


def _nan_with_payload(payload: int) -> torch.Tensor:
    # float32 quiet NaN 0x7fc00000 with extra mantissa bits set.
    return torch.tensor([0x7FC00000 | payload], dtype=torch.int32).view(torch.float32)


def test_public_names():
    assert testing.__all__ == ["assert_bits_equal", "relative_error"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn])
def test_equal_bits_pass_including_nan_and_signed_zero(dtype):
    x = torch.tensor([1.5, -0.0, float("nan"), float("inf"), 3.0]).to(dtype)
    assert_bits_equal(x, x.clone())  # torch.equal would fail here: NaN != NaN
    assert not torch.equal(x, x.clone())


def test_signed_zero_is_a_mismatch_that_torch_equal_misses():
    pos, neg = torch.zeros(3), torch.zeros(3)
    neg[1] = -0.0
    assert torch.equal(pos, neg)
    with pytest.raises(AssertionError, match=r"1 of 3 elements differ; first at \(1,\)"):
        assert_bits_equal(neg, pos)


def test_nan_payloads_are_compared_bitwise():
    a, b = _nan_with_payload(1), _nan_with_payload(2)
    assert a.isnan().all() and b.isnan().all()
    assert_bits_equal(a, _nan_with_payload(1))
    with pytest.raises(AssertionError, match=r"0x7fc00001\), expected nan \(0x7fc00002\)"):
        assert_bits_equal(a, b, "payload")


def test_reports_count_and_the_first_mismatching_coordinate():
    expected = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    actual = expected.clone()
    actual[1, 2, 0] = 100.0  # later in row-major order
    actual[0, 2, 1] = -9.0  # the first mismatch
    with pytest.raises(AssertionError) as err:
        assert_bits_equal(actual, expected, "y")
    msg = str(err.value)
    assert msg.startswith("y: 2 of 24 elements differ; first at (0, 2, 1): ")
    assert "got -9.0 (0xc1100000), expected 9.0 (0x41100000)" in msg


def test_fp8_one_bit_apart():
    expected = torch.tensor([[1.0, 2.0], [4.0, 448.0]]).to(torch.float8_e4m3fn)
    actual = expected.clone()
    actual.view(torch.uint8)[1, 1] -= 1  # 448 -> 416, one code below
    with pytest.raises(AssertionError, match=r"first at \(1, 1\): got 416.0 \(0x7d\), expected 448.0 \(0x7e\)"):
        assert_bits_equal(actual, expected, "q")


def test_integer_bool_and_zero_dim_tensors():
    assert_bits_equal(torch.tensor([True, False]), torch.tensor([True, False]))
    assert_bits_equal(torch.tensor(7), torch.tensor(7))
    with pytest.raises(AssertionError, match=r"first at \(\): got -1 \(0xffffffffffffffff\), expected 1"):
        assert_bits_equal(torch.tensor(-1), torch.tensor(1))
    assert_bits_equal(torch.empty(0, 3), torch.empty(0, 3))


def test_layout_does_not_matter_only_values_at_each_index():
    x = torch.randn(5, 7)
    assert_bits_equal(x.t(), x.t().contiguous())
    y = x.t().contiguous()
    y[0, 1] += 1
    with pytest.raises(AssertionError, match=r"first at \(0, 1\)"):
        assert_bits_equal(x.t(), y)


def test_shape_and_dtype_must_match():
    with pytest.raises(AssertionError, match=r"w: shape \(2, 3\) != expected \(3, 2\)"):
        assert_bits_equal(torch.zeros(2, 3), torch.zeros(3, 2), "w")
    with pytest.raises(AssertionError, match="dtype torch.float32 != expected torch.bfloat16"):
        assert_bits_equal(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="1-, 2-, 4- and 8-byte"):
        assert_bits_equal(torch.zeros(2, dtype=torch.complex128), torch.zeros(2, dtype=torch.complex128))


def test_relative_error_hand_computed():
    expected = torch.tensor([3.0, 4.0])  # norm 5
    assert relative_error(torch.tensor([3.0, 5.0]), expected) == pytest.approx(0.2, abs=0)
    assert relative_error(expected.bfloat16(), expected) == 0.0
    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert relative_error(torch.ones(3), torch.zeros(3)) == math.inf
    assert math.isnan(relative_error(torch.tensor([3.0, float("nan")]), expected))
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(torch.zeros(2), torch.zeros(3))


def test_tensors_that_require_grad():
    x = torch.randn(4, requires_grad=True)
    y = x * 1.0
    assert_bits_equal(y, x)
    assert relative_error(y, x) == 0.0
