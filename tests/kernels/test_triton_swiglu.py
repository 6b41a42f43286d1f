"""SwiGLU + FP8 quant (kernels/triton_swiglu.py) against the pure-torch reference and Qwen3's MLP, on CUDA."""

from __future__ import annotations

import pytest
import torch

from jetrl_trainer._choices import FLOAT_DTYPES, SCALE_FORMATS
from jetrl_trainer.kernels import triton_available
from jetrl_trainer.quant.fp8 import quantize_fp8_groups
from jetrl_trainer.quant.reference import swiglu_reference
from jetrl_trainer.quant.testing import assert_bits_equal

DTYPES = FLOAT_DTYPES
FORMATS = SCALE_FORMATS
TRITON = pytest.mark.skipif(not triton_available(), reason="needs Triton")


# -- on CUDA -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@TRITON
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


@pytest.mark.gpu
@TRITON
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
