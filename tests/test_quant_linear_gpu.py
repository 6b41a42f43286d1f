"""QuantLinear on the GPU path (Triton quant kernels + GPU GEMM backends) vs the CPU reference.

Two kinds of check:
* exact: on CUDA, the Triton kernels and the pure-torch reference quantizers feed the same GEMM
  bit-identical operands, so forward and both gradients are bit-identical
  (``JETRL_DISABLE_TRITON=1`` switches ``quant/_dispatch.py`` to the reference);
* close: CUDA vs CPU. Not bit-exact by construction: the GEMM sums in another order, and ATen's
  CPU reference divides ``amax / 448`` where CUDA multiplies by the reciprocal (last scale bit).

The backend is forced with ``JETRL_GEMM_BACKEND``: ``use_gemm_backend`` is thread-local and the
autograd engine runs CUDA backward passes on its own thread, where it does not apply.
"""

from __future__ import annotations

import pytest
import torch

from _gpu import gpu_gemm_backends
from jetrl_trainer.kernels import reset_kernel_caches, triton_available
from jetrl_trainer.quant.testing import assert_bits_equal, relative_error

pytestmark = pytest.mark.gpu



def _layer(device, n_in=1000, n_out=700, bias=True):
    from jetrl_trainer.quant import QuantLinear

    torch.manual_seed(0)
    return QuantLinear(n_in, n_out, bias=bias, device=device, dtype=torch.bfloat16)


def _run(layer, x, dy):
    layer.weight.grad = None
    if layer.bias is not None:
        layer.bias.grad = None
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return [y.detach(), x.grad, layer.weight.grad] + ([layer.bias.grad] if layer.bias is not None else [])


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
@pytest.mark.parametrize("scale_format", ("fp32", "ue8m0"))
@pytest.mark.parametrize("backend", gpu_gemm_backends() + ["emulated"])
def test_triton_kernels_equal_reference_quantizers_end_to_end(backend, scale_format, monkeypatch):
    from jetrl_trainer.quant import FP8Recipe

    layer = _layer("cuda")
    layer.set_recipes(train=FP8Recipe(scale_format=scale_format))
    x = torch.randn(3, 77, 1000, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(3, 77, 700, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("JETRL_GEMM_BACKEND", backend)
    reset_kernel_caches()  # the variables are read once per process
    fast = _run(layer, x, dy)
    monkeypatch.setenv("JETRL_DISABLE_TRITON", "1")
    reset_kernel_caches()
    layer.set_recipes(train=FP8Recipe(scale_format=scale_format))  # drop the cached FP8 weight
    slow = _run(layer, x, dy)
    for f, s, what in zip(fast, slow, ("y", "dx", "dw", "db")):
        assert_bits_equal(f, s, what)


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_kernel_settings_of_the_recipe_change_no_bit_on_gpu():
    """``FP8Recipe.kernels`` (the quant kernels' tiles and warps, the settings a tuning sweep changes):
    forward and gradients are bit for bit those of the default launch, with a ragged and an aligned
    token count (the requant-transpose packs 4 tokens per word only for the latter)."""
    from jetrl_trainer.kernels.settings import QuantKernelSettings
    from jetrl_trainer.quant import FP8Recipe

    tuned = QuantKernelSettings(act=(8, 4, 4), act_transposed=(32, 2, 4), weight_warps=8, requant_block_k=64,
                                requant_warps=8, transpose=(32, 256, 4))  # fmt: skip
    layer = _layer("cuda", n_in=1024, n_out=768)
    for tokens in (231, 512):
        x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, 768, device="cuda", dtype=torch.bfloat16)
        layer.set_recipes(train=FP8Recipe())  # (also drops the cached weight: quantized again below)
        want = [t.clone() for t in _run(layer, x, dy)]
        layer.set_recipes(train=FP8Recipe(kernels=tuned))
        for got, expected, what in zip(_run(layer, x, dy), want, ("y", "dx", "dw", "db")):
            assert_bits_equal(got, expected, what)


@pytest.mark.parametrize("backend", gpu_gemm_backends())
def test_gpu_matches_cpu_reference(backend, monkeypatch):
    cpu, gpu = _layer("cpu"), _layer("cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(2, 150, 1000, dtype=torch.bfloat16)
    dy = torch.randn(2, 150, 700, dtype=torch.bfloat16)
    want = _run(cpu, x, dy)
    monkeypatch.setenv("JETRL_GEMM_BACKEND", backend)
    reset_kernel_caches()
    got = _run(gpu, x.cuda(), dy.cuda())
    for g, w, what in zip(got, want, ("y", "dx", "dw", "db")):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        assert relative_error(g.cpu(), w) < 1e-2, (what, relative_error(g.cpu(), w))


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_weight_refresh_quantizes_straight_into_the_cache():
    """After an optimizer step the FP8 weight and dgrad's transposed copy are rewritten where they
    lie (a captured graph reads them): no fresh tensor is allocated and copied over, and the bits
    equal a fresh quantization of the new weight."""
    from jetrl_trainer.kernels import transpose_fp8_blocks, weight_quant_fp8
    from jetrl_trainer.quant.recipe import get_recipe

    layer, recipe = _layer("cuda", n_in=512, n_out=384), get_recipe("fp8")
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    layer(x).float().sum().backward()  # fills both caches
    cached = layer.quantized_weight(recipe)
    transposed = layer.transposed_fp8_weight(recipe, cached)
    opt.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    new = layer.quantized_weight(recipe)
    new_t = layer.transposed_fp8_weight(recipe, new)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before  # written in place
    assert all(a is b for a, b in zip(new + new_t, cached + transposed))
    assert (layer.weight_quantizations, layer.weight_transposes) == (2, 2)
    fresh = weight_quant_fp8(layer.weight.detach())
    for got, want, what in zip(new + new_t, fresh + transpose_fp8_blocks(*fresh), ("q", "s", "qt", "st")):
        assert_bits_equal(got, want, what)
