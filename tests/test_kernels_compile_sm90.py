"""The decode kernels compile for the H200 (sm_90) on a machine without a GPU (``.ci/interpret.sh``).

Triton compiles ahead of time for a named target (its wheel ships ``ptxas``), so CI catches a kernel
that no longer compiles, or a variant that lost the instructions it exists for (TMA's bulk tensor
copies, Hopper's wgmma), before a GPU session spends device time on it. Run without
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


def _gemm_pointers(tma: bool, block_m: int, block_n: int) -> dict[str, str]:
    types = dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", w1_ptr="*fp8e4nv", w2_ptr="*fp8e4nv", out_ptr="*bf16",
                 out1_ptr="*bf16", out2_ptr="*bf16", xq_ptr="*u8")  # fmt: skip
    for name in ("xs_ptr", "ws_ptr", "part_ptr", "bias_ptr", "xqs_ptr", "ws1_ptr", "bias1_ptr", "ws2_ptr", "bias2_ptr"):
        types[name] = "*fp32"
    for name in ("x_desc", "w_desc", "w1_desc", "w2_desc"):
        rows = block_m if name == "x_desc" else block_n
        types[name] = f"tensordesc<fp8e4nv[{rows}, 128]>" if tma else "*fp8e4nv"
    return types


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("block_m, block_n, swap, segments", [(16, 64, True, 3), (64, 64, False, 1), (64, 128, False, 2)])
def test_decode_gemm_compiles_with_wgmma_and_tma_where_asked(tma, block_m, block_n, swap, segments):
    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_gemm_jit")
    constexprs = dict(GROUPS_PER_SPLIT=4, SPLITS=2, BLOCK_M=block_m, BLOCK_N=block_n, QUANTIZE=False, SWAP=swap,
                      HAS_BIAS=False, WRITE_Q=False, UE8M0=False, SEGMENTS=segments, PDL=False, PREFETCH_GROUPS=0,
                      TMA=tma)  # fmt: skip
    ptx = _compile(jit.fp8_decode_gemm_kernel, _gemm_pointers(tma, block_m, block_n), constexprs,
                   launch=dict(num_warps=4, num_stages=3))  # fmt: skip
    assert "wgmma" in ptx
    assert ("cp.async.bulk.tensor" in ptx) == tma


@pytest.mark.parametrize("kv_fp8, quant, flash_order", [(False, False, False), (False, True, False), (True, False, True)])
def test_decode_attention_compiles_with_a_pipelined_tile_loop(kv_fp8, quant, flash_order):
    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_attention_jit")
    kv = "*fp8e4nv" if kv_fp8 else "*bf16"
    pointers = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, slots_ptr="*i64", lengths_ptr="*i64", pads_ptr="*i64",
                    m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", ks_ptr="*fp32", vs_ptr="*fp32", out_ptr="*bf16",
                    oq_ptr="*u8", os_ptr="*fp32")  # fmt: skip
    constexprs = dict(GROUPS=4, G_PAD=16, D=128, BLOCK_N=128, PRECISION="tf32", KV_FP8=kv_fp8, FLASH_ORDER=flash_order,
                      DIRECT=True, H=32, QUANT=quant, UE8M0=False, PDL=False, HAS_PADS=True, LOOP_STAGES=2)  # fmt: skip
    ptx = _compile(jit.decode_attention_split_kernel, pointers, constexprs, floats=("scale", "scale_log2"),
                   launch=dict(num_warps=4), odd=("tiles",))  # fmt: skip
    assert "cp.async" in ptx  # the next tile's K/V loads are issued ahead (software pipelining)
