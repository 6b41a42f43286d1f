"""QuantLinear (quant/linear.py): numerics vs nn.Linear, saved tensors, phases, weight cache."""

import pytest
import torch
import torch.nn.functional as F
from _gpu import capture_graph, gpu_gemm_backends
from torch import nn

from jetrl_trainer.kernels import fp8_gemm_nt, reset_kernel_caches, triton_available
from jetrl_trainer.quant.testing import assert_bits_equal, relative_error
from jetrl_trainer.quant import (
    FP8Recipe,
    NVFP4Recipe,
    PrecisionPhases,
    QuantLinear,
    WeightCacheRefresh,
    count_quant_gemms,
    dequantize_fp8_groups,
    invalidate_weight_caches,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)

TRITON = pytest.mark.skipif(not triton_available(), reason="needs Triton")

FP8 = {"train": "fp8", "rollout": "fp8"}
RECIPES = {
    "fp8": FP8,
    "fp8_ue8m0": {"train": FP8Recipe(scale_format="ue8m0"), "rollout": "fp8"},
    "nvfp4_dequantized": {"train": NVFP4Recipe(backward="dequantized"), "rollout": "nvfp4"},
    "nvfp4_high_precision": {"train": NVFP4Recipe(backward="high_precision"), "rollout": "nvfp4"},
}


def _pair(n_in=200, n_out=150, dtype=torch.float32, bias=True, recipes=FP8, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(n_in, n_out, bias=bias).to(dtype)
    q = QuantLinear.from_linear(nn.Linear(n_in, n_out, bias=bias).to(dtype), recipes)
    q.load_state_dict(ref.state_dict())
    return ref, q


def _cos(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def _run(module, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    grads = [x.grad, module.weight.grad] + ([module.bias.grad] if module.bias is not None else [])
    return y, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_backward_close_to_nn_linear(name, dtype):
    ref, q = _pair(dtype=dtype, recipes=RECIPES[name])
    x = torch.randn(3, 7, 200, dtype=dtype)
    dy = torch.randn(3, 7, 150, dtype=dtype)
    y_ref, g_ref = _run(ref, x, dy)
    y, g = _run(q, x, dy)
    assert y.dtype == dtype and y.shape == (3, 7, 150)
    assert [t.dtype for t in g] == [dtype] * 3
    assert _cos(y, y_ref) > 0.99
    for got, want, what in zip(g, g_ref, ("dX", "dW", "db")):
        assert _cos(got, want) > 0.99, what
    assert not torch.equal(y, y_ref)  # the quantized path really ran


def test_fp8_backward_is_exactly_the_contracted_data_flow():
    _, q = _pair(n_in=260, n_out=130, bias=False)
    x = torch.randn(150, 260)
    dy = torch.randn(150, 130)
    y, (dx, dw) = _run(q, x, dy)
    x_q, x_s = quantize_fp8_groups(x)
    w_q, w_s = quantize_fp8_blocks(q.weight.detach())
    assert torch.equal(y, fp8_gemm_nt((x_q, x_s), (w_q, w_s), out_dtype=torch.float32))
    # dgrad: dY quantized 1x128 along N, times the same FP8 weight transposed with its scale grid.
    wt = (w_q.t().contiguous(), w_s.t().contiguous())
    want_dx = fp8_gemm_nt(quantize_fp8_groups(dy), wt, out_dtype=torch.float32)
    assert torch.equal(dx, want_dx)
    # wgrad: dYᵀ quantized along tokens, times the saved FP8 X re-quantized along tokens.
    xt = quantize_fp8_groups(dequantize_fp8_groups(x_q, x_s).t().contiguous())
    want_dw = fp8_gemm_nt(quantize_fp8_groups(dy.t().contiguous()), xt, b_granularity="group", out_dtype=torch.float32)
    assert torch.equal(dw, want_dw)


def test_each_phase_launches_every_quant_kernel_with_its_recipes_kernel_settings(monkeypatch):
    """The recipe owns the quant kernels' launch: the forward act quant, the weight quant and
    transpose, dgrad's dY quant and wgrad's dYᵀ quant and X_q requant all get ``recipe.kernels`` of
    the phase that runs. On CPU a spy stands in for the Triton kernels (the references compute)."""
    from jetrl_trainer.kernels.settings import QuantKernelSettings
    from jetrl_trainer.quant import _dispatch

    def requant(q, s, scale_format):
        return quantize_fp8_groups(dequantize_fp8_groups(q, s).t().contiguous(), 128, scale_format=scale_format)

    references = {
        "act_quant_fp8": lambda x, scale_format: quantize_fp8_groups(x.contiguous(), 128, scale_format=scale_format),
        "weight_quant_fp8": lambda w, scale_format, out: quantize_fp8_blocks(w, 128, scale_format=scale_format),
        "requant_transpose_fp8": requant,
        "transpose_fp8_blocks": lambda q, s, out: (q.t().contiguous(), s.t().contiguous()),
    }
    launches = []

    def spy(name, x):
        if name == "out_layout_error":
            return lambda out, like, shapes: "fresh tensors on CPU"

        def kernel(*args, settings, **kwargs):
            launches.append((name, settings))
            return references[name](*args, **kwargs)

        return kernel

    monkeypatch.setattr(_dispatch, "_kernel", spy)
    tuned = QuantKernelSettings(act=(8, 4, 4), act_transposed=(32, 2, 4), weight_warps=8, requant_block_k=64,
                                requant_warps=8, transpose=(32, 256, 4))  # fmt: skip
    layer = QuantLinear(256, 130, train=FP8Recipe(kernels=tuned), rollout="fp8")
    x = torch.randn(9, 256, requires_grad=True)
    with PrecisionPhases(layer).train():
        layer(x).sum().backward()
    assert sorted(name for name, _ in launches) == ["act_quant_fp8"] * 3 + ["requant_transpose_fp8",
                                                    "transpose_fp8_blocks", "weight_quant_fp8"]  # fmt: skip
    assert all(settings is tuned for _, settings in launches)
    launches.clear()
    with PrecisionPhases(layer).rollout(), torch.no_grad():
        layer(x)
    assert ("act_quant_fp8", QuantKernelSettings()) in launches  # the rollout recipe's own (default) launch
    assert all(settings == QuantKernelSettings() for _, settings in launches)


def _saved_tensors(module, x):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    return y, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_tensors_are_fp8_and_scales_only(dtype):
    _, q = _pair(dtype=dtype)
    x = torch.randn(4, 9, 200, dtype=dtype, requires_grad=True)
    y, saved = _saved_tensors(q, x)
    assert saved, "nothing saved for backward"
    fp8 = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    scales = [t for t in saved if t.dtype == torch.float32]
    assert len(fp8) == 2 and len(scales) == 2 and len(fp8) + len(scales) == len(saved)
    # The weight is saved as dgrad's operand: the cached transposed FP8 weight [K, N].
    assert sorted(tuple(t.shape) for t in fp8) == [(36, 200), (200, 150)]
    assert sorted(tuple(t.shape) for t in scales) == [(2, 2), (36, 2)]
    y.sum().backward()
    assert x.grad is not None and q.weight.grad is not None


def test_frozen_weight_saves_only_the_weight():
    _, q = _pair()
    q.weight.requires_grad_(False)
    q.bias.requires_grad_(False)
    x = torch.randn(5, 200, requires_grad=True)
    y, saved = _saved_tensors(q, x)
    assert [tuple(t.shape) for t in saved] == [(200, 150), (2, 2)]  # W_qᵀ (cached) and its block scales
    y.sum().backward()
    assert x.grad.shape == (5, 200) and q.weight.grad is None


def test_nvfp4_dequantized_saves_4bit_codes_not_x():
    _, q = _pair(recipes=RECIPES["nvfp4_dequantized"])
    x = torch.randn(6, 200, requires_grad=True)
    _, saved = _saved_tensors(q, x)
    assert {t.dtype for t in saved} == {torch.uint8, torch.float8_e4m3fn, torch.float32}
    assert not any(t.shape == x.shape for t in saved)
    assert tuple(saved[0].shape) == (6, 104)  # ceil(200/16) * 8 bytes per row: two codes per byte


def test_nvfp4_high_precision_saves_the_operands():
    _, q = _pair(recipes=RECIPES["nvfp4_high_precision"])
    x = torch.randn(6, 200, requires_grad=True)
    _, saved = _saved_tensors(q, x)
    assert any(t is x or (t.shape == x.shape and torch.equal(t, x)) for t in saved)


def test_unified_flow_rollout_equals_train_and_weight_is_quantized_once():
    _, q = _pair()
    x = torch.randn(8, 200)
    with torch.no_grad(), PrecisionPhases(q).rollout():
        y_rollout = q(x)
    y_train = q(x)
    assert torch.equal(y_rollout, y_train)
    assert q.weight_quantizations == 1
    with torch.inference_mode(), PrecisionPhases(q).rollout():
        assert torch.equal(q(x), y_train)
    assert q.weight_quantizations == 1


@pytest.mark.parametrize("optim_kw", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_weight_cache_invalidated_once_per_optimizer_step(optim_kw):
    _, q = _pair()
    opt = torch.optim.AdamW(q.parameters(), lr=1e-2, **optim_kw)
    WeightCacheRefresh(q, opt)
    x = torch.randn(8, 200)
    before = q(x)
    before.sum().backward()
    with PrecisionPhases(q).rollout(), torch.no_grad():
        q(x)
    assert q.weight_quantizations == 1
    opt.step()  # fused AdamW does not bump param._version; the refresh still invalidates
    after = q(x)
    with PrecisionPhases(q).rollout(), torch.no_grad():
        assert torch.equal(q(x), after)
    assert q.weight_quantizations == 2
    assert not torch.equal(after, before)


def test_weight_refresh_writes_into_the_cached_tensors():
    """After an optimizer step the cache is refreshed in place: a CUDA graph captured on the old
    tensors (the decode engine's) reads the new weights, and they equal a fresh quantization."""
    from jetrl_trainer.quant.recipe import get_recipe

    _, q = _pair()
    recipe = get_recipe("fp8")
    opt = torch.optim.SGD(q.parameters(), lr=0.5)
    w_q, w_s = q.quantized_weight(recipe)
    pointers = (w_q.data_ptr(), w_s.data_ptr())
    q(torch.randn(8, 200)).sum().backward()
    opt.step()
    new_q, new_s = q.quantized_weight(recipe)
    assert new_q is w_q and new_s is w_s
    assert (new_q.data_ptr(), new_s.data_ptr()) == pointers
    fresh_q, fresh_s = quantize_fp8_blocks(q.weight.detach())
    assert_bits_equal(new_q, fresh_q, "w_q")
    assert_bits_equal(new_s, fresh_s, "w_s")
    assert q.weight_quantizations == 2


def _fp8_grads(q, x, dy):
    x = x.clone().requires_grad_(True)
    q.zero_grad(set_to_none=True)
    q(x).backward(dy)
    return x.grad, q.weight.grad, q.bias.grad


def test_dgrad_uses_the_cached_transposed_weight_with_the_same_bits():
    """The transposed FP8 weight is made once per optimizer step and dgrad runs on it; the gradients
    are bit-identical to transposing in every backward (``cache_transposed_weight = False``)."""
    from jetrl_trainer.quant.recipe import get_recipe

    _, q = _pair()
    _, plain = _pair()
    plain.cache_transposed_weight = False
    x, dy = torch.randn(8, 200), torch.randn(8, 150)
    for _ in range(2):  # the second backward reuses the cache
        cached, fresh = _fp8_grads(q, x, dy), _fp8_grads(plain, x, dy)
        for a, b, what in zip(cached, fresh, ("dx", "dw", "db")):
            assert_bits_equal(a, b, what)
    assert q.weight_transposes == 1 and plain.weight_transposes == 0
    assert q.weight_quantizations == plain.weight_quantizations == 1
    wt_q, wt_s = q.transposed_fp8_weight(get_recipe("fp8"))
    w_q, w_s = q.quantized_weight(get_recipe("fp8"))
    assert_bits_equal(wt_q, w_q.t().contiguous(), "wt_q")
    assert_bits_equal(wt_s, w_s.t().contiguous(), "wt_s")


def test_transposed_weight_cache_refreshes_in_place_after_a_step():
    from jetrl_trainer.quant.recipe import get_recipe

    _, q = _pair()
    recipe = get_recipe("fp8")
    opt = torch.optim.SGD(q.parameters(), lr=0.5)
    x, dy = torch.randn(8, 200), torch.randn(8, 150)
    _fp8_grads(q, x, dy)
    wt_q, wt_s = q.transposed_fp8_weight(recipe)
    opt.step()
    dx_after = _fp8_grads(q, x, dy)[0]
    new_q, new_s = q.transposed_fp8_weight(recipe)
    assert new_q is wt_q and new_s is wt_s and q.weight_transposes == 2
    w_q, w_s = quantize_fp8_blocks(q.weight.detach())
    assert_bits_equal(new_q, w_q.t().contiguous(), "wt_q")
    assert_bits_equal(new_s, w_s.t().contiguous(), "wt_s")
    _, plain = _pair()
    plain.load_state_dict(q.state_dict())
    plain.cache_transposed_weight = False
    assert_bits_equal(dx_after, _fp8_grads(plain, x, dy)[0], "dx")


def test_no_transposed_weight_without_an_input_gradient_or_in_rollouts():
    _, q = _pair()
    q(torch.randn(8, 200)).sum().backward()  # the input needs no gradient: no dgrad
    with torch.no_grad(), PrecisionPhases(q).rollout():
        q(torch.randn(8, 200))
    assert q.weight_transposes == 0 and q._transposed_cache == {}


def test_in_place_edits_invalidate_but_data_edits_need_an_explicit_call():
    _, q = _pair()
    x = torch.randn(4, 200)
    y0 = q(x)
    with torch.no_grad():
        q.weight.mul_(2)  # bumps _version
    torch.testing.assert_close(q(x), 2 * y0 - q.bias.detach(), rtol=0.02, atol=0.02)
    assert q.weight_quantizations == 2
    q.weight.data.mul_(0.5)  # .data bypasses the version counter
    q(x)
    assert q.weight_quantizations == 2
    invalidate_weight_caches(q)
    torch.testing.assert_close(q(x), y0)
    assert q.weight_quantizations == 3


def test_cache_filled_under_inference_mode_serves_training():
    _, q = _pair()
    x = torch.randn(4, 200, requires_grad=True)
    with torch.inference_mode():
        q(x.detach())
    y = q(x)  # reuses the cached FP8 weight and saves it for backward
    y.sum().backward()
    assert q.weight_quantizations == 1 and x.grad is not None


def test_inference_tensor_weight_is_not_cached():
    with torch.inference_mode():
        lin = nn.Linear(200, 150)
        q = QuantLinear.from_linear(lin, FP8)
        x = torch.randn(3, 200)
        assert torch.equal(q(x), q(x))
    assert q.weight_quantizations == 2


def test_naive_baseline_differs_per_phase_and_trains_in_bf16():
    ref, q = _pair(dtype=torch.bfloat16, recipes={"train": "bf16", "rollout": "fp8"})
    x = torch.randn(8, 200, dtype=torch.bfloat16)
    with torch.no_grad():
        y_train = q(x)
        with PrecisionPhases(q).rollout():
            y_rollout = q(x)
    assert torch.equal(y_train, ref(x))
    assert not torch.equal(y_rollout, y_train)
    assert _cos(y_rollout, y_train) > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_recipe_is_nn_linear_bit_for_bit(dtype):
    ref, q = _pair(dtype=dtype, recipes={"train": "bf16", "rollout": "bf16"})
    x = torch.randn(2, 5, 200, dtype=dtype)
    dy = torch.randn(2, 5, 150, dtype=dtype)
    y_ref, g_ref = _run(ref, x, dy)
    y, g = _run(q, x, dy)
    assert torch.equal(y, y_ref)
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    assert q.weight_quantizations == 0


@pytest.mark.parametrize("name", ["fp8", "nvfp4_dequantized"])
def test_batch_invariance(name):
    _, q = _pair(n_in=300, n_out=130, recipes=RECIPES[name])
    x = torch.randn(24, 300)
    with torch.no_grad():
        full = q(x)
        rows = [0, 5, 6, 23]
        part = q(x[rows])
        mixed = q(torch.cat([x[rows], 1e3 * torch.randn(9, 300)]))[: len(rows)]
    if name == "fp8":  # the emulated FP8 GEMM is batch invariant bit for bit
        assert torch.equal(part, full[rows]) and torch.equal(mixed, full[rows])
    else:  # NVFP4 quantization is per token; its FP32 emulation GEMM is BLAS, so only close
        torch.testing.assert_close(part, full[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed, full[rows], rtol=1e-5, atol=1e-5)


def test_no_grad_builds_no_graph_and_matches():
    _, q = _pair()
    x = torch.randn(4, 200, requires_grad=True)
    with torch.no_grad():
        y = q(x)
    assert y.grad_fn is None and not y.requires_grad
    assert torch.equal(y, q(x).detach())


def test_mixed_dtypes_and_autocast():
    _, q = _pair()  # FP32 master weights
    x = torch.randn(3, 200, dtype=torch.bfloat16, requires_grad=True)
    y = q(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and q.weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert q(torch.randn(3, 200)).dtype == torch.bfloat16


def test_count_quant_gemms_per_phase():
    _, q = _pair(recipes={"train": "bf16", "rollout": "fp8"})
    x = torch.randn(2, 200)
    with count_quant_gemms() as outer:
        q(x)
        with count_quant_gemms() as inner, PrecisionPhases(q).rollout():
            q(x)
            q(x)
    assert inner == {("rollout", "fp8"): 2}
    assert outer == {("train", "bf16"): 1, ("rollout", "fp8"): 2}


def test_parameters_shared_and_state_dict_unchanged():
    lin = nn.Linear(200, 150).bfloat16()
    keys = {k: v.dtype for k, v in lin.state_dict().items()}
    q = QuantLinear.from_linear(lin, FP8)
    assert q.weight is lin.weight and q.bias is lin.bias and isinstance(q, nn.Linear)
    assert {k: v.dtype for k, v in q.state_dict().items()} == keys
    back = q.to_linear()
    assert type(back) is nn.Linear and back.weight is lin.weight and back.bias is lin.bias
    no_bias = QuantLinear.from_linear(nn.Linear(4, 3, bias=False), FP8)
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]


def test_extra_repr_shows_recipes_and_phase():
    _, q = _pair(recipes={"train": "fp8", "rollout": "nvfp4"})
    text = repr(q)
    assert "train=fp8(e4m3,1x128/128x128)" in text and "rollout=nvfp4(e2m1,1x16,4/6,bwd=dequantized)" in text
    plain = QuantLinear(16, 8, train="bf16", rollout="fp8")
    assert "train=bf16, rollout=fp8(e4m3,1x128/128x128), phase=train" in repr(plain)
    with PrecisionPhases(plain).rollout():
        assert repr(plain).endswith("phase=rollout)")


def test_bad_input_raises_value_error():
    _, q = _pair()
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        q(torch.ones(2, 200, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[\*, 200\]"):
        q(torch.ones(2, 100))
    with pytest.raises(ValueError, match="train, rollout"):
        with PrecisionPhases(q).use("eval"):
            pass
    with pytest.raises(ValueError, match="bf16, fp8, nvfp4"):
        q.set_recipes(train="int4")
    with pytest.raises(ValueError, match="quantized weight must be one of float32, bfloat16, float16; got float64"):
        QuantLinear.from_linear(nn.Linear(4, 3).double(), FP8)
    weird = nn.Linear(4, 3)
    weird.weight = nn.Parameter(torch.ones(3, 4, 1))
    with pytest.raises(ValueError, match="2-D"):
        QuantLinear.from_linear(weird, FP8)
    bf16_only = {"train": "bf16", "rollout": "bf16"}
    assert isinstance(QuantLinear.from_linear(nn.Linear(4, 3).double(), bf16_only), QuantLinear)


def test_recipes_by_name_and_phase_recipes():
    from jetrl_trainer.quant import BF16Recipe, FP8Recipe, get_recipe, phase_recipes
    from jetrl_trainer.quant.recipe import PRECISIONS

    assert [type(get_recipe(name)).name for name in PRECISIONS] == ["bf16", "fp8", "nvfp4"]
    assert get_recipe(" Nvfp4 ") == NVFP4Recipe()
    assert get_recipe("FP8", scale_format="ue8m0") == FP8Recipe(scale_format="ue8m0")
    assert get_recipe(NVFP4Recipe(), four_over_six=False) == NVFP4Recipe(four_over_six=False)
    recipes = phase_recipes("bf16", "fp8", scale_format="ue8m0", nvfp4_backward="high_precision")
    assert recipes == {"train": BF16Recipe(), "rollout": FP8Recipe(scale_format="ue8m0")}
    assert phase_recipes("nvfp4", "nvfp4", nvfp4_backward="high_precision")["train"].backward == "high_precision"
    with pytest.raises(ValueError, match="allowed: backward, four_over_six"):
        get_recipe("nvfp4", scale_format="ue8m0")
    with pytest.raises(ValueError, match="True or False"):
        NVFP4Recipe(four_over_six="yes")


@pytest.mark.gpu
def test_cuda_fast_kernels_match_the_reference_bit_for_bit(monkeypatch):
    from jetrl_trainer.kernels import reset_kernel_caches, use_gemm_backend

    _, q = _pair(n_in=384, n_out=260, dtype=torch.bfloat16)
    q.cuda()
    x = torch.randn(300, 384, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(300, 260, dtype=torch.bfloat16, device="cuda")
    results = []
    for disable in ("1", "0"):  # the pure-torch reference, then the Triton kernels where present
        monkeypatch.setenv("JETRL_DISABLE_TRITON", disable)
        reset_kernel_caches()  # the variable is read once per process
        invalidate_weight_caches(q)
        q.weight.grad = q.bias.grad = None
        with use_gemm_backend("emulated"):
            results.append(_run(q, x, dy))
    (y0, g0), (y1, g1) = results
    assert_bits_equal(y1, y0, "y")
    for a, b, what in zip(g1, g0, ("dx", "dw", "db")):
        assert_bits_equal(a, b, what)


def test_deepcopy_drops_the_weight_cache():
    import copy

    _, q = _pair()
    x = torch.randn(3, 200)
    y = q(x)
    clone = copy.deepcopy(q)
    assert clone._weight_cache == {} and clone.weight is not q.weight
    assert torch.equal(clone(x), y) and q._weight_cache


def test_forced_gemm_backend_also_drives_the_backward_gemms():
    # Autograd may run backward on its own thread, where a thread-local forcing would be lost:
    # the Function records the forced backend in forward and passes it to its backward GEMMs.
    from jetrl_trainer import kernels
    from jetrl_trainer.kernels import gemm

    calls = []
    emulated = gemm._backends["emulated"].fn

    def spy(*args):
        calls.append(args[4])  # b_granularity: "block" for fwd/dgrad, "group" for wgrad
        return emulated(*args)

    kernels.register_gemm_backend("spy", spy, is_available=True, priority=-1)
    try:
        layer = QuantLinear.from_linear(torch.nn.Linear(256, 128), {"train": "fp8", "rollout": "fp8"})
        x = torch.randn(4, 256, requires_grad=True)
        with kernels.use_gemm_backend("spy"):
            y = layer(x)
        y.sum().backward()  # outside the block: only the recorded name can route these to "spy"
        assert calls == ["block", "block", "group"]
    finally:
        del gemm._backends["spy"]
        kernels.reset_kernel_caches()


@pytest.mark.parametrize("name", ["fp8", "fp8_ue8m0", "nvfp4_dequantized"])
def test_forward_backward_trace_in_one_graph_with_the_eager_bits(name):
    # A captured actor update (issue 16) compiles the policy: the weight cache and the fused-quant
    # hand-off (side effects on tensors, untraceable) step aside while tracing; the bits stay the eager ones.
    torch._dynamo.reset()
    _, q = _pair(256, 384, recipes=RECIPES[name])
    x, dy = torch.randn(64, 256), torch.randn(64, 384)
    with PrecisionPhases(q).train():
        eager = _run(q, x, dy)
        q.weight.grad = q.bias.grad = None
        before = q.weight_quantizations
        compiled = torch.compile(q, backend="aot_eager", fullgraph=True)
        traced = _run(compiled, x, dy)
    assert q.weight_quantizations == before  # quantized inside the graph, not through the cache
    assert_bits_equal(traced[0], eager[0])
    for got, want in zip(traced[1], eager[1]):
        assert_bits_equal(got, want)


def test_a_quantized_decoder_traces_forward_and_backward_in_one_graph():
    from jetrl_trainer.kernels import reset_kernel_caches, resolve_dispatch
    from jetrl_trainer.quant import quantize_model
    from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

    torch._dynamo.reset()
    model = build_tiny_qwen3(build_tiny_tokenizer(), num_hidden_layers=2, seed=0)
    quantize_model(model, train="fp8", rollout="fp8")
    ids = torch.randint(0, 100, (2, 64))
    reset_kernel_caches()  # as in a cold process: the trace comes first, so the dispatch is resolved up front
    resolve_dispatch("cpu")

    def loss(ids):
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1).mean()

    with PrecisionPhases(model).train():
        traced = torch.compile(loss, backend="aot_eager", fullgraph=True)(ids)
        traced.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        eager = loss(ids)
        eager.backward()
    assert_bits_equal(traced, eager)
    for p, want in zip(model.parameters(), grads):
        assert_bits_equal(want, p.grad)


# -- on CUDA -------------------------------------------------------------------------------------------------
# Two kinds of check:
# * exact: on CUDA, the Triton kernels and the pure-torch reference quantizers feed the same GEMM
#   bit-identical operands, so forward and both gradients are bit-identical
#   (``JETRL_DISABLE_TRITON=1`` switches ``quant/_dispatch.py`` to the reference);
# * close: CUDA vs CPU. Not bit-exact by construction: the GEMM sums in another order, and ATen's
#   CPU reference divides ``amax / 448`` where CUDA multiplies by the reciprocal (last scale bit).
# The backend is forced with ``JETRL_GEMM_BACKEND``: ``use_gemm_backend`` is thread-local and the
# autograd engine runs CUDA backward passes on its own thread, where it does not apply.
# Capture in a CUDA graph fails on any host sync (``.item()``, ``.cpu()``, autotuning) or CPU-side
# allocation decisions that depend on data; replays must reproduce eager results bit for bit on new data.


def _layer(device, n_in=1000, n_out=700, bias=True):
    from jetrl_trainer.quant import QuantLinear

    torch.manual_seed(0)
    return QuantLinear(n_in, n_out, bias=bias, device=device, dtype=torch.bfloat16)


def _y_and_grads(layer, x, dy):
    layer.weight.grad = None
    if layer.bias is not None:
        layer.bias.grad = None
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return [y.detach(), x.grad, layer.weight.grad] + ([layer.bias.grad] if layer.bias is not None else [])


@pytest.mark.gpu
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
    fast = _y_and_grads(layer, x, dy)
    monkeypatch.setenv("JETRL_DISABLE_TRITON", "1")
    reset_kernel_caches()
    layer.set_recipes(train=FP8Recipe(scale_format=scale_format))  # drop the cached FP8 weight
    slow = _y_and_grads(layer, x, dy)
    for f, s, what in zip(fast, slow, ("y", "dx", "dw", "db")):
        assert_bits_equal(f, s, what)


@pytest.mark.gpu
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
        want = [t.clone() for t in _y_and_grads(layer, x, dy)]
        layer.set_recipes(train=FP8Recipe(kernels=tuned))
        for got, expected, what in zip(_y_and_grads(layer, x, dy), want, ("y", "dx", "dw", "db")):
            assert_bits_equal(got, expected, what)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", gpu_gemm_backends())
def test_gpu_matches_cpu_reference(backend, monkeypatch):
    cpu, gpu = _layer("cpu"), _layer("cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(2, 150, 1000, dtype=torch.bfloat16)
    dy = torch.randn(2, 150, 700, dtype=torch.bfloat16)
    want = _y_and_grads(cpu, x, dy)
    monkeypatch.setenv("JETRL_GEMM_BACKEND", backend)
    reset_kernel_caches()
    got = _y_and_grads(gpu, x.cuda(), dy.cuda())
    for g, w, what in zip(got, want, ("y", "dx", "dw", "db")):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        assert relative_error(g.cpu(), w) < 1e-2, (what, relative_error(g.cpu(), w))


@pytest.mark.gpu
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


@pytest.mark.gpu
@TRITON
@pytest.mark.parametrize("backend", gpu_gemm_backends())
def test_quant_linear_forward_backward_capture(backend, monkeypatch):
    from jetrl_trainer.quant import QuantLinear

    torch.manual_seed(0)
    layer = QuantLinear(1024, 768, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 100, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 100, 768, device="cuda", dtype=torch.bfloat16)
    out = {}

    monkeypatch.setenv("JETRL_GEMM_BACKEND", backend)  # process-wide: backward runs on autograd's thread
    reset_kernel_caches()  # the variable is read once per process

    def step():
        layer.weight.grad = layer.bias.grad = x.grad = None
        y = layer(x)
        y.backward(dy)
        out["y"] = y

    graph = capture_graph(step)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        dy.copy_(torch.randn_like(dy))
    graph.replay()
    torch.cuda.synchronize()
    got = [t.detach().clone() for t in (out["y"], x.grad, layer.weight.grad, layer.bias.grad)]
    step()
    want = [out["y"].detach(), x.grad, layer.weight.grad, layer.bias.grad]
    for g, w, what in zip(got, want, ("y", "dx", "dw", "db")):
        assert_bits_equal(g, w, what)
    assert layer.weight_quantizations == 1  # the cached FP8 weight was reused inside the graph


@pytest.mark.gpu
def test_a_graph_replayed_after_an_optimizer_step_sees_the_new_weights():
    """The FP8 weight cache refreshes in place, so a captured graph reads the updated weights."""
    from jetrl_trainer.quant import QuantLinear

    layer = QuantLinear(256, 384, bias=False, device="cuda", dtype=torch.bfloat16, train="fp8", rollout="fp8")
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    with torch.no_grad(), PrecisionPhases(layer).rollout():
        layer(x)  # fill the cache, warm the kernels
        graph, static = torch.cuda.CUDAGraph(), torch.empty(16, 384, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static.copy_(layer(x))
        graph.replay()
        before = static.clone()
    layer(x.requires_grad_()).float().pow(2).sum().backward()
    opt.step()
    with torch.no_grad(), PrecisionPhases(layer).rollout():
        eager = layer(x.detach())  # refreshes the cache (in place)
        graph.replay()
    assert not torch.equal(before, eager)
    assert torch.equal(static, eager)
