"""RMSNorm kernels (kernels/triton_norm.py): RMSNorm + FP8 quant, its backward, and the residual add
fused into it, bit for bit against the pure-torch references on CUDA; their row tiling in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from jetrl_trainer._choices import FLOAT_DTYPES, SCALE_FORMATS
from jetrl_trainer.kernels import triton_available
from jetrl_trainer.quant.fp8 import quantize_fp8_groups
from jetrl_trainer.quant.reference import rmsnorm_reference
from jetrl_trainer.quant.testing import assert_bits_equal, relative_error

DTYPES = FLOAT_DTYPES
FORMATS = SCALE_FORMATS
TRITON = pytest.mark.skipif(not triton_available(), reason="needs Triton")


# -- on CUDA -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@TRITON
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


@pytest.mark.gpu
@TRITON
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


@pytest.mark.gpu
@TRITON
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


def _split_sums_reference(parts, bias, dtype):
    """The decode GEMM's split-K reduction: splits added in order (+ bias) in FP32, rounded once."""
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    if bias is not None:
        acc += bias.float()
    return acc.to(dtype)


@pytest.mark.gpu
@TRITON
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


@pytest.mark.gpu
@TRITON
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


# -- in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 pytest -m interpreter) -----------------------


def _rmsnorm_one_row_per_program(x, w, eps):
    """The fused RMSNorm kernel launched with one row per program: the layout before narrow rows were tiled."""
    from jetrl_trainer.kernels._triton_fused_jit import rmsnorm_quant_kernel

    m, k = x.shape
    block_k = max(128, 1 << (k - 1).bit_length())
    y, q, s = torch.empty_like(x), torch.empty(m, k, dtype=torch.uint8), torch.empty(m, -(-k // 128))
    rmsnorm_quant_kernel[(m,)](x, w, y, q, s, m, k, float(k), eps, x.stride(0), y.stride(0), q.stride(0), s.stride(0),
                               BLOCK_K=block_k, ROWS=1, LEVELS=block_k.bit_length() - 2, GROUP=128, UE8M0=False,
                               QUANT=True)  # fmt: skip
    return y, s


@pytest.mark.interpreter
@pytest.mark.parametrize("m, k", [(70, 128), (5, 4096), (33, 100), (9, 1024)])
@pytest.mark.parametrize("quantize", [True, False])
def test_rmsnorm_quant_rows_per_tile_normalize_each_row_on_its_own(m, k, quantize):
    """Narrow rows go several to a program tile (Qwen3's per-head q/k norms: 32 rows of 128): each row's
    bits are those of the same row normalized alone (its own pair tree), a ragged last tile is masked,
    and the values are rmsnorm_reference's (the GPU tests check its bits; numpy's float32 steps here
    differ from torch's CPU ones in a last bit). Without ``quantize`` nothing but y is written."""
    from jetrl_trainer.kernels import triton_norm
    from jetrl_trainer.quant.reference import rmsnorm_reference

    g = torch.Generator().manual_seed(m * k)
    x, w = torch.randn(m, k, generator=g) * 3, torch.rand(k, generator=g) + 0.5
    y, _, s = triton_norm._rmsnorm_quant_op._init_fn(x, w, 1e-6, "fp32", quantize)
    alone_y, alone_s = _rmsnorm_one_row_per_program(x, w, 1e-6)
    assert torch.equal(y, alone_y)
    assert torch.allclose(y, rmsnorm_reference(x, w, 1e-6), rtol=1e-6, atol=0)
    if quantize:
        assert torch.equal(s, alone_s)
    else:
        assert s.shape[0] == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("m, k", [(300, 128), (7, 4096), (33, 100), (1, 128)])
def test_rmsnorm_backward_tiles_cover_every_row_once(m, k):
    """The backward's tiles (several narrow rows each, several tiles per program, ragged ends): dx and
    the per-program dw sums equal FP64 autograd through rmsnorm_reference to FP32 accuracy."""
    from jetrl_trainer.kernels import triton_norm
    from jetrl_trainer.quant.reference import rmsnorm_reference

    g = torch.Generator().manual_seed(m + k)
    x, w, dy = torch.randn(m, k, generator=g), torch.rand(k, generator=g) + 0.5, torch.randn(m, k, generator=g)
    dx, dw = triton_norm._rmsnorm_backward_op._init_fn(x, w, dy, 1e-6)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    rmsnorm_reference(x64, w64, 1e-6).backward(dy.double())
    assert torch.allclose(dx.double(), x64.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(dw.double(), w64.grad, rtol=1e-4, atol=1e-4)
