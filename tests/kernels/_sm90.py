"""Every Triton kernel compiles for the H200 (sm_90) on a machine without a GPU (``.ci/interpret.sh``).

Triton compiles ahead of time for a named target (its wheel ships ``ptxas``), so CI catches a kernel
that no longer compiles, or a variant that lost the instructions it exists for (Hopper's wgmma, the
pipelined loads' asynchronous copies, the quant kernels' saturating FP8 cast and IEEE division that
the numerics contract relies on), before a GPU session spends device time on it. Run without
``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` functions).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("JETRL_COMPILE_SM90") != "1" or importlib.util.find_spec("triton") is None
    or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs Triton, JETRL_COMPILE_SM90=1 and no TRITON_INTERPRET (.ci/interpret.sh)",
)  # fmt: skip


def _compile(fn, pointers: dict[str, str], constexprs: dict, floats=(), launch=None, odd=()) -> str:
    """PTX of ``fn`` for sm_90: pointer / descriptor types by name, FP32 scalars, every other argument i32.

    As a launch on the engine's shapes would, every pointer and integer argument but those in ``odd``
    is specialized as divisible by 16 (Triton does so for any multiple of 16), which is what lets it
    vectorize loads and stores."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
        if signature[name].startswith("*") or (signature[name] == "i32" and name not in odd):
            attrs[(index,)] = [["tt.divisibility", 16]]
    missing = [n for n in fn.arg_names if n.endswith("_ptr") and n not in pointers]
    assert not missing, f"give a pointer type for {missing}"
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch or {}).asm["ptx"]


def _gemm_pointers() -> dict[str, str]:
    types = dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", w1_ptr="*fp8e4nv", w2_ptr="*fp8e4nv", out_ptr="*bf16",
                 out1_ptr="*bf16", out2_ptr="*bf16")  # fmt: skip
    for name in ("xs_ptr", "ws_ptr", "part_ptr", "bias_ptr", "ws1_ptr", "bias1_ptr", "ws2_ptr", "bias2_ptr"):
        types[name] = "*fp32"
    return types


@pytest.mark.parametrize("block_m, block_n, swap, segments", [(16, 64, True, 3), (64, 64, False, 1), (64, 128, False, 2)])
def test_decode_gemm_compiles_with_wgmma_and_pipelined_loads(block_m, block_n, swap, segments):
    """The shipped launch (``DecodeGemmSettings()``'s warps and stages): Hopper's wgmma, and the tile
    loads pipelined (asynchronous copies into shared memory; two scale look-aheads made Triton 3.6
    load the tiles synchronously instead)."""
    from jetrl_trainer.kernels.settings import DecodeGemmSettings

    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_gemm_jit")
    settings = DecodeGemmSettings()
    constexprs = dict(GROUPS_PER_SPLIT=4, SPLITS=2, BLOCK_M=block_m, BLOCK_N=block_n, SWAP=swap, HAS_BIAS=False,
                      SEGMENTS=segments, PARTIALS=False)  # fmt: skip
    ptx = _compile(jit.fp8_decode_gemm_kernel, _gemm_pointers(), constexprs,
                   launch=dict(num_warps=settings.num_warps, num_stages=settings.num_stages))  # fmt: skip
    assert "wgmma" in ptx
    assert "cp.async.cg.shared.global" in ptx


@pytest.mark.parametrize("partials", [False, True])
def test_one_split_grouped_launch_stores_its_partials_only_where_asked(partials):
    """``PARTIALS`` (``fp8_decode_gemm_grouped_partials`` with one K split): the FP32 sums go to the
    partials layout, and the output dtype's conversion and the bias are gone."""
    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_gemm_jit")
    constexprs = dict(GROUPS_PER_SPLIT=4, SPLITS=1, BLOCK_M=16, BLOCK_N=64, SWAP=True, HAS_BIAS=True, SEGMENTS=3,
                      PARTIALS=partials)  # fmt: skip
    ptx = _compile(jit.fp8_decode_gemm_kernel, _gemm_pointers(), constexprs, launch=dict(num_warps=4, num_stages=3))
    assert "wgmma" in ptx
    assert ("cvt.rn.bf16" in ptx) != partials  # the BF16 output's rounding only without partials


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
FUSED_KERNELS = {
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


@pytest.mark.parametrize("name", list(QUANT_KERNELS) + list(FUSED_KERNELS))
def test_quant_kernels_compile_to_the_saturating_cast_and_ieee_division(name):
    module = "_triton_quant_jit" if name in QUANT_KERNELS else "_triton_fused_jit"
    jit = importlib.import_module(f"jetrl_trainer.kernels.{module}")
    pointers, constexprs, launch, floats = {**QUANT_KERNELS, **FUSED_KERNELS}[name]
    ptx = _compile(getattr(jit, name.split("[")[0]), pointers, constexprs, floats=floats, launch=launch)
    assert _fp8_cast_and_division(ptx)


def test_the_other_kernels_compile():
    """The FP8 weight transpose, RMSNorm's backward, the Triton FP8 GEMM, RoPE + append, and the sampler's sums."""
    quant = importlib.import_module("jetrl_trainer.kernels._triton_quant_jit")
    fused = importlib.import_module("jetrl_trainer.kernels._triton_fused_jit")
    gemm = importlib.import_module("jetrl_trainer.kernels._triton_gemm_jit")
    rope = importlib.import_module("jetrl_trainer.kernels._triton_rope_jit")
    sampling = importlib.import_module("jetrl_trainer.kernels._triton_sampling_jit")
    _compile(quant.transpose_u8_kernel, dict(x_ptr="*u8", y_ptr="*u8"), dict(BLOCK_R=64, BLOCK_C=256),
             launch=dict(num_warps=8))  # fmt: skip
    _compile(fused.rmsnorm_backward_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", dy_ptr="*bf16", dx_ptr="*bf16",
                                                 dw_part_ptr="*fp32"),
             dict(BLOCK_K=128, ROWS=32), floats=("k_float", "eps"), launch=dict(num_warps=8))  # fmt: skip
    ptx = _compile(gemm.fp8_gemm_nt_kernel, dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", as_ptr="*fp32",
                                                 bs_ptr="*fp32"),
                   dict(B_BLOCK=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
                   launch=dict(num_warps=8, num_stages=4))  # fmt: skip
    assert "wgmma" in ptx
    for splits, qkv in ((0, "*bf16"), (3, "*fp32")):  # q/k/v as such, or a grouped GEMM's split sums
        _compile(rope.rope_append_kernel, dict(q_ptr=qkv, k_ptr=qkv, v_ptr=qkv, cos_ptr="*bf16", sin_ptr="*bf16",
                                               q_out_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
                                               slots_ptr="*i64", positions_ptr="*i64", k_scale_ptr="*bf16",
                                               v_scale_ptr="*bf16", q_norm_ptr="*bf16", k_norm_ptr="*bf16",
                                               q_bias_ptr="*bf16", k_bias_ptr="*bf16", v_bias_ptr="*bf16"),
                 dict(H=32, D=128, KV_FP8=False, NORM=True, LEVELS=6, SPLITS=splits, HAS_BIAS=splits > 0),
                 floats=("q_eps", "k_eps"), launch=dict(num_warps=1, enable_fp_fusion=False))  # fmt: skip
    ptx = _compile(sampling.block_sums_fp64_kernel, dict(p_ptr="*fp32", out_ptr="*fp64"), dict(BLOCK=1024),
                   launch=dict(num_warps=4))  # fmt: skip
    assert "add.f64" in ptx or "add.rn.f64" in ptx


_ATTENTION_POINTERS = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", slots_ptr="*i64", lengths_ptr="*i64",
                           pads_ptr="*i64", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", ks_ptr="*fp32",
                           vs_ptr="*fp32", out_ptr="*bf16", oq_ptr="*u8", os_ptr="*fp32")  # fmt: skip


@pytest.mark.parametrize("direct, quant, flash_order, pads", [(True, True, False, True), (True, False, False, True),
                                                               (False, False, True, False), (True, True, True, True)])
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_decode_attention_compiles_with_pipelined_tile_loads(direct, quant, flash_order, pads, kv_fp8):
    """The split kernel in the engine's launches (8B head layout: 4 query heads per KV head, 128-position
    tiles, ``DecodeAttentionSettings()``): BF16 or FP8 caches, cuDNN or flash order, one split writing
    the output (with the o projection's FP8 quant) or partials; the shipped ``loop_stages`` turns the
    tile loads into asynchronous copies (what it exists for), and the query heads meet K and V in
    tensor-core MMAs."""
    from jetrl_trainer.kernels.settings import DecodeAttentionSettings

    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_attention_jit")
    settings = DecodeAttentionSettings()
    constexprs = dict(GROUPS=4, G_PAD=16, D=128, BLOCK_N=128, PRECISION="tf32", KV_FP8=kv_fp8, FLASH_ORDER=flash_order,
                      DIRECT=direct, H=32, QUANT=quant, UE8M0=False, HAS_PADS=pads, LOOP_STAGES=settings.loop_stages)
    pointers = dict(_ATTENTION_POINTERS, **(dict(k_ptr="*fp8e4nv", v_ptr="*fp8e4nv") if kv_fp8 else {}))
    ptx = _compile(jit.decode_attention_split_kernel, pointers, constexprs, floats=("scale", "scale_log2"),
                   launch=dict(num_warps=settings.num_warps))  # fmt: skip
    assert "mma.sync" in ptx
    assert settings.loop_stages < 2 or "cp.async.cg.shared.global" in ptx or "cp.async.ca.shared.global" in ptx
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == quant  # the output's FP8 quant only where asked


@pytest.mark.parametrize("splits, quant", [(2, False), (3, True), (8, True)])
def test_decode_attention_reduce_compiles(splits, quant):
    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_attention_jit")
    pointers = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*bf16", oq_ptr="*u8", os_ptr="*fp32")
    constexprs = dict(SPLITS=splits, S_PAD=max(2, 1 << (splits - 1).bit_length()), D=128, FLASH_ORDER=True, H=32,
                      QUANT=quant, UE8M0=False)  # fmt: skip
    ptx = _compile(jit.decode_attention_reduce_kernel, pointers, constexprs, floats=("m_scale",),
                   launch=dict(num_warps=4))  # fmt: skip
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == quant


@pytest.mark.parametrize("segments, bias", [(1, False), (3, True)])
def test_splitk_reduce_compiles(segments, bias):
    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_gemm_jit")
    pointers = dict(part_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", bias1_ptr="*bf16", out1_ptr="*bf16",
                    bias2_ptr="*bf16", out2_ptr="*bf16")  # fmt: skip
    constexprs = dict(SPLITS=3, HAS_BIAS=bias, BLOCK=1024, SEGMENTS=segments)
    ptx = _compile(jit.splitk_reduce_kernel, pointers, constexprs, launch=dict(num_warps=4))
    assert "ld.global" in ptx and "st.global" in ptx


def test_every_launched_kernel_is_compiled_here():
    """A kernel the package launches (``jit.<name>[grid](...)``) and this file never compiles would reach
    the H200 unchecked."""
    import pathlib
    import re

    kernels = pathlib.Path(importlib.import_module("jetrl_trainer.kernels").__file__).parent
    launched = {name for path in kernels.glob("*.py") for name in re.findall(r"jit\.(\w+)\[", path.read_text())}
    assert launched  # the pattern still finds the launches
    here = pathlib.Path(__file__).read_text()
    # compiled as ``<module>.<name>`` or listed as a ``"<name>"`` / ``"<name>[VARIANT]"`` key
    unchecked = {name for name in launched if not re.search(rf'(\.|"){name}\b', here)}
    assert not unchecked, f"launched by the package but never compiled here: {sorted(unchecked)}"
