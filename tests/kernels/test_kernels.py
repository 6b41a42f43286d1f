"""The kernels package as a whole (kernels/__init__.py): it imports and falls back without Triton, CUDA or
with broken GPU modules; its custom ops' fake shapes, opcheck and torch.compile; every launched kernel
compiles for sm_90 (each kernel's own tests sit in the file of its module)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _sm90 import compile_sm90

from jetrl_trainer.kernels import triton_available
from jetrl_trainer.quant.fp8 import quantize_fp8_blocks, quantize_fp8_groups
from jetrl_trainer.quant.testing import assert_bits_equal

TRITON = pytest.mark.skipif(not triton_available(), reason="needs Triton")


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


@pytest.mark.interpreter  # the custom ops are defined where Triton is installed: CI's kernel step (.ci/interpret.sh)
def test_the_checkout_imported_as_kernels_defines_no_custom_op_again():
    """From the checkout's root (``python -m pytest`` puts it on ``sys.path``) the folder ``kernels/`` is also the
    top-level package ``kernels``, which transformers imports while probing for the Hub's ``kernels`` package
    (``is_kernels_available()``, where that package's metadata is missing). That import must not define the
    ``jetrl::`` custom ops a second time: torch.library would destroy the first definition, and the ops this
    package calls under torch.compile (``call_op``) would point at a freed operator, which dynamo's
    fake-tensor pass then calls (a segfault on CUDA)."""
    code = textwrap.dedent(
        """
        import importlib, sys, torch
        from torch._library.custom_ops import CustomOpDef
        import jetrl_trainer.kernels as k
        importlib.import_module("kernels")  # what the probe does; the checkout's root is sys.path[0]
        assert sys.modules["kernels"].__file__.endswith("kernels/__init__.py"), sys.modules["kernels"]
        ops = [v for module in k._loaded.values() for v in vars(module).values() if isinstance(v, CustomOpDef)]
        assert len(ops) >= 7, ops
        stale = [op._qualname for op in ops if op._opoverload is not getattr(torch.ops.jetrl, op._name).default]
        assert not stale, f"custom ops defined again, their OpOverloads dangle: {stale}"
        assert not [m for m in sys.modules if m.startswith("kernels.")], "GPU modules imported twice"
        print("ok")
        """
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


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
    kv, cache = torch.empty(4, 2, 64, device="meta"), torch.empty(5, 2, 9, 64, device="meta").to(torch.float8_e4m3fn)
    slots, lengths = torch.empty(4, device="meta").long(), torch.empty(5, device="meta").long()
    scales = torch.empty(5, 2, 9, device="meta")
    assert torch.ops.jetrl.kv_append(kv, kv, cache, cache, slots, lengths, scales, scales) is None  # it only writes


# -- on CUDA -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@TRITON
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
    fp8_kv_cache = [torch.zeros(4, 2, 16, 128, device="cuda").to(torch.float8_e4m3fn) for _ in range(2)]  # (S, H_kv, T, D)
    fp8_kv_scales = [torch.ones(4, 2, 16, device="cuda") for _ in range(2)]
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
        (torch.ops.jetrl.kv_append.default, (x[:3].view(3, 2, 128), x[3:6].view(3, 2, 128), *fp8_kv_cache,
                                             torch.tensor([3, 0, 2], device="cuda"),
                                             torch.tensor([5, 0, 15, 1], device="cuda"), *fp8_kv_scales)),
    ]
    for op, args in cases:
        # (opcheck's test_schema compares outputs with arithmetic that has no FP8 kernels)
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))


@pytest.mark.gpu
@TRITON
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


# -- compiled for sm_90 without a GPU (JETRL_COMPILE_SM90=1 pytest -m sm90) ----------------------------------


@pytest.mark.sm90
def test_the_other_kernels_compile():
    """The FP8 weight transpose, RMSNorm's backward, the Triton FP8 GEMM, RoPE + append, and the sampler's sums."""
    quant = importlib.import_module("jetrl_trainer.kernels._triton_quant_jit")
    fused = importlib.import_module("jetrl_trainer.kernels._triton_fused_jit")
    gemm = importlib.import_module("jetrl_trainer.kernels._triton_gemm_jit")
    rope = importlib.import_module("jetrl_trainer.kernels._triton_rope_jit")
    sampling = importlib.import_module("jetrl_trainer.kernels._triton_sampling_jit")
    compile_sm90(quant.transpose_u8_kernel, dict(x_ptr="*u8", y_ptr="*u8"), dict(BLOCK_R=64, BLOCK_C=256),
                 launch=dict(num_warps=8))  # fmt: skip
    compile_sm90(fused.rmsnorm_backward_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", dy_ptr="*bf16", dx_ptr="*bf16",
                                                     dw_part_ptr="*fp32"),
                 dict(BLOCK_K=128, ROWS=32), floats=("k_float", "eps"), launch=dict(num_warps=8))  # fmt: skip
    # training; decode; a tile wider than a weight block (a scale per column)
    for spread, c, tile, group, warps, one_scale in ((False, "*bf16", 128, 8, 8, True), (True, "*fp32", 64, 1, 4, True),
                                                     (False, "*bf16", 128, 8, 8, False)):  # fmt: skip
        ptx = compile_sm90(gemm.fp8_gemm_nt_kernel, dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr=c, as_ptr="*fp32",
                                                         bs_ptr="*fp32"),
                           dict(B_BLOCK=True, BLOCK_M=tile, BLOCK_N=tile, BLOCK_K=128, GROUP_M=group, CHUNK_GROUPS=16,
                                SPREAD=spread, ONE_B_SCALE=one_scale),
                           launch=dict(num_warps=warps, num_stages=4))  # fmt: skip
        assert "wgmma" in ptx
    for splits, qkv in ((0, "*bf16"), (3, "*fp32")):  # q/k/v as such, or a grouped GEMM's split sums
        compile_sm90(rope.rope_append_kernel, dict(q_ptr=qkv, k_ptr=qkv, v_ptr=qkv, cos_ptr="*bf16", sin_ptr="*bf16",
                                                   q_out_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
                                                   slots_ptr="*i64", positions_ptr="*i64", k_scale_ptr="*bf16",
                                                   v_scale_ptr="*bf16", q_norm_ptr="*bf16", k_norm_ptr="*bf16",
                                                   q_bias_ptr="*bf16", k_bias_ptr="*bf16", v_bias_ptr="*bf16"),
                     dict(H=32, D=128, KV_FP8=False, NORM=True, LEVELS=6, SPLITS=splits, HAS_BIAS=splits > 0),
                     floats=("q_eps", "k_eps"), launch=dict(num_warps=1, enable_fp_fusion=False))  # fmt: skip
    ptx = compile_sm90(sampling.block_sums_fp64_kernel, dict(p_ptr="*fp32", out_ptr="*fp64"), dict(BLOCK=1024),
                       launch=dict(num_warps=4))  # fmt: skip
    assert "add.f64" in ptx or "add.rn.f64" in ptx


@pytest.mark.sm90
@pytest.mark.parametrize("fp8", [False, True])
def test_kv_append_compiles(fp8):
    """The KV append alone (``KVCache.append`` on CUDA): an FP8 cache through the quant kernels' saturating
    cast and IEEE division (``fp8_kv_encode``'s bits); FP32 keys and BF16 values, as under autocast."""
    rope = importlib.import_module("jetrl_trainer.kernels._triton_rope_jit")
    cache, scale = ("*u8", "*fp32") if fp8 else ("*fp32", "*i64")  # not FP8: the scale pointers go unused
    ptx = compile_sm90(rope.kv_append_kernel, dict(k_ptr="*fp32", v_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache,
                                                   slots_ptr="*i64", lengths_ptr="*i64", k_scale_ptr=scale,
                                                   v_scale_ptr=scale),
                       dict(D=128, KV_FP8=fp8), launch=dict(num_warps=1, enable_fp_fusion=False))  # fmt: skip
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx) == fp8


@pytest.mark.sm90
def test_every_launched_kernel_is_compiled_here():
    """A kernel the package launches (``jit.<name>[grid](...)`` or ``load_jit("...").<name>[grid](...)``)
    and no ``sm90`` test of this folder compiles would reach the H200 unchecked."""
    import pathlib
    import re

    kernels = pathlib.Path(importlib.import_module("jetrl_trainer.kernels").__file__).parent
    launched = {name for path in kernels.glob("*.py") for name in re.findall(r"(?:jit|\))\.(\w+)\[", path.read_text())}
    assert launched  # the pattern still finds the launches
    sm90_files = (path.read_text() for path in pathlib.Path(__file__).parent.glob("test_*.py"))
    here = "".join(text for text in sm90_files if "@pytest.mark.sm90" in text)
    # compiled as ``<module>.<name>``, imported by name, or listed as a ``"<name>"`` / ``"<name>[VARIANT]"`` key
    unchecked = {name for name in launched if not re.search(rf'(\.|"|import ){name}\b', here)}
    assert not unchecked, f"launched by the package but never compiled here: {sorted(unchecked)}"
