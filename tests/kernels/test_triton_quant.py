"""Triton quant kernels (kernels/triton_quant.py) vs the pure-torch references, bit for bit, on the same
CUDA input; their out= layouts and launch settings on CPU; launch variants that must agree bit for bit
in Triton's interpreter; the saturating FP8 cast and IEEE division in their sm_90 PTX.

The reference runs on CUDA too: ATen computes ``amax / 448`` there as a multiply by the FP32
reciprocal, so CPU and CUDA references can differ in a scale's last bit (see kernels/_triton_quant_jit.py).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _sm90 import compile_sm90

from jetrl_trainer._choices import FLOAT_DTYPES, SCALE_FORMATS
from jetrl_trainer.kernels import triton_available
from jetrl_trainer.quant.fp8 import dequantize_fp8_groups, quantize_fp8_blocks, quantize_fp8_groups
from jetrl_trainer.quant.testing import assert_bits_equal

TRITON = pytest.mark.skipif(not triton_available(), reason="needs Triton")
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


@pytest.mark.gpu
@TRITON
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


@pytest.mark.gpu
@TRITON
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


@pytest.mark.gpu
@TRITON
@pytest.mark.parametrize("layout", ("transposed", "row_slice"))
def test_act_quant_strided_input(layout):
    from jetrl_trainer.kernels import act_quant_fp8

    base = _activations(300, 520, torch.bfloat16, seed=3)
    x = base.t() if layout == "transposed" else base[:, 8:400]
    q, s = act_quant_fp8(x)
    rq, rs = quantize_fp8_groups(x.contiguous(), 128)
    assert_bits_equal(s, rs, "scale")
    assert_bits_equal(q, rq, "q")


@pytest.mark.gpu
@TRITON
@pytest.mark.parametrize("group", (32, 64, 256))
def test_act_quant_other_groups(group):
    from jetrl_trainer.kernels import act_quant_fp8

    x = _activations(50, 700, torch.bfloat16, seed=group)
    q, s = act_quant_fp8(x, group=group)
    rq, rs = quantize_fp8_groups(x, group)
    assert_bits_equal(s, rs, "scale")
    assert_bits_equal(q, rq, "q")


@pytest.mark.gpu
@TRITON
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


@pytest.mark.gpu
@TRITON
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


@pytest.mark.gpu
@TRITON
def test_weight_quant_refuses_out_of_another_layout():
    from jetrl_trainer.kernels import transpose_fp8_blocks, weight_quant_fp8

    w = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    q, s = weight_quant_fp8(w)
    with pytest.raises(ValueError, match=r"contiguous torch.float32 \(2, 3\)"):
        weight_quant_fp8(w, out=(q, s[:, :2]))
    with pytest.raises(ValueError, match="not contiguous"):
        transpose_fp8_blocks(q, s, out=(q.t(), s.t()))


@pytest.mark.gpu
@TRITON
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


@pytest.mark.gpu
@TRITON
@pytest.mark.parametrize("shape", ((1, 1), (100, 300), (4096, 12288)))
def test_transpose_fp8_blocks_exact(shape):
    from jetrl_trainer.kernels import transpose_fp8_blocks

    w = torch.randn(shape, device="cuda")
    q, s = quantize_fp8_blocks(w)
    qt, st = transpose_fp8_blocks(q, s)
    assert_bits_equal(qt, q.t().contiguous(), "qt")
    assert_bits_equal(st, s.t().contiguous(), "st")
    assert qt.is_contiguous() and st.is_contiguous()


@pytest.mark.gpu
@TRITON
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


# -- on CPU --------------------------------------------------------------------------------------------------


def test_out_layout_error_names_what_cannot_take_a_quantized_pair():
    # The one check behind weight_quant_fp8 / transpose_fp8_blocks(out=): the kernel refuses with it, and
    # the dispatcher uses it to fall back to fresh tensors (a moved or re-shaped weight).
    from jetrl_trainer.kernels.triton_quant import out_layout_error

    w = torch.randn(256, 384)
    q, s = quantize_fp8_blocks(w)
    shapes = ((256, 384), (2, 3))
    assert out_layout_error((q, s), w, shapes) is None
    assert "contiguous torch.float32 (2, 3)" in out_layout_error((q, s[:, :2]), w, shapes)
    assert "not contiguous" in out_layout_error((q.t(), s.t()), w, ((384, 256), (3, 2)))
    assert "torch.float8_e4m3fn" in out_layout_error((q.float(), s), w, shapes)
    assert "1 tensors, not 2" in out_layout_error((q,), w, shapes)


def test_quant_kernel_settings_refuse_what_triton_cannot_launch():
    from jetrl_trainer.kernels.settings import QuantKernelSettings

    assert QuantKernelSettings(act=(8, 4, 4), requant_block_k=64) != QuantKernelSettings()
    with pytest.raises(ValueError, match="act must be a tuple of three positive ints"):
        QuantKernelSettings(act=(16, 2))
    with pytest.raises(ValueError, match="transpose must be powers of two"):
        QuantKernelSettings(transpose=(64, 200, 8))
    with pytest.raises(ValueError, match="requant_warps must be a positive int"):
        QuantKernelSettings(requant_warps=0)


# -- in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 pytest -m interpreter) -----------------------


def _act_launch(settings=None) -> tuple[list[int], list[int]]:
    """The act-quant custom op's launch arguments for ``settings`` (the default ``QuantKernelSettings()``)."""
    from jetrl_trainer.kernels.settings import QuantKernelSettings

    settings = settings if settings is not None else QuantKernelSettings()
    return list(settings.act), list(settings.act_transposed)


def _quant_kernels(x, settings):
    """The quant kernels' host launch code (the custom ops' implementations) on ``x``, launched with
    ``settings``: act quant of ``x`` and of ``x.t()``, requant-transpose, block transpose. (Not the
    weight quant: Triton 3.6's interpreter fails on its scalar scale's ``&``.)"""
    from jetrl_trainer.kernels import triton_quant as kernels

    q, s = kernels._act_quant_op._init_fn(x, 128, "fp32", *_act_launch(settings))
    transposed = kernels._act_quant_op._init_fn(x.t(), 128, "fp32", *_act_launch(settings))
    requant = kernels._requant_transpose_op._init_fn(q, s, 128, "fp32", settings.requant_block_k,
                                                     settings.requant_warps)  # fmt: skip
    blocks = kernels._transpose_blocks_op._init_fn(*quantize_fp8_blocks(x), list(settings.transpose))
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            for pair in ((q, s), transposed, requant, blocks) for t in pair]  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(36, 200), (33, 130), (4, 96)])
def test_quant_kernel_settings_change_no_bit(shape):
    """Other tiles and warps (a ``QuantKernelSettings`` that a tuning sweep builds) give the default
    launch's bits in every quant kernel, on ragged shapes."""
    from jetrl_trainer.kernels.settings import QuantKernelSettings

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 5
    tuned = QuantKernelSettings(act=(8, 4, 4), act_transposed=(32, 2, 4), weight_warps=8, requant_block_k=64,
                                requant_warps=8, transpose=(32, 256, 4))  # fmt: skip
    default = _quant_kernels(x, QuantKernelSettings())
    for got, want in zip(_quant_kernels(x, tuned), default, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    assert default[0].any() and default[4].any() and default[6].any()  # not an all-zero agreement


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(300, 200), (256, 128), (4, 96), (132, 260)])
def test_requant_transpose_packed_words_give_the_byte_paths_bits(shape):
    """M % 4 == 0 packs four tokens per 32-bit word through the transpose; other M move bytes. The same
    tokens with an all-zero one appended (M + 1: the byte path; a zero raises no amax) give the same
    bytes and scales, on ragged token and feature counts."""
    from jetrl_trainer.kernels import triton_quant

    m, k = shape
    q, s = quantize_fp8_groups(torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 5, 128)
    q_odd, s_odd = torch.cat([q, torch.zeros(1, k, dtype=q.dtype)]), torch.cat([s, torch.ones(1, s.shape[1])])
    qt_words, st_words = triton_quant._requant_transpose_op._init_fn(q, s, 128, "fp32", 32, 4)
    qt_bytes, st_bytes = triton_quant._requant_transpose_op._init_fn(q_odd, s_odd, 128, "fp32", 32, 4)
    assert qt_words.shape == (k, m) and qt_bytes.shape == (k, m + 1)
    assert torch.equal(qt_words.view(torch.uint8), qt_bytes[:, :m].view(torch.uint8))
    assert torch.equal(st_words, st_bytes[:, : st_words.shape[1]])
    assert qt_words.view(torch.uint8).any() and not qt_bytes[:, m].view(torch.uint8).any()


# -- compiled for sm_90 without a GPU (JETRL_COMPILE_SM90=1 pytest -m sm90) ----------------------------------


def _fp8_cast_and_division(ptx: str) -> bool:
    """The numerics contract's two assumptions about a quant kernel's PTX (docs/numerics.md): the FP32 ->
    E4M3 cast is the saturating round-to-nearest-even instruction (so no explicit clamp), and the
    division by the scale is IEEE (a reciprocal multiply differs in the last bit)."""
    return "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx


QUANT_KERNELS = {  # kernel: (pointer types, constexprs, launch, FP32 scalars); QuantKernelSettings()'s launches
    "act_quant_kernel": (dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"),
                         dict(GROUP=128, BLOCK_M=16, GROUPS_PER_PROG=2, UE8M0=False, stride_xk=1), dict(num_warps=4),
                         ()),
    "act_quant_kernel[transposed]": (dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"),
                                     dict(GROUP=128, BLOCK_M=64, GROUPS_PER_PROG=1, UE8M0=False, stride_xm=1),
                                     dict(num_warps=4), ()),
    "weight_quant_kernel": (dict(w_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"), dict(BLOCK=128, UE8M0=True),
                            dict(num_warps=16), ()),
    "requant_transpose_kernel": (dict(q_ptr="*u8", s_ptr="*fp32", qt_ptr="*u8", st_ptr="*fp32"),
                                 dict(GROUP=128, BLOCK_K=32, UE8M0=False, PACK4=False), dict(num_warps=4), ()),
    "requant_transpose_kernel[PACK4]": (dict(q_ptr="*u8", s_ptr="*fp32", qt_ptr="*i32", st_ptr="*fp32"),
                                        dict(GROUP=128, BLOCK_K=32, UE8M0=False, PACK4=True), dict(num_warps=4), ()),
}  # fmt: skip


FUSED_KERNELS = {  # the RMSNorm and SwiGLU kernels that quantize their output (triton_norm.py, triton_swiglu.py)
    "rmsnorm_quant_kernel": (dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"),
                             dict(BLOCK_K=4096, ROWS=1, LEVELS=11, GROUP=128, UE8M0=False, QUANT=True),
                             dict(num_warps=8),
                             ("k_float", "eps")),
    "add_rmsnorm_quant_kernel": (dict(r_ptr="*bf16", d_ptr="*fp32", bias_ptr="*bf16", w_ptr="*bf16", h_ptr="*bf16",
                                      y_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"),
                                 dict(PARTS=5, HAS_BIAS=False, BLOCK_K=4096, LEVELS=11, GROUP=128, UE8M0=False),
                                 dict(num_warps=32), ("k_float", "eps")),
    "swiglu_quant_kernel": (dict(g_ptr="*bf16", u_ptr="*bf16", h_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"),
                            dict(GROUP=128, BLOCK_M=16, GROUPS_PER_PROG=2, UE8M0=False), dict(num_warps=4),
                            ()),
}  # fmt: skip


@pytest.mark.sm90
@pytest.mark.parametrize("name", list(QUANT_KERNELS) + list(FUSED_KERNELS))
def test_quant_kernels_compile_to_the_saturating_cast_and_ieee_division(name):
    module = "_triton_quant_jit" if name in QUANT_KERNELS else "_triton_fused_jit"
    jit = importlib.import_module(f"jetrl_trainer.kernels.{module}")
    pointers, constexprs, launch, floats = {**QUANT_KERNELS, **FUSED_KERNELS}[name]
    ptx = compile_sm90(getattr(jit, name.split("[")[0]), pointers, constexprs, floats=floats, launch=launch)
    assert _fp8_cast_and_division(ptx)
