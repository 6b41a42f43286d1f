"""Split-KV decode attention (kernels/triton_decode_attention.py): the reference on CPU, the kernel
on CUDA against it (GQA, ragged live lengths, every split count, dtypes), and CUDA-graph replay; in
Triton's interpreter, live positions, FP8 caches and the output's FP8 quant; compiled for sm_90,
pipelined tile loads and the reduction."""

from __future__ import annotations

import importlib

import pytest
import torch
from _sm90 import compile_sm90

from jetrl_trainer.kernels.settings import DecodeAttentionSettings, QuantKernelSettings
from jetrl_trainer.kernels.triton_decode_attention import decode_attention, decode_attention_reference, plan_splits
from jetrl_trainer.quant.fp8 import quantize_fp8_groups
from jetrl_trainer.rollout.engine.attention import decode_attention as engine_sdpa_attention

SHAPES = [  # B, H, H_kv, T, D, slots
    (3, 4, 2, 40, 32, 5),
    (5, 8, 8, 100, 64, 6),
    (2, 6, 2, 70, 32, 4),
    (4, 32, 8, 300, 128, 4),  # an 8B-like head layout
]


def _inputs(B, H, Hkv, T, D, S, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g).to(device, dtype)
    k = torch.randn(S, Hkv, T, D, generator=g).to(device, dtype)
    v = torch.randn(S, Hkv, T, D, generator=g).to(device, dtype)
    slots = torch.randperm(S, generator=g)[:B].to(device) if B <= S else torch.randint(0, S, (B,), generator=g).to(device)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[-1] = 1, T  # the extremes
    return q, k, v, slots, lengths.to(device)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_reference_equals_the_engines_sdpa_path(shape):
    q, k, v, slots, lengths = _inputs(*shape, torch.float32)
    ref = decode_attention_reference(q, k, v, slots, lengths, shape[4] ** -0.5)
    sdpa = engine_sdpa_attention(q, k[slots], v[slots], lengths, shape[4] ** -0.5)
    assert torch.allclose(ref, sdpa, atol=1e-5, rtol=0)


def test_reference_ignores_positions_past_the_length():
    q, k, v, slots, lengths = _inputs(3, 4, 2, 40, 32, 5, torch.float32)
    before = decode_attention_reference(q, k, v, slots, lengths, 0.2)
    k2, v2 = k.clone(), v.clone()
    for b in range(3):
        k2[slots[b], :, lengths[b] :] = float("nan")
        v2[slots[b], :, lengths[b] :] = 1e4
    assert torch.equal(decode_attention_reference(q, k2.nan_to_num(1e4), v2, slots, lengths, 0.2), before)


def test_the_kernel_refuses_cpu_tensors_and_bad_shapes():
    q, k, v, slots, lengths = _inputs(3, 4, 2, 40, 32, 5, torch.float32)
    with pytest.raises(ValueError, match="decode_attention is a CUDA kernel"):
        decode_attention(q, k, v, slots, lengths, 0.1)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _need_triton():
    from jetrl_trainer.kernels import triton_available

    if not triton_available():
        pytest.skip("needs Triton")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("block_n, flash_order", [(32, False), (64, True), (128, True)])
def test_kernel_matches_the_reference(shape, dtype, splits, block_n, flash_order):
    _need_triton()
    q, k, v, slots, lengths = _inputs(*shape, dtype, device="cuda")
    scale = shape[4] ** -0.5
    out = decode_attention(q, k, v, slots, lengths, scale, splits=splits, block_n=block_n, flash_order=flash_order)
    ref = decode_attention_reference(q, k, v, slots, lengths, scale)
    tol = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]  # P rounded to the cache dtype
    assert out.dtype == dtype and torch.allclose(out.float(), ref.float(), atol=tol, rtol=0)


def test_split_plan_fills_the_gpu_only_while_rows_leave_sms_idle():
    # 8B layout (8 KV heads), 132 SMs, 64-position tiles.
    assert plan_splits(64, 8, 384, 64, 132) == 1  # 512 programs already
    assert plan_splits(256, 8, 4096, 64, 132) == 1
    assert plan_splits(1, 8, 4096, 64, 132) == 16  # 33 programs wanted per (row, head); 16 splits of 4 tiles
    assert plan_splits(8, 8, 4096, 64, 132) == 5
    assert plan_splits(8, 8, 384, 64, 132) == 2  # short cache: each split keeps >= 4 tiles
    assert plan_splits(8, 8, 100, 64, 132) == 1
    shorter = DecodeAttentionSettings(min_tiles_per_split=2)  # splits of >= 2 tiles
    assert plan_splits(8, 8, 384, 64, 132, shorter) == 3 and plan_splits(1, 8, 4096, 64, 132, shorter) == 32


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_default_launch_matches_the_reference(rows):
    _need_triton()
    q, k, v, slots, lengths = _inputs(rows, 32, 8, 1000, 128, max(rows, 2), torch.bfloat16, device="cuda")
    out = decode_attention(q, k, v, slots, lengths, 0.088)  # planned splits, 64-position tiles, flash order
    ref = decode_attention_reference(q, k, v, slots, lengths, 0.088)
    assert torch.allclose(out.float(), ref.float(), atol=3e-2, rtol=0)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("flash_order", [False, True])
def test_one_split_written_by_phase_one_has_the_bits_of_phase_two(flash_order):
    _need_triton()
    q, k, v, slots, lengths = _inputs(6, 32, 8, 300, 128, 6, torch.bfloat16, device="cuda")
    direct = decode_attention(q, k, v, slots, lengths, 0.088, splits=1, flash_order=flash_order)
    two_phase = decode_attention(q, k, v, slots, lengths, 0.088, splits=1, flash_order=flash_order,
                                 direct_single_split=False)  # fmt: skip
    assert torch.equal(direct, two_phase)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("splits", [1, 3])
def test_launch_settings_reach_the_kernel(splits):
    """``settings``: the tile loop unpipelined (one stage) sums in the same order, so the same bits;
    eight warps share a tile's row sums differently, still the reference's values."""
    _need_triton()
    q, k, v, slots, lengths = _inputs(6, 32, 8, 300, 128, 6, torch.bfloat16, device="cuda")
    options = dict(splits=splits, block_n=128, flash_order=False, pads=torch.tensor([0, 1, 127, 128, 200, 5]).cuda())
    shipped = decode_attention(q, k, v, slots, lengths, 0.088, **options)
    one_stage = decode_attention(q, k, v, slots, lengths, 0.088, settings=DecodeAttentionSettings(loop_stages=1),
                                 **options)  # fmt: skip
    assert torch.equal(one_stage, shipped)
    eight = decode_attention(q, k, v, slots, lengths, 0.088, settings=DecodeAttentionSettings(num_warps=8), **options)
    ref = decode_attention_reference(q, k, v, slots, lengths, 0.088)
    assert torch.allclose(eight.float(), ref.float(), atol=3e-2, rtol=0)


@pytest.mark.gpu
@CUDA
def test_kernel_reads_only_live_positions_and_replays_in_a_graph():
    _need_triton()
    q, k, v, slots, lengths = _inputs(4, 32, 8, 300, 128, 4, torch.bfloat16, device="cuda")
    for b in range(4):  # poison what lies past each row's length: the kernel must never read it
        k[slots[b], :, lengths[b] :] = float("nan")
        v[slots[b], :, lengths[b] :] = float("nan")
    out = decode_attention(q, k, v, slots, lengths, 0.088)
    assert torch.isfinite(out).all()
    graph, static = torch.cuda.CUDAGraph(), torch.empty_like(out)
    decode_attention(q, k, v, slots, lengths, 0.088)  # warm-up outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static.copy_(decode_attention(q, k, v, slots, lengths, 0.088))
    new_lengths = (lengths - 1).clamp(min=1)
    lengths.copy_(new_lengths)  # the graph reads lengths on the device
    graph.replay()
    ref = decode_attention_reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), slots, new_lengths, 0.088)
    assert torch.allclose(static.float(), ref.float(), atol=3e-2, rtol=0)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize("splits", [1, 3])
def test_quantized_output_is_quantize_fp8_groups_of_the_output(splits, scale_format):
    """``quantize_output``: the same output, and its 1x128 quantization (one group per head) bit for
    bit, from phase 1 (one split, the query-head padding rows dropped first) and from phase 2 (several)."""
    from jetrl_trainer.quant.fp8 import quantize_fp8_groups

    _need_triton()
    q, k, v, slots, lengths = _inputs(6, 32, 8, 300, 128, 6, torch.bfloat16, device="cuda")
    plain = decode_attention(q, k, v, slots, lengths, 0.088, splits=splits)
    out, out_q, out_s = decode_attention(q, k, v, slots, lengths, 0.088, splits=splits, quantize_output=scale_format)
    assert torch.equal(out, plain)
    ref_q, ref_s = quantize_fp8_groups(out.reshape(6, -1), 128, scale_format=scale_format)
    assert out_q.shape == (6, 32 * 128) and out_s.shape == (6, 32)
    assert torch.equal(out_q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(out_s, ref_s)


@pytest.mark.gpu
@CUDA
def test_quantized_output_needs_heads_of_128():
    _need_triton()
    q, k, v, slots, lengths = _inputs(3, 4, 2, 40, 32, 5, torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="head_dim 128"):
        decode_attention(q, k, v, slots, lengths, 0.1, quantize_output="fp32")


def test_matched_arithmetic_per_training_backend():
    from torch.nn.attention import SDPBackend

    from jetrl_trainer.rollout.engine.attention import matched_arithmetic, training_attention_backend

    assert training_attention_backend(4, 2, 32, torch.float32, torch.device("cpu")) in SDPBackend.__members__.values()
    assert matched_arithmetic(None) == {}
    assert matched_arithmetic(SDPBackend.CUDNN_ATTENTION) == dict(block_n=128, flash_order=False)
    assert matched_arithmetic(SDPBackend.FLASH_ATTENTION) == dict(block_n=64, flash_order=True)
    assert matched_arithmetic(SDPBackend.MATH) == {}  # the kernel's defaults
    matched_arithmetic(SDPBackend.CUDNN_ATTENTION)["block_n"] = 1
    assert matched_arithmetic(SDPBackend.CUDNN_ATTENTION)["block_n"] == 128, "callers get a copy"


def test_the_user_is_told_whether_the_decode_attention_matches_the_training_forward(caplog):
    import logging

    from torch.nn.attention import SDPBackend

    from jetrl_trainer.rollout.engine.attention import arithmetic_note

    assert arithmetic_note(None) is None  # the CPU path: nothing to say
    level, text = arithmetic_note(SDPBackend.CUDNN_ATTENTION)
    assert level == logging.INFO and "CUDNN_ATTENTION" in text
    level, text = arithmetic_note(SDPBackend.EFFICIENT_ATTENTION)
    assert level == logging.WARNING and "does not reproduce" in text and "enable_cudnn_sdp" in text


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("backend", ["default", "FLASH_ATTENTION"])
def test_matched_decode_reproduces_the_training_forwards_attention(backend):
    """Row t of the causal SDPA the training forward runs (8B head layout, GQA) against one decode
    query at t: the matched tile size and order give its bits on all but a few elements in 10,000
    (measured 0.06% under cuDNN, 0.002% under flash attention); the other order gives 12-28%."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from jetrl_trainer.rollout.engine.attention import matched_arithmetic, training_attention_backend

    _need_triton()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, h, 384, 128, device="cuda", generator=g).bfloat16() for h in (32, 8, 8))
    forced = sdpa_kernel(getattr(SDPBackend, backend)) if backend != "default" else contextlib.nullcontext()
    with forced:
        chosen = training_attention_backend(32, 8, 128, torch.bfloat16, torch.device("cuda"))
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=128**-0.5, enable_gqa=True)
    options = matched_arithmetic(chosen)
    if not options:
        pytest.skip(f"torch picks {chosen.name} here, whose order the kernel does not reproduce")
    other = dict(block_n=192 - options["block_n"], flash_order=not options["flash_order"])
    slots = torch.arange(4, device="cuda")
    differ = {}
    for name, opts in (("matched", options), ("other", other)):
        wrong = 0
        for t in (0, 63, 64, 127, 128, 200, 255, 383):
            lengths = torch.full((4,), t + 1, device="cuda")
            out = decode_attention(q[:, :, t].contiguous(), k, v, slots, lengths, 128**-0.5, splits=1, **opts)
            wrong += int((out != full[:, :, t]).sum())
        differ[name] = wrong / (8 * 4 * 32 * 128)
    assert differ["matched"] < 2e-3, differ
    assert differ["other"] > 20 * max(differ["matched"], 1e-4), differ


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("flash_order", [False, True])
def test_pads_move_only_the_tile_boundaries(splits, flash_order):
    """Pad counts start each row's tiles up to block_n - 1 positions before its slot position 0
    (masked): the attention is the reference's, nothing outside a row's live positions is read, and
    pads that are multiples of block_n give the bits of no pads at all (one split)."""
    _need_triton()
    q, k, v, slots, lengths = _inputs(6, 32, 8, 300, 128, 6, torch.bfloat16, device="cuda")
    for b in range(6):
        k[slots[b], :, lengths[b] :] = float("nan")
        v[slots[b], :, lengths[b] :] = float("nan")
    options = dict(splits=splits, block_n=128, flash_order=flash_order)
    pads = torch.tensor([0, 1, 127, 128, 200, 1000], device="cuda")
    out = decode_attention(q, k, v, slots, lengths, 0.088, pads=pads, **options)
    ref = decode_attention_reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), slots, lengths, 0.088)
    assert torch.isfinite(out).all() and torch.allclose(out.float(), ref.float(), atol=3e-2, rtol=0)
    if splits == 1:
        whole_tiles = torch.tensor([0, 128, 256, 384, 512, 1024], device="cuda")
        assert torch.equal(decode_attention(q, k, v, slots, lengths, 0.088, pads=whole_tiles, **options),
                           decode_attention(q, k, v, slots, lengths, 0.088, **options))  # fmt: skip
    with pytest.raises(ValueError, match="pads must be"):
        decode_attention(q, k, v, slots, lengths, 0.088, pads=pads.float(), **options)


@pytest.mark.gpu
@CUDA
def test_matched_decode_lines_its_tiles_up_with_a_padded_training_forward():
    """A left-padded batch as transformers runs it in the training forward (4D boolean mask, K/V
    repeated per head), against the engine's cache, which holds each row's live positions from slot
    position 0: with the rows' pad counts the matched tiles fall on the forward's boundaries and give
    its bits on all but a few elements in 1,000; without them (the engine before), several in 100."""
    import torch.nn.functional as F

    from jetrl_trainer.rollout.engine.attention import matched_arithmetic, training_attention_backend

    _need_triton()
    rows, length = 4, 512
    pads = [0, 45, 150, 260]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(rows, h, length, 128, device="cuda", generator=g).bfloat16() for h in (32, 8, 8))
    live = torch.ones(rows, length, dtype=torch.bool, device="cuda")
    for b, pad in enumerate(pads):
        live[b, :pad] = False
    mask = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()[None, None] & live[:, None, None, :]
    k_rep, v_rep = (x.repeat_interleave(4, dim=1) for x in (k, v))
    options = matched_arithmetic(training_attention_backend(32, 8, 128, torch.bfloat16, torch.device("cuda")))
    if options.get("block_n") != 128:
        pytest.skip("torch does not pick cuDNN attention for the training forward here")
    full = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, scale=128**-0.5)
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
    for b, pad in enumerate(pads):  # live positions from slot position 0, as the engine stores a prompt
        k_cache[b, :, : length - pad], v_cache[b, :, : length - pad] = k[b, :, pad:], v[b, :, pad:]
    slots = torch.arange(rows, device="cuda")
    differ = {}
    for name, pad_counts in (("aligned", torch.tensor(pads, device="cuda")), ("unaligned", None)):
        wrong = total = 0
        for t in (260, 300, 383, 384, 400, 511):
            lengths = torch.tensor([t - pad + 1 for pad in pads], device="cuda")
            out = decode_attention(q[:, :, t].contiguous(), k_cache, v_cache, slots, lengths, 128**-0.5, splits=1,
                                   pads=pad_counts, **options)  # fmt: skip
            wrong += int((out != full[:, :, t]).sum())
            total += out.numel()
        differ[name] = wrong / total
    assert differ["aligned"] < 2e-3, differ
    assert differ["unaligned"] > 10 * max(differ["aligned"], 1e-4), differ


# -- in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 pytest -m interpreter) -----------------------


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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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
    act = QuantKernelSettings()  # the act-quant custom op's default launch
    launch_q = list(act.act), list(act.act_transposed)
    want_q, want_s = triton_quant._act_quant_op._init_fn(flat, 128, scale_format, *launch_q)
    assert torch.equal(out_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(out_s, want_s)
    assert torch.equal(out_s, quantize_fp8_groups(flat, 128, scale_format=scale_format)[1])
    assert out_q.view(torch.uint8).any()


# -- compiled for sm_90 without a GPU (JETRL_COMPILE_SM90=1 pytest -m sm90) ----------------------------------


_ATTENTION_POINTERS = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", slots_ptr="*i64", lengths_ptr="*i64",
                           pads_ptr="*i64", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", ks_ptr="*fp32",
                           vs_ptr="*fp32", out_ptr="*bf16", oq_ptr="*u8", os_ptr="*fp32")  # fmt: skip


@pytest.mark.sm90
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
    ptx = compile_sm90(jit.decode_attention_split_kernel, pointers, constexprs, floats=("scale", "scale_log2"),
                       launch=dict(num_warps=settings.num_warps))  # fmt: skip
    assert "mma.sync" in ptx
    assert settings.loop_stages < 2 or "cp.async.cg.shared.global" in ptx or "cp.async.ca.shared.global" in ptx
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == quant  # the output's FP8 quant only where asked


@pytest.mark.sm90
@pytest.mark.parametrize("splits, quant", [(2, False), (3, True), (8, True)])
def test_decode_attention_reduce_compiles(splits, quant):
    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_attention_jit")
    pointers = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*bf16", oq_ptr="*u8", os_ptr="*fp32")
    constexprs = dict(SPLITS=splits, S_PAD=max(2, 1 << (splits - 1).bit_length()), D=128, FLASH_ORDER=True, H=32,
                      QUANT=quant, UE8M0=False)  # fmt: skip
    ptx = compile_sm90(jit.decode_attention_reduce_kernel, pointers, constexprs, floats=("m_scale",),
                       launch=dict(num_warps=4))  # fmt: skip
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == quant
