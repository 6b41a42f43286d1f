"""Triton quant kernels vs the pure-torch references, bit for bit, on the same CUDA input.

The reference runs on CUDA too: ATen computes ``amax / 448`` there as a multiply by the FP32
reciprocal, so CPU and CUDA references can differ in a scale's last bit (see kernels/_triton_quant_jit.py).
"""

from __future__ import annotations

import pytest
import torch

from jetrl_trainer._choices import FLOAT_DTYPES, SCALE_FORMATS
from jetrl_trainer.kernels import triton_available
from jetrl_trainer.quant.fp8 import dequantize_fp8_groups, quantize_fp8_blocks, quantize_fp8_groups
from jetrl_trainer.quant.reference import rmsnorm_reference, swiglu_reference
from jetrl_trainer.quant.testing import assert_bits_equal, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_available(), reason="needs Triton"),
]

DTYPES = FLOAT_DTYPES
FORMATS = SCALE_FORMATS
ACT_SHAPES = ((1, 1), (3, 100), (7, 128), (33, 300), (130, 1000), (257, 4096), (64, 12288))


def _activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with the cases that break kernels: wide range, an all-zero group, ±0, NaN, Inf,
    subnormals and values that round across a binade boundary."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-3, 3, m, device="cuda")[:, None]
    if m >= 4 and k >= 2:
        x[0, : min(k, 128)] = 0.0
        x[1, 0] = float("nan")
        x[2, k - 1] = float("inf")
        x[3, 0] = -float("inf")
        x[3, 1:] = torch.randn(k - 1, device="cuda", generator=g) * 1e-39  # subnormal in fp32/bf16
    if m >= 6 and k >= 3:
        x[5, :3] = torch.tensor([-0.0, 127.6, -447.9], device="cuda")
    return x.to(dtype)


@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ACT_SHAPES)
def test_act_quant_bit_exact(shape, dtype, scale_format):
    from jetrl_trainer.kernels import act_quant_fp8

    x = _activations(*shape, dtype, seed=shape[0] * 7 + shape[1])
    q, s = act_quant_fp8(x, scale_format=scale_format)
    rq, rs = quantize_fp8_groups(x, 128, scale_format=scale_format)
    assert_bits_equal(s, rs, "scale")
    assert_bits_equal(q, rq, "q")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_ue8m0_saturates_huge_finite_inputs_like_the_reference(dtype):
    """amax near the float32 maximum gets the top ue8m0 scale 2^120, where q saturates at 240 (quant/fp8.py)."""
    from jetrl_trainer.kernels import act_quant_fp8, requant_transpose_fp8, weight_quant_fp8

    top = torch.finfo(dtype).max
    g = torch.Generator(device="cuda").manual_seed(0)
    x = ((torch.rand(256, 384, device="cuda", generator=g) * 2 - 1) * top).to(dtype)
    x[:, 0], x[:, 1] = top, -top
    x[:, 128:256] *= 1e-3  # a group below the top scale, for contrast
    q, s = act_quant_fp8(x, scale_format="ue8m0")
    rq, rs = quantize_fp8_groups(x, 128, scale_format="ue8m0")
    assert_bits_equal(s, rs, "scale")
    assert_bits_equal(q, rq, "q")
    assert (s == 2.0**120).any() and torch.isfinite(dequantize_fp8_groups(q, s)).all()
    qw, sw = weight_quant_fp8(x, scale_format="ue8m0")
    rqw, rsw = quantize_fp8_blocks(x, 128, scale_format="ue8m0")
    assert_bits_equal(sw, rsw, "scale_inv")
    assert_bits_equal(qw, rqw, "q")
    qt, st = requant_transpose_fp8(q, s, scale_format="ue8m0")
    rqt, rst = quantize_fp8_groups(dequantize_fp8_groups(q, s).t().contiguous(), 128, scale_format="ue8m0")
    assert_bits_equal(st, rst, "st")
    assert_bits_equal(qt, rqt, "qt")


@pytest.mark.parametrize("layout", ("transposed", "row_slice"))
def test_act_quant_strided_input(layout):
    from jetrl_trainer.kernels import act_quant_fp8

    base = _activations(300, 520, torch.bfloat16, seed=3)
    x = base.t() if layout == "transposed" else base[:, 8:400]
    q, s = act_quant_fp8(x)
    rq, rs = quantize_fp8_groups(x.contiguous(), 128)
    assert_bits_equal(s, rs, "scale")
    assert_bits_equal(q, rq, "q")


@pytest.mark.parametrize("group", (32, 64, 256))
def test_act_quant_other_groups(group):
    from jetrl_trainer.kernels import act_quant_fp8

    x = _activations(50, 700, torch.bfloat16, seed=group)
    q, s = act_quant_fp8(x, group=group)
    rq, rs = quantize_fp8_groups(x, group)
    assert_bits_equal(s, rs, "scale")
    assert_bits_equal(q, rq, "q")


@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ((1, 1), (128, 128), (300, 500), (1000, 130), (4096, 4096)))
def test_weight_quant_bit_exact(shape, dtype, scale_format):
    from jetrl_trainer.kernels import weight_quant_fp8

    w = (_activations(*shape, torch.float32, seed=shape[0] + 11) * 1e-3).to(dtype)
    q, s = weight_quant_fp8(w, scale_format=scale_format)
    rq, rs = quantize_fp8_blocks(w, 128, scale_format=scale_format)
    assert_bits_equal(s, rs, "scale_inv")
    assert_bits_equal(q, rq, "q")


@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("shape", ((1, 1), (300, 500), (4096, 4096)))
def test_weight_quant_and_transpose_write_into_given_tensors(shape, scale_format):
    # What a weight-cache refresh does: the same bits as fresh outputs, in the tensors it already has.
    from jetrl_trainer.kernels import transpose_fp8_blocks, weight_quant_fp8

    w = (_activations(*shape, torch.float32, seed=shape[0] + 5) * 1e-3).to(torch.bfloat16)
    want_q, want_s = weight_quant_fp8(w, scale_format=scale_format)
    out = (torch.full_like(want_q, float("nan")), torch.full_like(want_s, float("nan")))
    got = weight_quant_fp8(w, scale_format=scale_format, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert_bits_equal(out[0], want_q, "q")
    assert_bits_equal(out[1], want_s, "s_inv")
    want_qt, want_st = transpose_fp8_blocks(want_q, want_s)
    out_t = (torch.empty_like(want_qt), torch.empty_like(want_st))
    got_t = transpose_fp8_blocks(want_q, want_s, out=out_t)
    assert got_t[0] is out_t[0] and got_t[1] is out_t[1]
    assert_bits_equal(out_t[0], want_qt, "qt")
    assert_bits_equal(out_t[1], want_st, "st")


def test_weight_quant_refuses_out_of_another_layout():
    from jetrl_trainer.kernels import transpose_fp8_blocks, weight_quant_fp8

    w = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    q, s = weight_quant_fp8(w)
    with pytest.raises(ValueError, match=r"contiguous torch.float32 \(2, 3\)"):
        weight_quant_fp8(w, out=(q, s[:, :2]))
    with pytest.raises(ValueError, match="not contiguous"):
        transpose_fp8_blocks(q, s, out=(q.t(), s.t()))


@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("shape", ((1, 1), (5, 64), (257, 4096), (128, 128), (300, 200), (8192, 1024), (264, 4096),
                                   (1000, 4112)))  # fmt: skip
def test_requant_transpose_bit_exact(shape, scale_format):
    """Both transposes: bytes (M % 4 != 0, the first three shapes) and 4 tokens per 32-bit word (the rest)."""
    from jetrl_trainer.kernels import requant_transpose_fp8

    x = _activations(*shape, torch.bfloat16, seed=shape[0])
    q, s = quantize_fp8_groups(x, 128, scale_format=scale_format)
    qt, st = requant_transpose_fp8(q, s, scale_format=scale_format)
    rq, rs = quantize_fp8_groups(dequantize_fp8_groups(q, s).t().contiguous(), 128, scale_format=scale_format)
    assert_bits_equal(st, rs, "st")
    assert_bits_equal(qt, rq, "qt")


@pytest.mark.parametrize("shape", ((1, 1), (100, 300), (4096, 12288)))
def test_transpose_fp8_blocks_exact(shape):
    from jetrl_trainer.kernels import transpose_fp8_blocks

    w = torch.randn(shape, device="cuda")
    q, s = quantize_fp8_blocks(w)
    qt, st = transpose_fp8_blocks(q, s)
    assert_bits_equal(qt, q.t().contiguous(), "qt")
    assert_bits_equal(st, s.t().contiguous(), "st")
    assert qt.is_contiguous() and st.is_contiguous()


@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ((1, 128), (3, 100), (64, 1000), (257, 4096), (16, 5120), (1037, 128), (70, 256)))
def test_rmsnorm_quant_bit_exact(shape, dtype, scale_format):
    from jetrl_trainer.kernels import rmsnorm_quant_fp8

    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[1], device="cuda", generator=g)).to(dtype)
    y, q, s = rmsnorm_quant_fp8(x, w, 1e-6, scale_format=scale_format)
    ry = rmsnorm_reference(x, w, 1e-6)
    rq, rs = quantize_fp8_groups(ry, 128, scale_format=scale_format)
    assert_bits_equal(y, ry, "y")
    assert_bits_equal(s, rs, "scale")
    assert_bits_equal(q, rq, "q")
    y_only, q_none, s_none = rmsnorm_quant_fp8(x, w, 1e-6, scale_format=scale_format, quantize=False)
    assert_bits_equal(y_only, ry, "y without quantization")
    assert q_none.shape[0] == 0 and s_none.shape[0] == 0


def test_rmsnorm_reference_close_to_transformers():
    """Not bit-exact by design (tree sum, sqrt+div instead of rsqrt): ≤ 2 BF16 ulps, mostly equal.

    transformers rounds twice (the normalized value to BF16, then its product with the weight); we
    round once, so where the two straddle a rounding boundary they sit up to 2 ulps apart.
    """
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from jetrl_trainer.kernels import rmsnorm_quant_fp8

    norm = Qwen3RMSNorm(4096, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(512, 4096, device="cuda", generator=g) * 2).to(torch.bfloat16)
    with torch.no_grad():
        expected = norm(x)
        y, _, _ = rmsnorm_quant_fp8(x, norm.weight, norm.variance_epsilon)
    diff = (y.float() - expected.float()).abs()
    ulp2 = torch.maximum(y.float().abs(), expected.float().abs()) * 2.0**-6  # ≥ two BF16 ulps of the larger
    assert bool((diff <= ulp2).all()), f"max diff {diff.max().item()}"
    assert (diff == 0).float().mean().item() > 0.95, (diff == 0).float().mean().item()


@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ((1, 1), (3, 100), (64, 1000), (257, 12288)))
def test_swiglu_quant_bit_exact(shape, dtype, scale_format):
    from jetrl_trainer.kernels import swiglu_quant_fp8

    g = torch.Generator(device="cuda").manual_seed(shape[0])
    gate = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype)
    up = torch.randn(shape, device="cuda", generator=g).to(dtype)
    if shape[1] >= 4:
        gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    h, q, s = swiglu_quant_fp8(gate, up, scale_format=scale_format)
    rh = swiglu_reference(gate, up)
    rq, rs = quantize_fp8_groups(rh, 128, scale_format=scale_format)
    assert_bits_equal(h, rh, "h")
    assert_bits_equal(s, rs, "scale")
    assert_bits_equal(q, rq, "q")


@pytest.mark.parametrize("shape", ((1, 128), (257, 1000), (4096, 4096)))
def test_rmsnorm_backward_matches_fp64_autograd(shape):
    from jetrl_trainer.kernels import rmsnorm_backward

    g = torch.Generator(device="cuda").manual_seed(shape[0])
    x = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[1], device="cuda", generator=g)).to(torch.bfloat16)
    dy = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    dx, dw = rmsnorm_backward(x, w, dy, 1e-6)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dx.shape == x.shape and dw.shape == w.shape
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    rmsnorm_reference(x64, w64, 1e-6).backward(dy.double())
    for got, want in ((dx, x64.grad), (dw, w64.grad)):
        rel = relative_error(got, want)
        assert rel < 5e-3, rel  # BF16 output rounding; the math is FP32


def test_swiglu_matches_qwen3_mlp_activation():
    """The reference *is* the transformers computation: act_fn(gate) * up."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    from jetrl_trainer.kernels import swiglu_quant_fp8

    mlp = Qwen3MLP(Qwen3Config(hidden_size=256, intermediate_size=768)).to("cuda", torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        h, _, _ = swiglu_quant_fp8(gate, up)
        assert_bits_equal(h, mlp.act_fn(gate) * up, "h")


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementations and dispatcher registration of every custom op."""
    from jetrl_trainer.kernels import act_quant_fp8  # noqa: F401  (registers the ops)
    from jetrl_trainer.kernels.settings import QuantKernelSettings

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_fp8_groups(x)
    wq, ws = quantize_fp8_blocks(x)
    launch = QuantKernelSettings()
    act, requant = (list(launch.act), list(launch.act_transposed)), (launch.requant_block_k, launch.requant_warps)
    weight, transpose = launch.weight_warps, list(launch.transpose)
    cases = [
        (torch.ops.jetrl.act_quant_fp8.default, (x, 128, "fp32", *act)),
        (torch.ops.jetrl.act_quant_fp8.default, (x.t(), 128, "fp32", *act)),  # the transposed launch
        (torch.ops.jetrl.weight_quant_fp8.default, (x, 128, "ue8m0", weight)),
        (torch.ops.jetrl.requant_transpose_fp8.default, (q, s, 128, "fp32", *requant)),
        (torch.ops.jetrl.transpose_fp8_blocks.default, (wq, ws, transpose)),
        (torch.ops.jetrl.weight_quant_fp8_into.default,
         (x, torch.empty_like(wq), torch.empty_like(ws), 128, "fp32", weight)),
        (torch.ops.jetrl.transpose_fp8_blocks_into.default,
         (wq, ws, torch.empty_like(wq.t()), torch.empty_like(ws.t()), transpose)),
        (torch.ops.jetrl.rmsnorm_quant_fp8.default, (x, torch.ones_like(x[0]), 1e-6, "fp32", True)),
        (torch.ops.jetrl.rmsnorm_quant_fp8.default, (x, torch.ones_like(x[0]), 1e-6, "fp32", False)),  # y only
        (torch.ops.jetrl.swiglu_quant_fp8.default, (x, x, "fp32")),
    ]
    for op, args in cases:
        # (opcheck's test_schema compares outputs with arithmetic that has no FP8 kernels)
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))


def test_kernels_compile_fullgraph():
    """The custom ops trace under torch.compile with no graph break and give the same bits."""
    from jetrl_trainer.kernels import act_quant_fp8, requant_transpose_fp8

    def step(x):
        q, s = act_quant_fp8(x)
        return requant_transpose_fp8(q, s)

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(x), step(x)):
        assert_bits_equal(got, want, "compiled")


def test_bad_input_is_value_error():
    from jetrl_trainer.kernels import act_quant_fp8, requant_transpose_fp8

    with pytest.raises(ValueError, match="CUDA"):
        act_quant_fp8(torch.randn(4, 128))
    with pytest.raises(ValueError, match="power of two"):
        act_quant_fp8(torch.randn(4, 128, device="cuda"), group=100)
    with pytest.raises(ValueError, match="scale_format"):
        act_quant_fp8(torch.randn(4, 128, device="cuda"), scale_format="e4m3")
    q, s = quantize_fp8_groups(torch.randn(4, 256, device="cuda"))
    with pytest.raises(ValueError, match="expected"):
        requant_transpose_fp8(q, s[:, :1])


def _split_sums_reference(parts, bias, dtype):
    """The decode GEMM's split-K reduction: splits added in order (+ bias) in FP32, rounded once."""
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    if bias is not None:
        acc += bias.float()
    return acc.to(dtype)


@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("delta_kind", ["tensor", "one_split", "three_splits", "three_splits_bias"])
@pytest.mark.parametrize("shape", ((1, 128), (3, 100), (64, 4096), (17, 5120)))
def test_add_rmsnorm_quant_is_the_add_then_the_norm_bit_for_bit(shape, delta_kind, scale_format):
    from jetrl_trainer.kernels import add_rmsnorm_quant_fp8, rmsnorm_quant_fp8

    m, k = shape
    g = torch.Generator(device="cuda").manual_seed(k + len(delta_kind))
    r = (torch.randn(shape, device="cuda", generator=g) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    bias = None
    if delta_kind == "tensor":
        delta = torch.randn(shape, device="cuda", generator=g).bfloat16()
        added = r + delta
    else:
        parts = torch.randn((1 if delta_kind == "one_split" else 3, m, k), device="cuda", generator=g)
        bias = torch.randn(k, device="cuda", generator=g).bfloat16() if delta_kind.endswith("bias") else None
        delta = parts
        added = r + _split_sums_reference(parts, bias, r.dtype)
    h, y, q, s = add_rmsnorm_quant_fp8(r, delta, w, 1e-6, bias=bias, scale_format=scale_format)
    ry, rq, rs = rmsnorm_quant_fp8(added, w, 1e-6, scale_format=scale_format)
    assert_bits_equal(h, added, "h")
    assert_bits_equal(y, ry, "y")
    assert_bits_equal(y, rmsnorm_reference(added, w, 1e-6), "y against the reference")
    assert_bits_equal(q, rq, "q")
    assert_bits_equal(s, rs, "scale")


def test_add_rmsnorm_quant_refuses_mismatched_deltas():
    from jetrl_trainer.kernels import add_rmsnorm_quant_fp8

    r = torch.randn(4, 256, device="cuda").bfloat16()
    w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="delta must match residual"):
        add_rmsnorm_quant_fp8(r, r.float(), w, 1e-6)
    with pytest.raises(ValueError, match="split-K partial sums must be contiguous float32"):
        add_rmsnorm_quant_fp8(r, torch.zeros(2, 4, 128, device="cuda"), w, 1e-6)
    with pytest.raises(ValueError, match="bias goes with split-K partial sums only"):
        add_rmsnorm_quant_fp8(r, r, w, 1e-6, bias=w)
