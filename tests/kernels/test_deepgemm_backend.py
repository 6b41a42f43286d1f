"""The DeepGEMM backend adapter (kernels/deepgemm.py), on CPU against a strict fake ``deep_gemm``.

The fake implements the SM90 contract read from DeepGEMM's source (see the module docstring): it
asserts argument structure, dtypes, shapes, majorness and TMA stride alignment, dispatches on the
recipe like ``fp8_fp4_gemm_nt`` (1D2D: BF16 ``d``, no ``c``; 1D1D: FP32 ``d`` and ``c``), and
computes ``d = c + deq(a) @ deq(b).T`` with the emulated backend's exact math.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
import types

import pytest
import torch

from jetrl_trainer.kernels import deepgemm as dg_module
from jetrl_trainer.kernels import fp8_gemm_nt, gemm, reset_kernel_caches, use_gemm_backend
from jetrl_trainer.kernels.emulated import emulated_fp8_gemm_nt
from jetrl_trainer.quant.fp8 import quantize_fp8_blocks, quantize_fp8_groups
from jetrl_trainer.quant.testing import assert_bits_equal, relative_error


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"fake DG_HOST_ASSERT: {what}")  # DeepGEMM's host asserts surface as RuntimeError


class FakeDeepGemm(types.ModuleType):
    """``deep_gemm`` with ``fp8_gemm_nt`` only, checking what DeepGEMM 2.x checks on SM90."""

    def __init__(self, fail: bool = False):
        super().__init__("deep_gemm")
        self.calls: list[dict] = []
        self.fail = fail

    def fp8_gemm_nt(self, a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                    disable_ue8m0_cast=False):
        if self.fail:
            raise RuntimeError("fake: JIT compilation failed")
        _check(len(a) == 2 and len(b) == 2, "a and b are (data, scale) pairs")
        (a_q, sfa), (b_q, sfb) = a, b
        for q in (a_q, b_q):
            _check(q.dtype == torch.float8_e4m3fn and q.dim() == 2, "FP8 E4M3 2-D operands")
            _check(q.stride(-1) == 1, "SM90 requires K-major A and B")
            _check(q.stride(0) % 16 == 0, "TMA global stride must be a multiple of 16 bytes")
        (m, k), (n, k2) = a_q.shape, b_q.shape
        _check(k == k2 and tuple(d.shape) == (m, n), "shapes [M, K] @ [N, K].T -> [M, N]")
        _check(d.dim() == 2 and d.stride(-1) == 1, "D must be N-major")
        _check(d.dtype in (torch.bfloat16, torch.float32), "D is BF16 or FP32")
        _check(d.stride(0) * d.element_size() % 16 == 0, "TMA: D row stride 16-byte aligned")
        _check(recipe_a is None and recipe_b is None, "this adapter uses `recipe`")
        _check(isinstance(compiled_dims, str) and set(compiled_dims) <= set("mnk"), "compiled_dims from 'mnk'")
        recipe = (1, 128, 128) if recipe is None else tuple(recipe)  # SM90 get_default_recipe
        _check(recipe in ((1, 128, 128), (1, 1, 128)), f"SM90 FP32 recipes only, got {recipe}")
        groups = math.ceil(k / 128)
        _check(sfa.dtype == torch.float32 and tuple(sfa.shape) == (m, groups), "sfa FP32 [M, ceil(K/128)]")
        if recipe[1] == 128:  # 1D2D
            _check(c is None and d.dtype == torch.bfloat16, "1D2D: BF16 D, no C")
            _check(tuple(sfb.shape) == (math.ceil(n / 128), groups), "sfb [ceil(N/128), ceil(K/128)]")
            _check(sfb.is_contiguous() or sfb.t().is_contiguous(), "SM90 sfb contiguous or transposed")
            granularity = "block"
        else:  # 1D1D (the wgrad kernel)
            _check(c is not None and d.dtype == torch.float32, "1D1D: FP32 D and C")
            _check(c.dtype == d.dtype and c.stride(-1) == 1, "C like D")
            if c.data_ptr() == d.data_ptr():
                _check(c.shape == d.shape and c.stride() == d.stride(), "C aliasing D must match it")
            _check(a_q.stride(0) == k and b_q.stride(0) == k, "1D1D TMA uses K as the row stride")
            _check(tuple(sfb.shape) == (n, groups), "sfb [N, ceil(K/128)]")
            granularity = "group"
        _check(sfb.dtype == torch.float32, "SM90 scales are FP32")
        self.calls.append({"k": k, "recipe": recipe, "compiled_dims": compiled_dims, "d_dtype": d.dtype,
                           "d_stride": d.stride(), "aliased": c is not None and c.data_ptr() == d.data_ptr()})
        result = emulated_fp8_gemm_nt(a_q, sfa, b_q, sfb, granularity, torch.float32)
        if c is not None:
            result = result + c.float()
        d.copy_(result.to(d.dtype))


@pytest.fixture
def load(monkeypatch):
    """Reload kernels/deepgemm.py against a given ``deep_gemm``, in a throwaway registry."""
    monkeypatch.setattr(gemm, "_backends", {k: v for k, v in gemm._backends.items() if k != "deepgemm"})
    monkeypatch.delenv("JETRL_GEMM_BACKEND", raising=False)
    reset_kernel_caches()

    def _load(fake, capability=(9, 0)):
        monkeypatch.setitem(sys.modules, "deep_gemm", fake)
        module = importlib.reload(dg_module)
        monkeypatch.setattr(module, "_cuda_capability", lambda device: capability)
        reset_kernel_caches()
        return module

    yield _load
    monkeypatch.undo()
    importlib.reload(dg_module)  # back to this environment's real deep_gemm (or none)
    reset_kernel_caches()


def _operands(m, n, k, granularity, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = quantize_fp8_groups(torch.randn(m, k, generator=g) * 3)
    w = torch.randn(n, k, generator=g) * 0.05
    b = quantize_fp8_blocks(w) if granularity == "block" else quantize_fp8_groups(w)
    return a, b


def test_not_registered_without_deep_gemm(load):
    module = load(None)  # None in sys.modules: `import deep_gemm` raises ModuleNotFoundError
    assert module._deep_gemm is None
    assert "deepgemm" not in gemm.registered_gemm_backends()
    assert not module.deepgemm_available("cuda")


def test_not_registered_without_fp8_gemm_nt(load):
    module = load(types.ModuleType("deep_gemm"))  # e.g. DeepGEMM 1.x, or built for CUDA < 12.1
    assert module._deep_gemm is None
    assert "deepgemm" not in gemm.registered_gemm_backends()


def test_registered_opt_in_and_sm90_only(load):
    load(FakeDeepGemm())
    names = gemm.registered_gemm_backends()
    assert names[0] == "deepgemm" and names.index("deepgemm") < names.index("scaled_mm")
    assert gemm.available_gemm_backends("cpu")[0] == "deepgemm"  # it can be forced ...
    assert "deepgemm" not in gemm.auto_gemm_backends("cpu")  # ... but never runs unasked (not yet GPU-tested)
    for capability, expected in (((9, 0), True), ((10, 0), False), ((8, 9), False), (None, False)):
        module = load(FakeDeepGemm(), capability=capability)
        assert module.deepgemm_available("cuda:0") is expected, capability


def test_automatic_order_is_the_gpu_proven_backends(load):
    # As on an H200 with every library present: the shipped priorities and opt-in flags decide.
    load(FakeDeepGemm())
    for name, backend in list(gemm._backends.items()):  # the fixture's throwaway copy
        gemm._backends[name] = dataclasses.replace(backend, is_available=True)
    reset_kernel_caches()
    assert gemm.available_gemm_backends("cuda") == ["deepgemm", "scaled_mm", "triton", "emulated"]
    assert gemm.auto_gemm_backends("cuda") == ["scaled_mm", "triton", "emulated"]


def test_real_capability_query_rejects_cpu(load):
    module = importlib.reload(load(FakeDeepGemm()))  # the real capability query, not the stand-in
    assert module._cuda_capability(torch.device("cpu")) is None
    assert not module.deepgemm_available("cpu")


def test_hand_computed(load):
    # a = 1.0 * 2 and b = 1.0 * 3 everywhere: every output is K * 6.
    module = load(FakeDeepGemm())
    m, n, k = 3, 5, 200
    a_q = torch.ones(m, k).to(torch.float8_e4m3fn)
    b_q = torch.ones(n, k).to(torch.float8_e4m3fn)
    a_s = torch.full((m, 2), 2.0)
    for granularity, b_s in (("block", torch.full((1, 2), 3.0)), ("group", torch.full((n, 2), 3.0))):
        out = module.deepgemm_fp8_gemm_nt(a_q, a_s, b_q, b_s, granularity, torch.float32)
        assert out.shape == (m, n) and out.dtype == torch.float32
        torch.testing.assert_close(out, torch.full((m, n), 1200.0), rtol=0, atol=0)


@pytest.mark.parametrize("out_dtype", (torch.bfloat16, torch.float32, torch.float16))
@pytest.mark.parametrize("granularity", ("block", "group"))
@pytest.mark.parametrize("m,n,k", ((1, 100, 300), (33, 130, 256), (7, 257, 129), (128, 128, 128)))
def test_matches_emulated(load, m, n, k, granularity, out_dtype):
    fake = FakeDeepGemm()
    load(fake)
    (a_q, a_s), (b_q, b_s) = _operands(m, n, k, granularity, seed=m + n + k)
    auto = fp8_gemm_nt((a_q, a_s), (b_q, b_s), b_granularity=granularity, out_dtype=out_dtype)
    assert fake.calls == [], "the automatic choice must not pick an opt-in backend"
    with use_gemm_backend("deepgemm"):
        out = fp8_gemm_nt((a_q, a_s), (b_q, b_s), b_granularity=granularity, out_dtype=out_dtype)
    assert len(fake.calls) == 1
    assert_bits_equal(auto, emulated_fp8_gemm_nt(a_q, a_s, b_q, b_s, granularity, out_dtype), "automatic")
    ref = emulated_fp8_gemm_nt(a_q, a_s, b_q, b_s, granularity, torch.float32).to(out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    assert_bits_equal(out, ref, "deepgemm adapter (fake)")
    call = fake.calls[0]
    assert call["k"] % 128 == 0 and call["k"] - k < 128  # ragged K zero-padded to whole groups
    assert call["d_stride"] == (-(-n // 8) * 8, 1)  # [M, N] view of an [M, round_up(N, 8)] buffer
    if granularity == "block" and out_dtype == torch.bfloat16:
        assert call["recipe"] == (1, 128, 128) and call["d_dtype"] == torch.bfloat16
    else:
        assert call["recipe"] == (1, 1, 128) and call["d_dtype"] == torch.float32 and call["aliased"]
    assert call["compiled_dims"] == ("nk" if granularity == "block" else "mn")


def test_forced_deepgemm_error_is_loud(load, monkeypatch):
    fake = FakeDeepGemm(fail=True)
    load(fake)
    (a_q, a_s), (b_q, b_s) = _operands(16, 64, 256, "block")
    with pytest.raises(NotImplementedError, match="DeepGEMM refused"):
        fp8_gemm_nt((a_q, a_s), (b_q, b_s), backend="deepgemm")
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "deepgemm")  # the documented opt-in
    reset_kernel_caches()
    with pytest.raises(NotImplementedError, match="DeepGEMM refused"):
        fp8_gemm_nt((a_q, a_s), (b_q, b_s))
    monkeypatch.delenv("JETRL_GEMM_BACKEND")
    reset_kernel_caches()
    out = fp8_gemm_nt((a_q, a_s), (b_q, b_s), out_dtype=torch.float32)  # automatic: never deepgemm
    assert_bits_equal(out, emulated_fp8_gemm_nt(a_q, a_s, b_q, b_s, "block", torch.float32), "automatic")


def test_empty_shapes_skip_deep_gemm(load):
    fake = FakeDeepGemm()
    module = load(fake)
    for m, n, k in ((0, 8, 128), (4, 0, 128), (4, 8, 0)):
        a_q = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
        b_q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        a_s, b_s = torch.ones(m, math.ceil(k / 128)), torch.ones(n, math.ceil(k / 128))
        out = module.deepgemm_fp8_gemm_nt(a_q, a_s, b_q, b_s, "group", torch.bfloat16)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16 and not out.any()
    assert fake.calls == []


def test_fake_is_strict():
    # The fake must reject what DeepGEMM rejects, or the adapter tests above prove nothing.
    fake = FakeDeepGemm()
    (a_q, a_s), (b_q, b_s) = _operands(8, 64, 256, "block")
    a_q, b_q = a_q.contiguous(), b_q.contiguous()  # quantize_fp8_blocks may return a strided view
    d32 = torch.empty(8, 64)
    with pytest.raises(RuntimeError, match="1D2D"):
        fake.fp8_gemm_nt((a_q, a_s), (b_q, b_s), d32)  # default recipe writes BF16 only
    with pytest.raises(RuntimeError, match="K-major"):
        fake.fp8_gemm_nt((a_q, a_s), (b_q.t().contiguous().t(), b_s), torch.empty(8, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="row stride"):
        fake.fp8_gemm_nt((a_q, a_s), (b_q[:60], b_s), torch.empty(8, 62, dtype=torch.bfloat16)[:, :60])
    with pytest.raises(RuntimeError, match="1D1D"):
        fake.fp8_gemm_nt((a_q, a_s), (b_q, b_s), d32, recipe=(1, 1, 128))  # no C


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ("block", "group"))
@pytest.mark.parametrize("m,n,k", ((1, 256, 512), (7, 100, 304), (200, 384, 640), (257, 1000, 1024)))
def test_real_deepgemm_matches_emulated(m, n, k, granularity):
    if not dg_module.deepgemm_available("cuda"):
        pytest.skip("needs the real deep_gemm and an SM90 GPU")
    assert "deepgemm" in gemm.available_gemm_backends("cuda")
    assert "deepgemm" not in gemm.auto_gemm_backends("cuda")  # opt-in until this test has passed
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-2, 2, m, device="cuda")[:, None]
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    a_q, a_s = quantize_fp8_groups(a)
    b_q, b_s = quantize_fp8_blocks(w) if granularity == "block" else quantize_fp8_groups(w)
    ref = emulated_fp8_gemm_nt(a_q, a_s, b_q, b_s, granularity, torch.float32).double()
    for out_dtype, tol in ((torch.float32, 3e-4), (torch.bfloat16, 4e-3)):
        out = fp8_gemm_nt((a_q, a_s), (b_q, b_s), b_granularity=granularity, out_dtype=out_dtype, backend="deepgemm")
        assert out.shape == (m, n) and out.dtype == out_dtype
        err = relative_error(out, ref)
        assert err < tol, (out_dtype, err)
