"""FP8 E4M3 reference quantizers (quant/fp8.py) against hand-computed values."""

import math

import pytest
import torch

from jetrl_trainer.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    _to_fp8,
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    fp8_scale_from_amax,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)
from jetrl_trainer.quant.testing import assert_bits_equal, relative_error


def _group_with_unit_scale(values):
    """A 128-group whose amax is 448, so its scale is exactly 1 and q == round(x)."""
    x = torch.zeros(128)
    x[0] = 448.0
    x[1 : 1 + len(values)] = torch.tensor(values)
    return x


def test_unit_scale_and_exact_values():
    q, s = quantize_fp8_groups(_group_with_unit_scale([1.0, -3.5, 0.5]).unsqueeze(0))
    assert s.shape == (1, 1) and s.item() == 1.0
    assert q.dtype == FP8_DTYPE
    assert q.float()[0, :4].tolist() == [448.0, 1.0, -3.5, 0.5]


def test_round_to_nearest_even_including_ties():
    # E4M3 spacing: 0.125 on [1, 2), 2 on [16, 32), 32 on [256, 448], subnormal step 2^-9.
    values = [1.0625, 1.1875, 1.07, 17.0, 19.0, 272.0, 304.0, 2.0**-10, 3 * 2.0**-10]
    expect = [1.0, 1.25, 1.125, 16.0, 20.0, 256.0, 320.0, 0.0, 2.0**-8]
    q, _ = quantize_fp8_groups(_group_with_unit_scale(values).unsqueeze(0))
    assert q.float()[0, 1 : 1 + len(values)].tolist() == expect


def test_amax_maps_to_448_and_saturation():
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-6, 6, 64).unsqueeze(1)
    q, s = quantize_fp8_groups(x)
    # The largest element of every group lands exactly on ±448 — never past it, never NaN.
    assert torch.equal(q.float().abs().unflatten(-1, (2, 128)).amax(-1), torch.full((64, 2), FP8_MAX))
    # The saturating cast itself: beyond ±448 clamps, NaN stays NaN.
    sat = _to_fp8(torch.tensor([500.0, -1e6, 449.0, float("nan")])).float()
    assert sat[:3].tolist() == [448.0, -448.0, 448.0] and math.isnan(sat[3].item())


def test_divides_by_scale():
    # amax 3 -> s = 3 * fp32(1/448) (ATen's CUDA division by a scalar); q = x / s, not x * (1/s).
    x = torch.tensor([[3.0, 1.0, -2.0]])
    q, s = quantize_fp8_groups(x)
    assert s.item() == (torch.tensor(3.0) * torch.tensor(1 / 448, dtype=torch.float32)).item()
    expected = (x / s).to(FP8_DTYPE)
    assert_bits_equal(q, expected, "q")
    assert q.float()[0].tolist() == [448.0, 144.0, -288.0]


def test_ragged_group_tail_uses_its_own_amax():
    x = torch.zeros(2, 130)
    x[:, :128] = 448.0
    x[0, 128:] = torch.tensor([1.0, -2.0])
    q, s = quantize_fp8_groups(x)
    assert q.shape == (2, 130) and s.shape == (2, 2)
    assert s[0, 1].item() == (torch.tensor(2.0) * torch.tensor(1 / 448, dtype=torch.float32)).item()
    assert q.float()[0, 128:].tolist() == [224.0, -448.0]
    assert torch.allclose(dequantize_fp8_groups(q, s)[0, 128:], torch.tensor([1.0, -2.0]))


def test_ragged_block_tail_uses_its_own_amax():
    w = torch.zeros(130, 3)
    w[:128] = 1.0
    w[128, 0], w[129, 2] = 7.0, -0.5
    q, s_inv = quantize_fp8_blocks(w)
    assert q.shape == (130, 3) and s_inv.shape == (2, 1)
    assert s_inv[0, 0].item() == torch.tensor(1.0) / 448 and s_inv[1, 0].item() == torch.tensor(7.0) / 448
    assert q.float()[128, 0].item() == 448.0 and q.float()[129, 2].item() == -32.0
    assert torch.allclose(dequantize_fp8_blocks(q, s_inv), w, rtol=0.07)


def test_block_scales_cover_128x128_tiles():
    w = torch.ones(256, 256)
    w[200, 10] = 896.0  # tile (1, 0) only
    q, s_inv = quantize_fp8_blocks(w)
    assert torch.equal(s_inv, torch.tensor([[1.0, 1.0], [896.0, 1.0]]) / 448)
    assert q.float()[200, 10].item() == 448.0 and q.float()[129, 0].item() == 0.5


def test_all_zero_group_is_zero_not_nan():
    q, s = quantize_fp8_groups(torch.zeros(3, 200))
    assert s.eq(torch.tensor(1e-10) * torch.tensor(1 / 448, dtype=torch.float32)).all()
    assert q.float().eq(0).all()
    assert dequantize_fp8_groups(q, s).eq(0).all()
    qb, sb = quantize_fp8_blocks(torch.zeros(5, 7))
    assert qb.float().eq(0).all() and torch.isfinite(sb).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_propagates_to_its_group_only(bad):
    x = torch.ones(2, 256)
    x[0, 5] = bad
    deq = dequantize_fp8_groups(*quantize_fp8_groups(x))
    assert not torch.isfinite(deq[0, :128]).any()  # the poisoned group: never a finite number
    assert torch.equal(deq[0, 128:], torch.ones(128)) and torch.equal(deq[1], torch.ones(256))
    w = torch.ones(256, 256)
    w[3, 3] = bad
    deqw = dequantize_fp8_blocks(*quantize_fp8_blocks(w))
    assert not torch.isfinite(deqw[:128, :128]).any() and torch.isfinite(deqw[128:]).all()


def test_ue8m0_rounds_scale_up_to_power_of_two():
    amax = torch.tensor([448.0, 449.0, 300.0, 224.0, 0.0])
    s = fp8_scale_from_amax(amax, "ue8m0")
    assert s[:4].tolist() == [1.0, 2.0, 1.0, 0.5]
    assert s[4].item() == 2.0 ** math.ceil(math.log2(1e-10 / 448))
    q, sg = quantize_fp8_groups(torch.tensor([[300.0, 1.5]]), scale_format="ue8m0")
    assert sg.item() == 1.0 and q.float()[0].tolist() == [288.0, 1.5]  # 300 -> 288 (step 32, nearest)


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_finite_inputs_saturate_and_never_dequantize_to_inf(scale_format, dtype):
    # Under ue8m0 an amax >= 3.3e38 gets scale 2^120, where 248 would round to q = 256 and 256 * 2^120 = inf;
    # q saturates at 240 there (240 * 2^120 ~ 3.19e38, the largest finite ue8m0 value) and NaN/Inf still propagate.
    top = torch.finfo(dtype).max
    x = torch.tensor([[top, -top, 3.3e38, 1.0]], dtype=dtype)
    q, s = quantize_fp8_groups(x, scale_format=scale_format)
    deq = dequantize_fp8_groups(q, s)
    assert torch.isfinite(deq).all(), deq
    if scale_format == "ue8m0":
        assert s.item() == 2.0**120 and q.float()[0, :3].tolist() == [240.0, -240.0, 240.0]
        assert deq[0, 0].item() == 240 * 2.0**120
    else:
        assert deq[0, 0].item() == pytest.approx(top, rel=1e-6)
    qw, sw = quantize_fp8_blocks(x, scale_format=scale_format)
    assert torch.isfinite(dequantize_fp8_blocks(qw, sw)).all()
    assert torch.equal(qw, q) and torch.equal(sw, s)  # one block == one group here
    special = torch.tensor([[top, float("inf")], [top, float("nan")]], dtype=dtype)
    assert not torch.isfinite(dequantize_fp8_groups(*quantize_fp8_groups(special, scale_format=scale_format))).any()


def test_below_the_top_ue8m0_scale_448_is_kept():
    x = torch.tensor([[448.0 * 2.0**119]])  # scale exactly 2^119: q = 448 is finite there
    q, s = quantize_fp8_groups(x, scale_format="ue8m0")
    assert s.item() == 2.0**119 and q.float().item() == 448.0


def test_round_trip_error_is_small():
    torch.manual_seed(1)
    x = torch.randn(17, 300)
    rel = relative_error(dequantize_fp8_groups(*quantize_fp8_groups(x)), x)
    assert 0 < rel < 0.04
    w = torch.randn(130, 260)
    relw = relative_error(dequantize_fp8_blocks(*quantize_fp8_blocks(w)), w)
    assert 0 < relw < 0.04


def test_leading_dims_and_bf16_input():
    x = torch.randn(2, 3, 130).bfloat16()
    q, s = quantize_fp8_groups(x)
    assert q.shape == (2, 3, 130) and s.shape == (2, 3, 2) and s.dtype == torch.float32
    assert_bits_equal(q, quantize_fp8_groups(x.float())[0], "q")


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="float32"):
        quantize_fp8_groups(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32"):
        quantize_fp8_blocks(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_blocks(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_blocks(torch.ones(4))
    with pytest.raises(ValueError, match="fp32, ue8m0"):
        quantize_fp8_groups(torch.ones(2, 4), scale_format="e5m2")
    for bad in (1.5, 0, -128, True, "128"):
        with pytest.raises(ValueError) as err:
            quantize_fp8_groups(torch.ones(2, 4), bad)
        assert str(err.value) == f"group must be a positive integer (e.g. 128); got {bad!r}."
    with pytest.raises(ValueError, match="^block must be a positive integer"):
        quantize_fp8_blocks(torch.ones(4, 4), 1.5)
    with pytest.raises(ValueError, match="^group must be a positive integer"):
        dequantize_fp8_groups(*quantize_fp8_groups(torch.ones(2, 4)), group=1.5)
    with pytest.raises(ValueError, match="^block must be a positive integer"):
        dequantize_fp8_blocks(*quantize_fp8_blocks(torch.ones(4, 4)), block=2.5)
    q, s = quantize_fp8_groups(torch.ones(2, 200))
    with pytest.raises(ValueError, match="expected"):
        dequantize_fp8_groups(q, s[:, :1])
    qb, sb = quantize_fp8_blocks(torch.ones(200, 200))
    with pytest.raises(ValueError, match="expected"):
        dequantize_fp8_blocks(qb, sb.t()[:1])
