"""Kernels' logic on CPU, in Triton's interpreter (``.ci/interpret.sh``): attention, GEMM, RoPE, sampler, RMSNorm.

The GPU tests check bits on the H200, in sessions that have one. These run the same ``@triton.jit``
code and the same host launch code on CPU tensors in every CI run (``TRITON_INTERPRET=1``), so a
change to a kernel's indexing, masking, tiling or launch plan is caught without a GPU. The
interpreter computes dots and exponentials in numpy, so the checks are against the references
(and between two launch variants that must agree bit for bit), not against GPU bits. The FP8
quantization kernels are not here: Triton 3.6's interpreter does not round float -> FP8 to nearest
even (84.0 became 88, not 80), so their bits can only be checked on a GPU (the fused RMSNorm's FP8
output too; its normalized output and scales are checked here).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from jetrl_trainer.quant.fp8 import (
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 with Triton installed (.ci/interpret.sh)",
)


@pytest.fixture(autouse=True)
def _scalar_loop_bounds(monkeypatch):
    """Triton 3.6's interpreter turns a scalar into a loop bound with ``int()`` of a one-element array,
    which NumPy 2.4 refuses; the attention kernel's trip count is such a scalar (read from the row's
    length). Its element is what the compiled kernel uses."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


def _attention(q, k, v, slots, lengths, scale, *, splits, block_n, flash_order, pads=None, k_scale=None, v_scale=None):
    """The decode attention's host launch code (the custom op's implementation), on CPU tensors."""
    from jetrl_trainer.kernels import triton_decode_attention as kernel
    from jetrl_trainer.kernels.settings import DecodeAttentionSettings

    launch = DecodeAttentionSettings()
    out, _, _ = kernel._decode_attention_op._init_fn(q, k, v, slots, lengths, scale, splits, k_scale, v_scale,
                                                     block_n, flash_order, "", pads, launch.num_warps,
                                                     launch.loop_stages, True)  # fmt: skip
    return out


def _attention_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 4, 32, generator=g)
    k, v = torch.randn(5, 2, 70, 32, generator=g), torch.randn(5, 2, 70, 32, generator=g)
    slots = torch.tensor([3, 0, 4, 1])
    lengths = torch.tensor([1, 17, 70, 40])
    for b in range(4):  # what lies past a row's length must never be read
        k[slots[b], :, lengths[b] :] = float("nan")
        v[slots[b], :, lengths[b] :] = float("nan")
    return q, k, v, slots, lengths


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_n, flash_order", [(16, True), (32, False)])
def test_decode_attention_reads_live_positions_only_with_or_without_pads(splits, block_n, flash_order):
    from jetrl_trainer.kernels.triton_decode_attention import decode_attention_reference

    q, k, v, slots, lengths = _attention_inputs()
    ref = decode_attention_reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), slots, lengths, 0.17)
    options = dict(splits=splits, block_n=block_n, flash_order=flash_order)
    plain = _attention(q, k, v, slots, lengths, 0.17, **options)
    shifted = _attention(q, k, v, slots, lengths, 0.17, pads=torch.tensor([0, 5, block_n - 1, 3 * block_n + 2]),
                         **options)  # fmt: skip
    for out in (plain, shifted):
        assert torch.isfinite(out).all() and torch.allclose(out, ref, atol=1e-5, rtol=0)
    if splits == 1:  # whole tiles of padding leave every tile boundary where it was: the same bits
        whole = _attention(q, k, v, slots, lengths, 0.17, pads=torch.tensor([0, block_n, 2 * block_n, 7 * block_n]),
                           **options)  # fmt: skip
        assert torch.equal(whole, plain)


def test_decode_attention_over_an_fp8_cache_dequantizes_as_the_reference():
    from jetrl_trainer.kernels.triton_decode_attention import decode_attention_reference

    q, k, v, slots, lengths = _attention_inputs(seed=1)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    (k8, ks), (v8, vs) = (quantize_fp8_groups(x, 32) for x in (k, v))
    ks, vs = ks[..., 0], vs[..., 0]
    out = _attention(q, k8, v8, slots, lengths, 0.17, splits=2, block_n=16, flash_order=False,
                     pads=torch.tensor([1, 2, 3, 4]), k_scale=ks, v_scale=vs)  # fmt: skip
    ref = decode_attention_reference(q, k8, v8, slots, lengths, 0.17, k_scale=ks, v_scale=vs)
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (6, 2), (2, 2)])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_decode_attention_output_quant_with_and_without_its_padding_rows(heads, kv_heads, splits, scale_format):
    """``quantize_output``: the output's 1x128 FP8 quantization is the act-quant kernel's of the output,
    bit for bit, from phase 1 (one split) and from phase 2; the scales are ``quantize_fp8_groups``'s and
    the output is the reference's. Phase 1 drops the MMA's padding rows first (4, 3 and 1 real query
    heads per KV head in 16 rows); phase 2 has none to drop: with one split both give the same output
    and quantization, bit for bit. (Against the act-quant kernel, not torch: the interpreter's FP8 cast
    rounds some quotients differently from the GPU's; the GPU test compares with torch.)"""
    from jetrl_trainer.kernels import triton_decode_attention as kernel
    from jetrl_trainer.kernels import triton_quant
    from jetrl_trainer.kernels.settings import DecodeAttentionSettings

    g = torch.Generator().manual_seed(heads + splits)
    q = torch.randn(3, heads, 128, generator=g)
    k, v = torch.randn(4, kv_heads, 40, 128, generator=g), torch.randn(4, kv_heads, 40, 128, generator=g)
    slots, lengths = torch.tensor([2, 0, 3]), torch.tensor([1, 33, 40])
    launch = DecodeAttentionSettings()
    results = [kernel._decode_attention_op._init_fn(q, k, v, slots, lengths, 0.09, splits, None, None, 16, False,
                                                    scale_format, None, launch.num_warps, launch.loop_stages, direct)
               for direct in (True, False)]  # fmt: skip
    (out, out_q, out_s), (two_phase, two_phase_q, two_phase_s) = results
    assert torch.equal(two_phase, out) and torch.equal(two_phase_q.view(torch.uint8), out_q.view(torch.uint8))
    assert torch.equal(two_phase_s, out_s)
    ref = kernel.decode_attention_reference(q, k, v, slots, lengths, 0.09)
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)
    flat = out.reshape(3, heads * 128)
    want_q, want_s = triton_quant._act_quant_op._init_fn(flat, 128, scale_format, *_act_launch())
    assert torch.equal(out_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(out_s, want_s)
    assert torch.equal(out_s, quantize_fp8_groups(flat, 128, scale_format=scale_format)[1])
    assert out_q.view(torch.uint8).any()


def _reference_gemm(x_q, x_s, w_q, w_s):
    return dequantize_fp8_groups(x_q, x_s).double() @ dequantize_fp8_blocks(w_q, w_s).double().t()


GEMMS = [(5, [200], 400), (16, [256, 64, 64], 512), (33, [128, 192], 384), (64, [130], 256), (16, [256, 64, 64], 2048)]


@pytest.mark.parametrize("m, widths, k", GEMMS)
def test_decode_gemm_single_and_grouped_match_the_reference(m, widths, k):
    """The decode GEMM's host launch and kernel: single and grouped launches, swapped (M < 64) and not,
    ragged M, N and K, one K split or several, with and without biases (in a grouped launch each
    segment adds its own, in FP32)."""
    from jetrl_trainer.kernels import triton_decode_gemm as dg

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * 3
    x_q, x_s = (t.contiguous() for t in quantize_fp8_groups(x))
    weights = [tuple(t.contiguous() for t in quantize_fp8_blocks(torch.randn(n, k, generator=g) * 0.05)) for n in widths]
    biases = [torch.randn(n, generator=g) for n in widths]
    launch = dg.plan(m, widths, k, 132)  # the H100's and H200's SM count
    assert launch.splits > 1 or launch.groups_per_split > 1  # the scale look-ahead crosses a group boundary
    if len(weights) == 1:
        plain = [dg._decode_gemm_op._init_fn(x_q, x_s, *weights[0], None, torch.float32, launch)]
        with_bias = [dg._decode_gemm_op._init_fn(x_q, x_s, *weights[0], biases[0], torch.float32, launch)]
    else:
        w_qs, w_ss = [w for w, _ in weights], [s for _, s in weights]
        plain = dg._decode_grouped_op._init_fn(x_q, x_s, w_qs, w_ss, [None] * len(weights), torch.float32, launch)
        with_bias = dg._decode_grouped_op._init_fn(x_q, x_s, w_qs, w_ss, biases, torch.float32, launch)
    for (w_q, w_s), bias, a, b in zip(weights, biases, plain, with_bias):
        want = _reference_gemm(x_q, x_s, w_q, w_s)
        assert torch.allclose(a.double(), want, atol=1e-4, rtol=1e-5)
        assert torch.allclose(b.double(), want + bias.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("vocab, block", [(1000, 128), (1024, 256), (151_936 // 64, 1024)])
def test_block_sums_of_the_two_level_sampler(vocab, block):
    """The sampler's first level: FP64 sums of each block of an FP32 table, a ragged last block included."""
    from jetrl_trainer.kernels import triton_sampling
    from jetrl_trainer.rollout.engine.sampling import block_sums

    probs = torch.rand(3, vocab, generator=torch.Generator().manual_seed(vocab)).softmax(-1)
    got = triton_sampling._block_sums_op._init_fn(probs, block)
    want = block_sums(probs, block)  # on CPU tensors: the torch path the engine runs off CUDA
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("norms", [False, True])
def test_rope_append_rotates_and_writes_each_rows_slot_and_position_only(norms):
    """The engine's RoPE + KV append: rotated q returned, rotated k and v written at (slot, position) of
    each row and nowhere else; with Qwen3's q/k norms applied first (``rmsnorm_reference``)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from jetrl_trainer.kernels import triton_rope_append as kernel
    from jetrl_trainer.quant.reference import rmsnorm_reference

    g = torch.Generator().manual_seed(int(norms))
    q, k, v = torch.randn(3, 4, 32, generator=g), torch.randn(3, 2, 32, generator=g), torch.randn(3, 2, 32, generator=g)
    angles = torch.rand(3, 16, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    k_cache, v_cache = torch.full((5, 2, 10, 32), 7.0), torch.full((5, 2, 10, 32), 7.0)
    slots, positions = torch.tensor([4, 0, 2]), torch.tensor([0, 9, 3])
    weights = (torch.rand(32, generator=g) + 0.5, torch.rand(32, generator=g) + 0.5)
    q_norm, k_norm = weights if norms else (None, None)
    out = kernel._rope_append_op._init_fn(q, k, v, cos, sin, k_cache, v_cache, slots, positions, None, None,
                                          q_norm, k_norm, 1e-6, 1e-6)  # fmt: skip
    if norms:
        q, k = rmsnorm_reference(q, q_norm, 1e-6), rmsnorm_reference(k, k_norm, 1e-6)
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)  # one position per row: cos / sin (B, D) over heads
    assert torch.allclose(out, q_rot, atol=1e-5, rtol=0)
    want_k, want_v = torch.full_like(k_cache, 7.0), torch.full_like(v_cache, 7.0)
    want_k[slots, :, positions], want_v[slots, :, positions] = k_rot, v
    assert torch.allclose(k_cache, want_k, atol=1e-5, rtol=0) and torch.equal(v_cache, want_v)


def _rmsnorm_one_row_per_program(x, w, eps):
    """The fused RMSNorm kernel launched with one row per program: the layout before narrow rows were tiled."""
    from jetrl_trainer.kernels._triton_fused_jit import rmsnorm_quant_kernel

    m, k = x.shape
    block_k = max(128, 1 << (k - 1).bit_length())
    y, q, s = torch.empty_like(x), torch.empty(m, k, dtype=torch.uint8), torch.empty(m, -(-k // 128))
    rmsnorm_quant_kernel[(m,)](x, w, y, q, s, m, k, float(k), eps, x.stride(0), y.stride(0), q.stride(0), s.stride(0),
                               BLOCK_K=block_k, ROWS=1, LEVELS=block_k.bit_length() - 2, GROUP=128, UE8M0=False,
                               QUANT=True)  # fmt: skip
    return y, s


@pytest.mark.parametrize("m, k", [(70, 128), (5, 4096), (33, 100), (9, 1024)])
@pytest.mark.parametrize("quantize", [True, False])
def test_rmsnorm_quant_rows_per_tile_normalize_each_row_on_its_own(m, k, quantize):
    """Narrow rows go several to a program tile (Qwen3's per-head q/k norms: 32 rows of 128): each row's
    bits are those of the same row normalized alone (its own pair tree), a ragged last tile is masked,
    and the values are rmsnorm_reference's (the GPU tests check its bits; numpy's float32 steps here
    differ from torch's CPU ones in a last bit). Without ``quantize`` nothing but y is written."""
    from jetrl_trainer.kernels import triton_norm
    from jetrl_trainer.quant.reference import rmsnorm_reference

    g = torch.Generator().manual_seed(m * k)
    x, w = torch.randn(m, k, generator=g) * 3, torch.rand(k, generator=g) + 0.5
    y, _, s = triton_norm._rmsnorm_quant_op._init_fn(x, w, 1e-6, "fp32", quantize)
    alone_y, alone_s = _rmsnorm_one_row_per_program(x, w, 1e-6)
    assert torch.equal(y, alone_y)
    assert torch.allclose(y, rmsnorm_reference(x, w, 1e-6), rtol=1e-6, atol=0)
    if quantize:
        assert torch.equal(s, alone_s)
    else:
        assert s.shape[0] == 0


@pytest.mark.parametrize("m, k", [(300, 128), (7, 4096), (33, 100), (1, 128)])
def test_rmsnorm_backward_tiles_cover_every_row_once(m, k):
    """The backward's tiles (several narrow rows each, several tiles per program, ragged ends): dx and
    the per-program dw sums equal FP64 autograd through rmsnorm_reference to FP32 accuracy."""
    from jetrl_trainer.kernels import triton_norm
    from jetrl_trainer.quant.reference import rmsnorm_reference

    g = torch.Generator().manual_seed(m + k)
    x, w, dy = torch.randn(m, k, generator=g), torch.rand(k, generator=g) + 0.5, torch.randn(m, k, generator=g)
    dx, dw = triton_norm._rmsnorm_backward_op._init_fn(x, w, dy, 1e-6)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    rmsnorm_reference(x64, w64, 1e-6).backward(dy.double())
    assert torch.allclose(dx.double(), x64.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(dw.double(), w64.grad, rtol=1e-4, atol=1e-4)


def _act_launch(settings=None) -> tuple[list[int], list[int]]:
    """The act-quant custom op's launch arguments for ``settings`` (the default ``QuantKernelSettings()``)."""
    from jetrl_trainer.kernels.settings import QuantKernelSettings

    settings = settings if settings is not None else QuantKernelSettings()
    return list(settings.act), list(settings.act_transposed)


def _quant_kernels(x, settings):
    """The quant kernels' host launch code (the custom ops' implementations) on ``x``, launched with
    ``settings``: act quant of ``x`` and of ``x.t()``, requant-transpose, block transpose. (Not the
    weight quant: Triton 3.6's interpreter fails on its scalar scale's ``&``.)"""
    from jetrl_trainer.kernels import triton_quant as kernels

    q, s = kernels._act_quant_op._init_fn(x, 128, "fp32", *_act_launch(settings))
    transposed = kernels._act_quant_op._init_fn(x.t(), 128, "fp32", *_act_launch(settings))
    requant = kernels._requant_transpose_op._init_fn(q, s, 128, "fp32", settings.requant_block_k,
                                                     settings.requant_warps)  # fmt: skip
    blocks = kernels._transpose_blocks_op._init_fn(*quantize_fp8_blocks(x), list(settings.transpose))
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            for pair in ((q, s), transposed, requant, blocks) for t in pair]  # fmt: skip


@pytest.mark.parametrize("shape", [(36, 200), (33, 130), (4, 96)])
def test_quant_kernel_settings_change_no_bit(shape):
    """Other tiles and warps (a ``QuantKernelSettings`` that a tuning sweep builds) give the default
    launch's bits in every quant kernel, on ragged shapes."""
    from jetrl_trainer.kernels.settings import QuantKernelSettings

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 5
    tuned = QuantKernelSettings(act=(8, 4, 4), act_transposed=(32, 2, 4), weight_warps=8, requant_block_k=64,
                                requant_warps=8, transpose=(32, 256, 4))  # fmt: skip
    default = _quant_kernels(x, QuantKernelSettings())
    for got, want in zip(_quant_kernels(x, tuned), default, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    assert default[0].any() and default[4].any() and default[6].any()  # not an all-zero agreement


@pytest.mark.parametrize("shape", [(300, 200), (256, 128), (4, 96), (132, 260)])
def test_requant_transpose_packed_words_give_the_byte_paths_bits(shape):
    """M % 4 == 0 packs four tokens per 32-bit word through the transpose; other M move bytes. The same
    tokens with an all-zero one appended (M + 1: the byte path; a zero raises no amax) give the same
    bytes and scales, on ragged token and feature counts."""
    from jetrl_trainer.kernels import triton_quant

    m, k = shape
    q, s = quantize_fp8_groups(torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 5, 128)
    q_odd, s_odd = torch.cat([q, torch.zeros(1, k, dtype=q.dtype)]), torch.cat([s, torch.ones(1, s.shape[1])])
    qt_words, st_words = triton_quant._requant_transpose_op._init_fn(q, s, 128, "fp32", 32, 4)
    qt_bytes, st_bytes = triton_quant._requant_transpose_op._init_fn(q_odd, s_odd, 128, "fp32", 32, 4)
    assert qt_words.shape == (k, m) and qt_bytes.shape == (k, m + 1)
    assert torch.equal(qt_words.view(torch.uint8), qt_bytes[:, :m].view(torch.uint8))
    assert torch.equal(st_words, st_bytes[:, : st_words.shape[1]])
    assert qt_words.view(torch.uint8).any() and not qt_bytes[:, m].view(torch.uint8).any()


# Triton's interpreter rounds FP32 -> BF16 toward zero where the GPU rounds to nearest even (2.6856
# becomes 2.671875, not torch's 2.6875), so the bit tests below compare FP32 results here; the GPU
# tests (test_decode_gemm.py, test_engine*.py) compare BF16 bits.


@pytest.mark.parametrize("m, widths, k", [(16, [256, 64, 64], 512), (16, [256, 64, 64], 2048), (5, [128, 192], 384)])
def test_grouped_partials_reduce_to_the_bits_of_the_grouped_launch(m, widths, k):
    """``fp8_decode_gemm_grouped_partials``: the weights' FP32 split sums side by side, one split (the
    ``PARTIALS`` store) or several; added in split order, plus each weight's bias, they are the
    grouped launch's outputs, bit for bit."""
    from jetrl_trainer.kernels import triton_decode_gemm as dg

    g = torch.Generator().manual_seed(k + m)
    x_q, x_s = (t.contiguous() for t in quantize_fp8_groups(torch.randn(m, k, generator=g) * 3))
    weights = [tuple(t.contiguous() for t in quantize_fp8_blocks(torch.randn(n, k, generator=g) * 0.05)) for n in widths]
    biases = [torch.randn(n, generator=g) for n in widths]
    w_qs, w_ss = [w for w, _ in weights], [s for _, s in weights]
    launch = dg.plan(m, widths, k, 132)
    parts = dg._decode_grouped_partials_op._init_fn(x_q, x_s, w_qs, w_ss, launch)
    assert parts.shape == (launch.splits, m, sum(widths))
    want = dg._decode_grouped_op._init_fn(x_q, x_s, w_qs, w_ss, biases, torch.float32, launch)
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    for got, bias, ref in zip(acc.split(widths, dim=-1), biases, want):
        assert torch.equal(got + bias, ref)


@pytest.mark.parametrize("splits, bias, norms", [(1, False, False), (3, True, False), (2, False, True), (4, True, True)])
def test_rope_append_from_partials_gives_the_bits_of_reducing_first(splits, bias, norms):
    """The q/k/v split-K reduction inside the RoPE + KV-append launch: the same rotated q and the same
    cache writes as reducing the partial sums first (in split order, + bias, rounded once: what the
    GEMM's reduction launch stores) and calling the plain launch on the result."""
    from jetrl_trainer.kernels import triton_rope_append as kernel

    H, H_kv, D, B, dtype = 4, 2, 32, 3, torch.float32
    g = torch.Generator().manual_seed(splits)
    parts = torch.randn(splits, B, (H + 2 * H_kv) * D, generator=g) * 3
    biases = [torch.randn(w, generator=g).to(dtype) for w in (H * D, H_kv * D, H_kv * D)] if bias else None
    angles = torch.rand(B, D // 2, generator=g) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    slots, positions = torch.tensor([4, 0, 2]), torch.tensor([0, 9, 3])
    norm_args = ((torch.rand(D, generator=g) + 0.5).to(dtype), (torch.rand(D, generator=g) + 0.5).to(dtype), 1e-6, 1e-6) \
        if norms else (None, None, 0.0, 0.0)  # fmt: skip

    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    if bias:
        acc += torch.cat(biases).float()
    q, k, v = kernel.partial_views(acc.to(dtype)[None], H, H_kv, D)
    caches = [torch.full((5, H_kv, 10, D), 7.0, dtype=dtype) for _ in range(4)]
    want = kernel._rope_append_op._init_fn(q, k, v, cos, sin, caches[0], caches[1], slots, positions, None, None,
                                           *norm_args)  # fmt: skip
    q, k, v = kernel.partial_views(parts, H, H_kv, D)
    got = kernel._rope_append_op._init_fn(q, k, v, cos, sin, caches[2], caches[3], slots, positions, None, None,
                                          *norm_args, parts, *(biases or (None, None, None)))  # fmt: skip
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert not torch.equal(caches[2], torch.full_like(caches[2], 7.0))  # the keys were written
