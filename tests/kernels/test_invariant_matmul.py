"""The batch-invariant matmul kernel (`kernels/triton_invariant_matmul.py`, used by `jetrl_trainer.exact` on CUDA).

In the interpreter: it computes ``a @ b`` for ragged shapes and strided / broadcast operands, and its
launch modes (chunks spread or in program, narrow or wide tiles) agree bit for bit. On sm_90: it
compiles, with wgmma for BF16, at both tiles. On the GPU: a row's bits are the same alone, among other
rows (across the wide-tile switch), and in another batch, for BF16 and FP32 (where cuBLAS's batched
products were not), and the FP8 Triton
GEMM the exact mode uses for FP8 layers keeps a row's bits across M, across its 64-row config switch.
"""

from __future__ import annotations

import pytest
import torch
from _tensors import seeded_randn as _rand


@pytest.mark.interpreter
@pytest.mark.parametrize(("g", "m", "k", "n"), [(1, 5, 70, 33), (3, 64, 64, 64), (2, 130, 40, 129)])
def test_it_multiplies(g, m, k, n):
    from jetrl_trainer.kernels.triton_invariant_matmul import invariant_matmul

    a, b = _rand(g, m, k), _rand(g, k, n, seed=1)
    assert torch.allclose(invariant_matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
    shared = _rand(k, n, seed=2)[None].expand(g, k, n)  # one weight read by every batch (stride 0)
    assert torch.allclose(invariant_matmul(a, shared), a @ shared, rtol=1e-4, atol=1e-4)
    at = _rand(g, k, m, seed=3).transpose(1, 2)  # a column-major operand
    assert torch.allclose(invariant_matmul(at, b), at @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [64, 200, 257])
def test_spread_chunks_give_the_bits_of_chunks_summed_in_program(k):
    """K in chunks of 64 (1, 4 and 5 of them): the chunks in separate programs, added by the launcher,
    equal each program adding its own, bit for bit, for any M; and both are ``a @ b``."""
    from jetrl_trainer.kernels.settings import InvariantMatmulSettings
    from jetrl_trainer.kernels.triton_invariant_matmul import invariant_matmul

    settings = InvariantMatmulSettings(block_m=16, block_n=16, block_k_fp32=32, block_k=32, split_k=64)
    a, b = _rand(2, 37, k), _rand(2, k, 40, seed=1)
    in_program = invariant_matmul(a, b, settings, spread=False)
    assert torch.allclose(in_program, a @ b, rtol=1e-4, atol=1e-4)
    assert torch.equal(invariant_matmul(a, b, settings, spread=True), in_program)
    for rows in (1, 5, 16, 17):
        assert torch.equal(invariant_matmul(a[:, :rows], b, settings, spread=True), in_program[:, :rows])


@pytest.mark.interpreter
@pytest.mark.parametrize("spread", [False, True])
def test_a_wide_tile_gives_the_bits_of_a_narrow_one(spread):
    """The same sums at any tile: 37 rows in 32 x 32 tiles equal 1-37 rows in 16 x 16 ones, with K
    in 3 chunks. FP32 operands (the interpreter's BF16 dots are not BF16's); the tensor cores'
    rounding at either tile is the GPU test's (below)."""
    from jetrl_trainer.kernels.settings import InvariantMatmulSettings
    from jetrl_trainer.kernels.triton_invariant_matmul import invariant_matmul

    settings = InvariantMatmulSettings(block_m=16, block_n=16, block_k_fp32=32, block_k=32, split_k=64)
    a, b = _rand(2, 37, 150), _rand(2, 150, 40, seed=1)
    wide = invariant_matmul(a, b, settings, spread=spread, tile=(32, 32, 4))
    assert torch.allclose(wide, a @ b, rtol=1e-4, atol=1e-4)
    for rows in (1, 5, 16, 17, 37):
        assert torch.equal(invariant_matmul(a[:, :rows], b, settings, spread=spread, tile=(16, 16, 4)), wide[:, :rows])


def test_wide_tiles_can_be_turned_off():
    from jetrl_trainer.kernels.settings import InvariantMatmulSettings
    from jetrl_trainer.kernels.triton_invariant_matmul import _tile

    assert _tile(InvariantMatmulSettings(wide_from_rows=0), 100_000) == (64, 64, 4)
    assert _tile(InvariantMatmulSettings(), 256) == (128, 256, 8)
    assert _tile(InvariantMatmulSettings(), 256, ieee=True) == (64, 64, 4)  # FP32 operands stay narrow
    with pytest.raises(ValueError, match="wide_from_rows must be >= 0"):
        InvariantMatmulSettings(wide_from_rows=-1)


def test_split_k_must_be_a_multiple_of_the_k_steps():
    from jetrl_trainer.kernels.settings import InvariantMatmulSettings

    with pytest.raises(ValueError, match="split_k .* must be a multiple of block_k"):
        InvariantMatmulSettings(split_k=100)


@pytest.mark.sm90
def test_it_compiles_for_sm90_with_wgmma():
    from _sm90 import compile_sm90

    from jetrl_trainer.kernels._triton_invariant_matmul_jit import invariant_matmul_kernel

    for dtype, ieee, block_k in (("bf16", False, 64), ("fp32", True, 32)):
        for spread, tile in ((False, 128), (True, 64), (True, 128)):  # training forward's launch; decode's
            c_ptr = "*fp32" if spread else f"*{dtype}"
            ptx = compile_sm90(invariant_matmul_kernel, dict(a_ptr=f"*{dtype}", b_ptr=f"*{dtype}", c_ptr=c_ptr),
                               dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_K=block_k, CHUNK=2048, IEEE=ieee, SPREAD=spread),
                               launch=dict(num_warps=4), odd=("M",))  # fmt: skip
            assert ("wgmma" in ptx) == (dtype == "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_keeps_its_bits_across_m_and_batches(dtype):
    from jetrl_trainer.kernels.triton_invariant_matmul import invariant_matmul

    a, b = _rand(1, 300, 4096, dtype=dtype, device="cuda"), _rand(4096, 1024, dtype=dtype, device="cuda", seed=1)
    full = invariant_matmul(a, b[None])
    assert torch.allclose(full.float(), a.float() @ b.float(), rtol=2e-2, atol=5e-1)
    for rows in (1, 7, 64, 65, 200):
        assert torch.equal(invariant_matmul(a[:, :rows], b[None]), full[:, :rows])
    assert torch.equal(invariant_matmul(a[:, 100:101], b[None]), full[:, 100:101])
    batched = invariant_matmul(a.expand(5, 300, 4096), b[None].expand(5, 4096, 1024))
    assert all(torch.equal(batched[i], full[0]) for i in range(5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k", "n"), [(4096, 1024), (12288, 4096), (4096, 151936)])
def test_a_decode_steps_spread_chunks_keep_the_training_forwards_bits(dtype, k, n):
    """The shipped settings at Qwen3-8B's shapes: 64 decode rows with their K chunks spread over
    programs give the rows' bits in a training forward's 700 rows, whose programs add the chunks
    in the wide tile (``wide_from_rows``)."""
    from jetrl_trainer.kernels.triton_invariant_matmul import invariant_matmul

    a, b = _rand(1, 700, k, dtype=dtype, device="cuda"), _rand(k, n, dtype=dtype, device="cuda", seed=1)
    full = invariant_matmul(a, b[None], spread=False)
    for rows in (1, 64):
        assert torch.equal(invariant_matmul(a[:, :rows], b[None], spread=True), full[:, :rows])
        assert torch.equal(invariant_matmul(a[:, :rows], b[None]), full[:, :rows])


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 12288])
def test_the_fp8_triton_gemm_keeps_a_rows_bits_across_m(k):
    """Across its 64-row config switch, and with its K chunks (16 groups: 2 and 6 of them) spread over
    programs at decode rows and added in program at 300, and at a tile wider than a weight block."""
    from jetrl_trainer.kernels import fp8_gemm_nt
    from jetrl_trainer.kernels.settings import TritonGemmSettings
    from jetrl_trainer.kernels.triton_gemm import triton_fp8_gemm_nt
    from jetrl_trainer.quant.fp8 import quantize_fp8_blocks, quantize_fp8_groups

    x = _rand(300, k, dtype=torch.bfloat16, device="cuda")
    w = _rand(1024, k, dtype=torch.bfloat16, device="cuda", seed=1)
    wq = quantize_fp8_blocks(w)
    full = fp8_gemm_nt(quantize_fp8_groups(x), wq, out_dtype=torch.bfloat16, backend="triton")
    for rows in (1, 7, 64, 65, 200):
        assert torch.equal(fp8_gemm_nt(quantize_fp8_groups(x[:rows]), wq, out_dtype=torch.bfloat16, backend="triton"),
                           full[:rows]), rows  # fmt: skip
    # A tile wider than a weight block takes a scale per column instead of one per tile: the same products.
    wide = triton_fp8_gemm_nt(*quantize_fp8_groups(x), *wq, "block", torch.bfloat16,
                              settings=TritonGemmSettings(block_m=64, block_n=256))  # fmt: skip
    assert torch.equal(wide, full)


@pytest.mark.parametrize(("device", "dtypes"), [
    pytest.param("cpu", (torch.float32,), marks=pytest.mark.interpreter),  # its BF16 casts do not round to nearest
    pytest.param("cuda", (torch.float32, torch.bfloat16), marks=pytest.mark.gpu)])  # fmt: skip
def test_add_chunks_adds_in_order_from_zero_and_rounds_once(device, dtypes):
    """The launcher's sum of spread partials: the FP32 additions in chunk order, then one rounding."""
    from jetrl_trainer.kernels.triton_chunk_sum import add_chunks

    partials = (_rand(5, 3, 37, 41) * torch.logspace(-4, 4, 5)[:, None, None, None]).to(device)  # sums that round
    total = torch.zeros(3, 37, 41, device=device)
    for chunk in partials:
        total += chunk
    for dtype in dtypes:
        out = add_chunks(partials, torch.empty(3, 37, 41, dtype=dtype, device=device))
        assert torch.equal(out, total.to(dtype))
    with pytest.raises(ValueError, match="contiguous FP32"):
        add_chunks(partials.half(), torch.empty(3, 37, 41))


@pytest.mark.sm90
def test_the_chunk_sum_compiles_for_sm90():
    from _sm90 import compile_sm90

    from jetrl_trainer.kernels._triton_chunk_sum_jit import chunk_sum_kernel

    for out in ("*bf16", "*fp32"):
        assert compile_sm90(chunk_sum_kernel, dict(p_ptr="*fp32", out_ptr=out), dict(CHUNKS=6, BLOCK=1024),
                            launch=dict(num_warps=4), odd=("numel",))  # fmt: skip
