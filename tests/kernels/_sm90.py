"""Compiles a Triton kernel for the H100/H200 (sm_90) on a machine without a GPU: the ``sm90`` tests' helper.

Triton compiles ahead of time for a named target (its wheel ships ``ptxas``), so CI catches a kernel
that no longer compiles, or a variant that lost the instructions it exists for (Hopper's wgmma, the
pipelined loads' asynchronous copies, the quant kernels' saturating FP8 cast and IEEE division that
the numerics contract relies on), before a GPU session spends device time on it. Run without
``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` functions). Triton is imported only
when a kernel is compiled: the core suite collects without it.
"""

from __future__ import annotations


def compile_sm90(fn, pointers: dict[str, str], constexprs: dict, floats=(), launch=None, odd=()) -> str:
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
