"""Emulated NVFP4 reference (quant/nvfp4.py) against hand-computed values."""

import pytest
import torch

from jetrl_trainer.quant.nvfp4 import (
    E2M1_GRID,
    NVFP4Tensor,
    _decode,
    _encode,
    _pack,
    _unpack,
    dequantize_nvfp4,
    quantize_nvfp4,
    round_to_e2m1,
)
from jetrl_trainer.quant.testing import relative_error


def _block(*values):
    x = torch.zeros(16)
    x[: len(values)] = torch.tensor(values)
    return x


def test_grid_values_are_fixed_points():
    grid = torch.tensor(E2M1_GRID)
    assert E2M1_GRID == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert torch.equal(round_to_e2m1(grid), grid) and torch.equal(round_to_e2m1(-grid), -grid)


def test_round_to_nearest_ties_to_even_mantissa_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 2.6, 4.9, 5.1, 7.0, 100.0, -2.5, -5.1])
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 3.0, 4.0, 6.0, 6.0, 6.0, -2.0, -6.0]
    assert round_to_e2m1(x).tolist() == expect


def test_codes_are_the_e2m1_bit_patterns_and_pack_low_nibble_first():
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0])
    codes = _encode(values)
    assert codes.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 15]
    assert torch.equal(_decode(codes), values)
    packed = _pack(codes)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0xF9]
    assert torch.equal(_unpack(packed), codes)


def test_four_over_six_picks_four_when_it_is_closer():
    # amax 6 -> outer = 6 / (6 * 256) = 2^-8. Max -> 6: block scale 256, 5 ties to 4 (error 1).
    # Max -> 4: block scale 384 (step 1.5), 5 / 1.5 = 3.33 -> 3 -> 4.5 (error 0.25): 4 wins.
    x = _block(6.0, 5.0).unsqueeze(0)
    t = quantize_nvfp4(x, outer="tensor")
    assert t.outer_scale.item() == 2.0**-8
    assert t.block_scale.float().item() == 384.0
    assert dequantize_nvfp4(t)[0, :2].tolist() == [6.0, 4.5]
    t6 = quantize_nvfp4(x, outer="tensor", four_over_six=False)
    assert t6.outer_scale.item() == pytest.approx(6.0 / (6 * 448), rel=1e-6) and t6.block_scale.float().item() == 448.0
    assert dequantize_nvfp4(t6)[0, :2].tolist() == pytest.approx([6.0, 4.0], rel=1e-6)


def test_four_over_six_keeps_six_when_it_is_closer_or_tied():
    # [6, 0.5]: max -> 6 is exact; max -> 4 turns 0.5 into 0.75. [6, 3]: both exact -> tie keeps 6.
    for second in (0.5, 3.0):
        t = quantize_nvfp4(_block(6.0, second).unsqueeze(0), outer="tensor")
        assert t.block_scale.float().item() == 256.0
        assert dequantize_nvfp4(t)[0, :2].tolist() == [6.0, second]


def test_four_over_six_lowers_error_on_random_data():
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    err = {f: (dequantize_nvfp4(quantize_nvfp4(x, four_over_six=f)) - x).pow(2).sum() for f in (True, False)}
    assert err[True] < err[False]


def test_per_token_outer_scale_is_batch_invariant():
    torch.manual_seed(0)
    x = torch.randn(5, 48)
    t = quantize_nvfp4(x, outer="token")
    assert t.outer_scale.shape == (5, 1) and t.block_scale.shape == (5, 3) and t.data.shape == (5, 24)
    big = torch.cat([x[2:3], 1000 * torch.randn(3, 48)])
    alone = quantize_nvfp4(big, outer="token")
    assert torch.equal(alone.data[0], t.data[2]) and torch.equal(alone.outer_scale[0], t.outer_scale[2])
    # A per-tensor outer scale is not: the same row quantizes differently next to a large row.
    per_tensor = dequantize_nvfp4(quantize_nvfp4(x, outer="tensor"))[2]
    assert not torch.equal(dequantize_nvfp4(quantize_nvfp4(big, outer="tensor"))[0], per_tensor)


def test_ragged_k_pads_with_exact_zeros():
    torch.manual_seed(0)
    x = torch.randn(3, 37)
    t = quantize_nvfp4(x)
    assert t.shape == (3, 37) and t.block_scale.shape == (3, 3) and t.data.shape == (3, 24)
    assert torch.equal(_unpack(t.data)[:, 37:], torch.zeros(3, 11, dtype=torch.uint8))
    deq = dequantize_nvfp4(t)
    assert deq.shape == (3, 37)
    assert relative_error(deq, x) < 0.15


def test_values_lie_on_the_scaled_grid():
    torch.manual_seed(0)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    t = quantize_nvfp4(x)
    step = (t.block_scale.float() * t.outer_scale).unsqueeze(-1)
    ratio = dequantize_nvfp4(t).unflatten(-1, (-1, 16)) / step
    assert torch.equal(round_to_e2m1(ratio), ratio)
    assert ratio.abs().amax() <= 6


def test_zeros_give_zeros():
    deq = dequantize_nvfp4(quantize_nvfp4(torch.zeros(2, 20)))
    assert torch.equal(deq, torch.zeros(2, 20))
    assert torch.equal(dequantize_nvfp4(quantize_nvfp4(torch.zeros(3, 16), outer="tensor")), torch.zeros(3, 16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_poisons_its_row_or_tensor(bad):
    x = torch.ones(3, 32)
    x[1, 20] = bad
    deq = dequantize_nvfp4(quantize_nvfp4(x, outer="token"))
    assert not torch.isfinite(deq[1]).any() and torch.equal(deq[[0, 2]], torch.ones(2, 32))
    assert not torch.isfinite(dequantize_nvfp4(quantize_nvfp4(x, outer="tensor"))).any()


def test_dtype_out_and_leading_dims():
    x = torch.randn(2, 3, 16)
    t = quantize_nvfp4(x)
    assert t.outer_scale.shape == (2, 3, 1)
    assert dequantize_nvfp4(t, torch.bfloat16).dtype == torch.bfloat16


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="float32"):
        quantize_nvfp4(torch.ones(2, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="token, tensor"):
        quantize_nvfp4(torch.ones(2, 16), outer="block")
    with pytest.raises(ValueError, match="non-empty"):
        quantize_nvfp4(torch.ones(2, 0))
    with pytest.raises(ValueError, match="NVFP4Tensor"):
        dequantize_nvfp4(torch.ones(2, 16))
    assert isinstance(quantize_nvfp4(torch.ones(1, 1)), NVFP4Tensor)
