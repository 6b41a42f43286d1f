"""FP8 GEMM front door (kernels/gemm.py), its registry and the emulated backend (kernels/emulated.py)."""

import os
import types

import pytest
import torch

import jetrl_trainer.kernels as kernels
from jetrl_trainer.kernels import gemm
from jetrl_trainer.kernels.emulated import emulated_fp8_gemm_nt
from jetrl_trainer.quant.fp8 import (
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)
from jetrl_trainer.quant.testing import relative_error


@pytest.fixture
def registry(monkeypatch):
    """Register test backends into a copy of the registry that is thrown away afterwards."""
    monkeypatch.setattr(gemm, "_backends", dict(gemm._backends))
    monkeypatch.delenv("JETRL_GEMM_BACKEND", raising=False)
    kernels.reset_kernel_caches()
    yield gemm
    kernels.reset_kernel_caches()  # nothing resolved from the throwaway registry survives it


def _operands(m, n, k, granularity, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = quantize_fp8_groups(torch.randn(m, k, generator=g))
    w = torch.randn(n, k, generator=g) * 0.1
    b = quantize_fp8_blocks(w) if granularity == "block" else quantize_fp8_groups(w)
    return a, b


def _manual(a, b, granularity):
    deq_b = dequantize_fp8_blocks(*b) if granularity == "block" else dequantize_fp8_groups(*b)
    return (dequantize_fp8_groups(*a).double() @ deq_b.double().T).float()


@pytest.mark.parametrize("granularity", ["block", "group"])
@pytest.mark.parametrize("m,n,k", [(5, 7, 128), (33, 130, 300), (1, 257, 129)])
def test_emulated_matches_manual_dequant_matmul(granularity, m, n, k):
    a, b = _operands(m, n, k, granularity)
    out = kernels.fp8_gemm_nt(a, b, b_granularity=granularity, out_dtype=torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, _manual(a, b, granularity), rtol=1e-6, atol=1e-6)
    bf = kernels.fp8_gemm_nt(a, b, b_granularity=granularity)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, out.bfloat16())


def test_emulated_is_batch_invariant_bit_for_bit():
    a, b = _operands(40, 96, 384, "block", seed=3)
    full = kernels.fp8_gemm_nt(a, b, out_dtype=torch.float32)
    for rows in ([0], [7, 8, 9], list(range(0, 40, 3))):
        part = kernels.fp8_gemm_nt((a[0][rows], a[1][rows]), b, out_dtype=torch.float32)
        assert torch.equal(part, full[rows])


def test_emulated_propagates_nan():
    x = torch.ones(2, 256)
    x[1, 3] = float("nan")
    a = quantize_fp8_groups(x)
    b = quantize_fp8_blocks(torch.ones(3, 256))
    out = kernels.fp8_gemm_nt(a, b, out_dtype=torch.float32)
    torch.testing.assert_close(out[0], torch.full((3,), 256.0))
    assert out[1].isnan().all()


def test_emulated_is_registered_and_available_on_cpu():
    assert "emulated" in kernels.registered_gemm_backends()
    assert "emulated" in kernels.available_gemm_backends("cpu")


def test_auto_picks_highest_priority_available(registry):
    calls = []

    def fake(tag):
        def fn(a_q, a_s, b_q, b_s, gran, out_dtype):
            calls.append(tag)
            return torch.full((a_q.shape[0], b_q.shape[0]), float(len(tag)), dtype=out_dtype)
        return fn

    registry.register_gemm_backend("never", fake("never"), is_available=lambda d: False, priority=100)
    registry.register_gemm_backend("fast", fake("fast"), is_available=lambda d: d.type == "cpu", priority=50)
    assert registry.available_gemm_backends("cpu") == ["fast", "emulated"]
    assert registry.available_gemm_backends("meta") == ["emulated"]
    a, b = _operands(2, 3, 128, "block")
    out = registry.fp8_gemm_nt(a, b, out_dtype=torch.float32)
    assert calls == ["fast"] and out.eq(4.0).all()


def test_not_implemented_falls_back_in_auto_mode_only(registry):
    def picky(*args):
        raise NotImplementedError("ragged K")

    registry.register_gemm_backend("picky", picky, is_available=True, priority=10)
    a, b = _operands(3, 4, 130, "block")
    torch.testing.assert_close(registry.fp8_gemm_nt(a, b, out_dtype=torch.float32), _manual(a, b, "block"))
    with pytest.raises(NotImplementedError):
        registry.fp8_gemm_nt(a, b, backend="picky")


def test_forcing_a_backend(registry, monkeypatch):
    seen = []
    registry.register_gemm_backend(
        "spy", lambda *args: seen.append("spy") or emulated_fp8_gemm_nt(*args), is_available=True, priority=-1
    )
    a, b = _operands(3, 4, 128, "block")
    registry.fp8_gemm_nt(a, b)
    assert seen == []  # lower priority than emulated
    registry.fp8_gemm_nt(a, b, backend="spy")
    with registry.use_gemm_backend("spy"):
        registry.fp8_gemm_nt(a, b)
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "spy")
    kernels.reset_kernel_caches()  # the variable is read once per process
    registry.fp8_gemm_nt(a, b)
    assert seen == ["spy"] * 3
    with registry.use_gemm_backend("emulated"):  # the context manager wins over the env variable
        registry.fp8_gemm_nt(a, b)
    assert seen == ["spy"] * 3


def test_unknown_or_unavailable_backend_lists_the_options(registry, monkeypatch):
    on_cuda = lambda d: d.type == "cuda"  # noqa: E731
    registry.register_gemm_backend("gpu_only", emulated_fp8_gemm_nt, is_available=on_cuda, priority=5)
    a, b = _operands(2, 2, 128, "block")
    with pytest.raises(ValueError, match="registered: .*gpu_only.*emulated"):
        registry.fp8_gemm_nt(a, b, backend="cutlass")
    with pytest.raises(ValueError, match="registered: .*emulated"):
        with registry.use_gemm_backend("nope"):
            pass
    with pytest.raises(ValueError, match="not available on cpu; available: emulated"):
        registry.fp8_gemm_nt(a, b, backend="gpu_only")
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "nope")
    kernels.reset_kernel_caches()
    with pytest.raises(ValueError, match="Unknown GEMM backend 'nope'"):
        registry.fp8_gemm_nt(a, b)


def test_opt_in_backend_runs_only_when_forced(registry, monkeypatch):
    seen = []
    registry.register_gemm_backend(
        "unproven", lambda *args: seen.append(1) or emulated_fp8_gemm_nt(*args), is_available=True, priority=99,
        opt_in=True,
    )
    assert registry.registered_gemm_backends()[0] == "unproven"
    assert registry.available_gemm_backends("cpu") == ["unproven", "emulated"]  # it can be forced
    assert registry.auto_gemm_backends("cpu") == ["emulated"]  # but is never chosen automatically
    a, b = _operands(3, 4, 128, "block")
    registry.fp8_gemm_nt(a, b)
    assert seen == []
    registry.fp8_gemm_nt(a, b, backend="unproven")
    with registry.use_gemm_backend("unproven"):
        registry.fp8_gemm_nt(a, b)
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "unproven")
    kernels.reset_kernel_caches()
    registry.fp8_gemm_nt(a, b)
    assert seen == [1, 1, 1]


def test_order_availability_and_env_are_resolved_once(registry, monkeypatch):
    checks, sorts = [], []

    def counting_sorted(*args, **kwargs):
        sorts.append(1)
        return sorted(*args, **kwargs)

    monkeypatch.setattr(gemm, "sorted", counting_sorted, raising=False)  # shadows the builtin in gemm.py
    registry.register_gemm_backend(
        "probe", emulated_fp8_gemm_nt, is_available=lambda d: checks.append(d.type) or True, priority=5
    )
    a, b = _operands(3, 4, 128, "block")
    reads = []

    class CountingEnviron:  # gemm.py's view of os.environ, counting its reads
        def get(self, key, default=None):
            reads.append(key)
            return os.environ.get(key, default)

    monkeypatch.setattr(gemm, "os", types.SimpleNamespace(environ=CountingEnviron()))
    for _ in range(5):
        registry.fp8_gemm_nt(a, b)
    assert sorts == [1] and checks == ["cpu"] and reads.count("JETRL_GEMM_BACKEND") == 1
    # Registering another backend resets everything: it joins the automatic chain at once.
    registry.register_gemm_backend("late", emulated_fp8_gemm_nt, is_available=True, priority=7)
    assert registry.auto_gemm_backends("cpu") == ["late", "probe", "emulated"]
    assert sorts == [1, 1] and checks == ["cpu", "cpu"]
    # A changed variable is seen after an explicit reset, not before.
    registry.fp8_gemm_nt(a, b)
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "nope")
    registry.fp8_gemm_nt(a, b)
    assert reads.count("JETRL_GEMM_BACKEND") == 2  # once before "late" was registered, once after
    kernels.reset_kernel_caches()
    with pytest.raises(ValueError, match="Unknown GEMM backend 'nope'"):
        registry.fp8_gemm_nt(a, b)


def test_bad_operands_raise_value_error():
    a, b = _operands(2, 3, 128, "block")
    with pytest.raises(ValueError, match="block, group"):
        kernels.fp8_gemm_nt(a, b, b_granularity="tile")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kernels.fp8_gemm_nt((a[0].float(), a[1]), b)
    with pytest.raises(ValueError, match="K differs"):
        kernels.fp8_gemm_nt(a, quantize_fp8_blocks(torch.ones(3, 256)))
    with pytest.raises(ValueError, match=r"b scale must be float32 of shape \(3, 1\)"):
        kernels.fp8_gemm_nt(a, b, b_granularity="group")
    with pytest.raises(ValueError, match="a scale"):
        kernels.fp8_gemm_nt((a[0], a[1].double()), b)


@pytest.mark.gpu
def test_every_cuda_backend_agrees_with_emulated():
    a, b = _operands(256, 384, 512, "block", seed=5)
    a = tuple(t.cuda() for t in a)
    b = tuple(t.cuda() for t in b)
    ref = kernels.fp8_gemm_nt(a, b, out_dtype=torch.float32, backend="emulated")
    for name in kernels.available_gemm_backends("cuda"):
        out = kernels.fp8_gemm_nt(a, b, out_dtype=torch.float32, backend=name)
        # Hopper's FP8 MMA accumulates inside a 128-group with reduced precision: measured 1.2-1.5e-4
        # norm-wise relative to the exact FP64 group sums (docs/performance.md), so bound the norm.
        rel = relative_error(out, ref)
        assert rel < 3e-4, f"backend {name}: relative error {rel:.2e}"
