"""CPU-side checks of the GPU kernel modules: import without Triton/CUDA, registry, layouts, references."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from jetrl_trainer.kernels import available_gemm_backends, fp8_gemm_nt, registered_gemm_backends
from jetrl_trainer.kernels.scaled_mm import M_ALIGN, prepare_scaled_mm_operands, scaled_mm_available
from jetrl_trainer.kernels.triton_gemm import triton_gemm_available
from jetrl_trainer.quant.fp8 import quantize_fp8_blocks, quantize_fp8_groups


def test_kernels_import_and_fall_back_without_triton():
    # A fresh interpreter in which `import triton` fails, whatever is installed here.
    code = textwrap.dedent(
        """
        import sys, torch
        sys.modules["triton"] = None
        import jetrl_trainer.kernels as k
        from jetrl_trainer.quant import _dispatch
        assert not k.triton_available()
        for name in ("act_quant_fp8", "weight_quant_fp8", "requant_transpose_fp8", "transpose_fp8_blocks",
                     "rmsnorm_quant_fp8", "swiglu_quant_fp8"):
            assert callable(getattr(k, name)), name
        assert {"scaled_mm", "triton", "emulated"} <= set(k.registered_gemm_backends())
        assert k.available_gemm_backends("cpu") == ["emulated"]
        try:
            k.act_quant_fp8(torch.ones(2, 128))
        except ValueError as e:
            assert "CUDA" in str(e)
        else:
            raise AssertionError("a CPU tensor must be refused")
        q, s = _dispatch.act_quant_fp8(torch.ones(2, 128))  # the reference runs instead
        assert torch.equal(s, torch.ones(2, 1) / 448.0) and torch.equal(q.float(), torch.full((2, 128), 448.0))
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_cpu_path_survives_broken_gpu_modules():
    # Every GPU module raises on import (a broken build, an ABI mismatch), not just "Triton absent":
    # the package must still import, say what it skipped, and the CPU path must run on references.
    code = textwrap.dedent(
        """
        import importlib.abc, importlib.machinery, sys
        GPU = ("scaled_mm", "triton_gemm", "deepgemm", "triton_quant", "triton_norm", "triton_swiglu")
        BROKEN = {f"jetrl_trainer.kernels.{name}" for name in GPU}

        class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path, target=None):
                return importlib.machinery.ModuleSpec(name, self) if name in BROKEN else None
            def create_module(self, spec):
                return None
            def exec_module(self, module):
                raise RuntimeError("simulated broken GPU build")

        sys.meta_path.insert(0, Broken())
        import torch
        import jetrl_trainer.quant as quant
        from jetrl_trainer import kernels
        from jetrl_trainer.quant.fused import fuse_norm_and_swiglu
        from jetrl_trainer.quant.reference import rmsnorm_reference
        from jetrl_trainer.quant.testing import assert_bits_equal
        from jetrl_trainer.tiny import build_tiny_qwen3

        assert all(kernels.optional_module(name) is None for name in GPU)
        assert kernels.registered_gemm_backends() == ["emulated"]
        assert not hasattr(kernels, "act_quant_fp8")  # re-exports of a failed module are absent

        torch.manual_seed(0)
        layer = quant.QuantLinear(256, 64, train="fp8", rollout="fp8")
        x = torch.randn(5, 256, requires_grad=True)
        y = layer(x)
        y.sum().backward()
        xq, wq = quant.quantize_fp8_groups(x.detach()), quant.quantize_fp8_blocks(layer.weight.detach())
        want = kernels.fp8_gemm_nt(xq, wq, out_dtype=torch.float32) + layer.bias.detach()
        assert_bits_equal(y.detach(), want, "QuantLinear forward")
        assert x.grad is not None and layer.weight.grad is not None

        model = fuse_norm_and_swiglu(quant.quantize_model(build_tiny_qwen3()))
        norm = model.model.layers[0].input_layernorm
        assert type(norm).__name__ == "FusedRMSNorm"
        h = torch.randn(2, 3, norm.weight.shape[0])
        assert_bits_equal(norm(h), rmsnorm_reference(h, norm.weight, norm.variance_epsilon), "FusedRMSNorm")
        model(torch.randint(0, model.config.vocab_size, (2, 7))).logits.sum().backward()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    for name in ("triton_quant", "triton_norm", "triton_swiglu"):
        assert f"skipping jetrl_trainer.kernels.{name} (RuntimeError: simulated broken GPU build)" in out.stderr


def test_registry_on_cpu():
    assert {"scaled_mm", "triton", "emulated"} <= set(registered_gemm_backends())
    assert available_gemm_backends("cpu") == ["emulated"]
    assert not scaled_mm_available(torch.device("cpu"))
    assert not triton_gemm_available(torch.device("cpu"))
    order = registered_gemm_backends()
    assert order.index("scaled_mm") < order.index("triton") < order.index("emulated")


def test_forcing_a_gpu_backend_on_cpu_is_a_value_error():
    a = quantize_fp8_groups(torch.randn(4, 128))
    b = quantize_fp8_blocks(torch.randn(8, 128))
    with pytest.raises(ValueError, match="not available"):
        fp8_gemm_nt(a, b, backend="scaled_mm")


def _is_blockwise_1x128(t: torch.Tensor, scale: torch.Tensor) -> bool:
    # Python transcription of ATen's is_blockwise_1x128_scaling (ScaledBlas.cpp).
    return (
        scale.dtype == torch.float32
        and scale.dim() == 2
        and scale.shape == (t.shape[0], -(-t.shape[1] // 128))
        and (scale.shape[0] == 1 or scale.stride(0) == 1)  # ATen ignores the stride of a size-1 dim
        and (scale.shape[1] == 1 or scale.stride(1) == t.shape[0])
    )


def _is_blockwise_128x128(t: torch.Tensor, scale: torch.Tensor) -> bool:
    groups = -(-t.shape[1] // 128)
    return (
        scale.dtype == torch.float32
        and scale.shape == (-(-t.shape[0] // 128), groups)
        and scale.stride(0) in (groups, -(-groups // 4) * 4)
        and scale.stride(1) == 1
    )


@pytest.mark.parametrize("granularity", ("block", "group"))
@pytest.mark.parametrize("m,n,k", [(7, 100, 300), (64, 256, 512), (1, 130, 640), (33, 48, 100)])
def test_scaled_mm_operands_layout_and_padding(m, n, k, granularity):
    torch.manual_seed(m + n + k)
    a_q, a_s = quantize_fp8_groups(torch.randn(m, k))
    b_q, b_s = quantize_fp8_blocks(torch.randn(n, k)) if granularity == "block" else quantize_fp8_groups(torch.randn(n, k))
    a, b, sa, sb = prepare_scaled_mm_operands(a_q, a_s, b_q, b_s, granularity)
    k_pad = -(-k // 512) * 512  # ceil(K/128) rounded up to a multiple of 4 groups
    n_pad, m_pad = -(-n // 16) * 16, -(-m // M_ALIGN) * M_ALIGN
    assert a.shape == (m_pad, k_pad) and a.is_contiguous()
    assert b.shape == (k_pad, n_pad) and b.stride() == (1, k_pad)  # column-major [K, N]
    assert _is_blockwise_1x128(a, sa)
    bt = b.t()  # ATen checks scale_b.t() against b.t() = [N', K'] row-major
    assert (_is_blockwise_128x128 if granularity == "block" else _is_blockwise_1x128)(bt, sb.t())
    # Padding adds exact zeros: the emulated GEMM on padded operands equals the unpadded one.
    want = fp8_gemm_nt((a_q, a_s), (b_q, b_s), b_granularity=granularity, out_dtype=torch.float32)
    b_rows = bt.contiguous()
    sb_rows = sb.t().contiguous()
    got = fp8_gemm_nt((a, sa.contiguous()), (b_rows, sb_rows), b_granularity=granularity, out_dtype=torch.float32)
    assert torch.equal(got[:m, :n], want)
    assert not got[m:].any() and not got[:, n:].any()  # padding contributes exact zeros


def test_custom_op_fake_shapes_on_meta():
    import jetrl_trainer.kernels  # noqa: F401  (registers the ops)

    x = torch.empty(300, 520, device="meta", dtype=torch.bfloat16)
    q, s = torch.ops.jetrl.act_quant_fp8(x, 128, "fp32", [16, 2, 4], [64, 1, 4])
    assert q.shape == (300, 520) and q.dtype == torch.float8_e4m3fn and s.shape == (300, 5) and s.is_contiguous()
    qt, st = torch.ops.jetrl.requant_transpose_fp8(q, s, 128, "fp32", 32, 4)
    assert qt.shape == (520, 300) and st.shape == (520, 3) and st.is_contiguous()
    wq, ws = torch.ops.jetrl.weight_quant_fp8(x, 128, "fp32", 16)
    assert ws.shape == (3, 5)
    wt, wst = torch.ops.jetrl.transpose_fp8_blocks(wq, ws, [64, 256, 8])
    assert wt.shape == (520, 300) and wst.shape == (5, 3)
    y, q2, s2 = torch.ops.jetrl.rmsnorm_quant_fp8(x, torch.empty(520, device="meta", dtype=torch.float32), 1e-6, "fp32",
                                                  True)  # fmt: skip
    assert y.dtype == torch.float32 and s2.shape == (300, 5)
    _, q3, s3 = torch.ops.jetrl.rmsnorm_quant_fp8(x, torch.empty(520, device="meta"), 1e-6, "fp32", False)
    assert q3.shape == (0, 520) and s3.shape == (0, 5)  # no consumer GEMM: y only
    out = torch.ops.jetrl.triton_fp8_gemm_nt(q, s, wq[:, :520], torch.empty(300, 5, device="meta"), False, torch.bfloat16)
    assert out.shape == (300, 300) and out.dtype == torch.bfloat16


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
