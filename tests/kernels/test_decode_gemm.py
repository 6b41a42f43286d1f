"""The decode-sized FP8 linear (kernels/triton_decode_gemm.py): its launch plan, settings and dispatch
on CPU; on CUDA, the GEMM against the dequantized reference, bias, determinism, split sums, grouped
launches, CUDA-graph replay, and that a rollout-phase ``QuantLinear`` takes it at decode M and only there;
in Triton's interpreter, the single and grouped launches and their partials; compiled for sm_90, wgmma,
pipelined loads and the split-K reduction."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from _sm90 import compile_sm90

from jetrl_trainer import kernels
from jetrl_trainer.kernels import triton_decode_gemm as dg
from jetrl_trainer.kernels.settings import DecodeGemmSettings
from jetrl_trainer.quant import PrecisionPhases, QuantLinear
from jetrl_trainer.quant._dispatch import decode_gemm_module, decode_linear_fp8
from jetrl_trainer.quant.fp8 import dequantize_fp8_blocks, dequantize_fp8_groups, quantize_fp8_blocks, quantize_fp8_groups
from jetrl_trainer.quant.recipe import FP8Recipe
from jetrl_trainer.quant.testing import relative_error


@pytest.mark.parametrize("min_groups", [1, 4])
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64, 100])
@pytest.mark.parametrize("n, k", [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (200, 300)])
def test_plan_covers_every_k_group_exactly_once(m, n, k, min_groups):
    cfg = dg.plan(m, n, k, sms=132, settings=DecodeGemmSettings(min_groups_per_split=min_groups))
    groups = math.ceil(k / 128)
    per, splits = cfg.groups_per_split, cfg.splits
    assert per * splits >= groups > per * (splits - 1)  # no split is empty, none is missing
    assert 16 <= cfg.block_m <= 64 and cfg.block_m & (cfg.block_m - 1) == 0
    assert cfg.block_m >= min(m, 64)
    if splits > 1:  # never below the minimum length
        assert per >= min(min_groups, groups) or per * splits == groups


def test_plan_keeps_splits_long_enough_to_stream():
    # k/v of Qwen3-8B on 132 SMs: 16 N tiles; the minimum split length of 4 groups gives 8 splits of 4,
    # a minimum of 1 gives 16 of 2 (the same busiest-SM load, programs nearer two per SM).
    cfg = dg.plan(64, 1024, 4096, sms=132)
    assert (cfg.splits, cfg.groups_per_split) == (8, 4)
    cfg = dg.plan(64, 1024, 4096, sms=132, settings=DecodeGemmSettings(min_groups_per_split=1))
    assert (cfg.splits, cfg.groups_per_split) == (16, 2)


def test_settings_choose_the_launch():
    """Every field of DecodeGemmSettings but max_m (QuantLinear's row limit) reaches the plan; the plan
    is plain ints (what the custom ops take)."""
    settings = DecodeGemmSettings(block_n=128, max_block_m=32, swap_below_m=64, num_warps=8, num_stages=4)
    cfg = dg.plan(100, 4096, 4096, sms=132, settings=settings)
    assert (cfg.block_m, cfg.block_n, cfg.swap, cfg.num_warps, cfg.num_stages) == (32, 128, 1, 8, 4)
    assert dg.plan(64, 4096, 4096, sms=132).swap == 0  # M tiles of 64 rows: W is the MMA's N operand
    assert dg.plan(16, 4096, 4096, sms=132, settings=DecodeGemmSettings(swap_below_m=16)).swap == 0
    assert all(type(v) is int for v in cfg)
    assert dg.plan(64, 4096, 4096, sms=132, settings=DecodeGemmSettings(max_m=1)) == dg.plan(64, 4096, 4096, sms=132)


def test_fake_ops_agree_with_the_plan():
    """The ops' fake implementations (torch.compile, meta tensors) give the shapes the launch writes."""
    m, widths, k = 16, [256, 64, 64], 512
    launch = dg.plan(m, widths, k, sms=132, settings=DecodeGemmSettings(min_groups_per_split=1))
    assert launch.splits == 4
    meta = dict(device="meta")
    x_q, x_s = torch.empty(m, k, dtype=torch.float8_e4m3fn, **meta), torch.empty(m, k // 128, **meta)
    w_qs = [torch.empty(n, k, dtype=torch.float8_e4m3fn, **meta) for n in widths]
    w_ss = [torch.empty(math.ceil(n / 128), k // 128, **meta) for n in widths]
    ops = torch.ops.jetrl
    assert ops.fp8_decode_gemm_grouped_partials(x_q, x_s, w_qs, w_ss, list(launch)).shape == (4, m, sum(widths))
    assert ops.fp8_decode_gemm_partials(x_q, x_s, w_qs[0], w_ss[0], list(launch)).shape == (4, m, 256)
    outs = ops.fp8_decode_gemm_grouped(x_q, x_s, w_qs, w_ss, [None] * 3, torch.float32, list(launch))
    assert [tuple(o.shape) for o in outs] == [(m, n) for n in widths] and outs[0].dtype == torch.float32
    out = ops.fp8_decode_gemm_nt(x_q, x_s, w_qs[0], w_ss[0], None, torch.bfloat16, list(launch))
    assert out.shape == (m, 256) and out.dtype == torch.bfloat16


def _busiest_sm_groups(cfg, tiles, sms=132):
    """K groups the busiest SM streams when the launch's programs spread evenly over ``sms`` SMs."""
    return math.ceil(tiles * cfg.splits / sms) * cfg.groups_per_split


def _waves_rule_splits(tiles, groups, sms, waves=2, min_groups=4):
    """The K split by program count alone (``waves`` programs per SM), the rule the balanced split replaced."""
    return max(1, min(math.ceil(groups / min_groups), math.ceil(waves * sms / tiles)))


def test_balanced_plan_evens_the_sms_work_out():
    """The Qwen3-8B decode launches at M <= 64 (one M tile of 64-row N tiles) split K so that no SM
    holds a third program while others hold two (q/k/v: 4 splits, not 3; o and down: 4, not 5);
    gate/up keep one split. Over many shapes the plan never leaves the busiest SM more K groups than
    the waves rule would, covers every group once and keeps splits as long as the minimum asks."""
    for m in (1, 16, 64):
        assert dg.plan(m, [4096, 1024, 1024], 4096, sms=132).splits == 4  # 384 programs of 8
        assert dg.plan(m, 4096, 4096, sms=132).splits == 4  # o: 256 programs of 8
        assert dg.plan(m, 4096, 12288, sms=132).splits == 4  # down: 256 programs of 24
        assert dg.plan(m, [12288, 12288], 4096, sms=132).splits == 1
    for m in (1, 16, 33, 64, 128, 256):
        for widths, k in [([4096], 4096), ([1024], 4096), ([4096, 1024, 1024], 4096), ([12288, 12288], 4096),
                          ([4096], 12288), ([200], 300), ([5120, 1024, 1024], 5120), ([2048], 8192)]:  # fmt: skip
            for sms in (78, 114, 132):
                cfg = dg.plan(m, widths, k, sms)
                tiles = sum(math.ceil(w / cfg.block_n) for w in widths) * math.ceil(m / cfg.block_m)
                groups, per, splits = math.ceil(k / 128), cfg.groups_per_split, cfg.splits
                assert per * splits >= groups > per * (splits - 1)
                assert per >= min(4, groups)
                asked = _waves_rule_splits(tiles, groups, sms)
                waves = cfg._replace(groups_per_split=math.ceil(groups / asked), splits=asked)
                assert _busiest_sm_groups(cfg, tiles, sms) <= _busiest_sm_groups(waves, tiles, sms), (m, widths, k, sms)


def test_dispatch_steps_aside_off_cuda_and_in_a_use_gemm_backend_block_only(monkeypatch):
    x = torch.randn(4, 256)
    w_q, w_s = quantize_fp8_blocks(torch.randn(128, 256))
    assert decode_linear_fp8(x, w_q, w_s, None, FP8Recipe(), torch.float32) is None  # CPU: the general path
    # The rest of the rule on a stand-in for a CUDA activation and the kernel module.
    kernel = type("DecodeGemm", (), {})
    monkeypatch.setattr(kernels, "triton_enabled", lambda: True)
    monkeypatch.setattr(kernels, "optional_module", lambda name: kernel if name == "triton_decode_gemm" else None)
    decode_sized = type("CudaActivation", (), {"is_cuda": True, "shape": (4, 256)})()
    assert decode_gemm_module(decode_sized, 64) is kernel
    assert decode_gemm_module(decode_sized, 3) is None  # above the recipe's max_m
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "emulated")
    kernels.reset_kernel_caches()
    try:
        assert kernels.gemm_backend_forced() == "emulated"  # the general path's backend...
        assert decode_gemm_module(decode_sized, 64) is kernel  # ...and the rollout's decode GEMM stays on
    finally:
        monkeypatch.delenv("JETRL_GEMM_BACKEND")
        kernels.reset_kernel_caches()
    with kernels.use_gemm_backend("emulated"):  # the scoped switch of tests and benchmarks: every GEMM
        assert decode_gemm_module(decode_sized, 64) is None


def test_the_kernel_refuses_cpu_tensors():
    w_q, w_s = quantize_fp8_blocks(torch.randn(128, 256))
    with pytest.raises(ValueError, match="CUDA"):
        dg.fp8_decode_gemm_nt(*quantize_fp8_groups(torch.randn(4, 256)), w_q, w_s)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _need_kernel():
    if not kernels.triton_available() or kernels.optional_module("triton_decode_gemm") is None:
        pytest.skip("needs Triton")


def _operands(m, n, k, dtype, seed=0, scale_format="fp32"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).cuda()
    w_q, w_s = quantize_fp8_blocks(w, scale_format=scale_format)
    return x, w_q.contiguous(), w_s


def _reference(x, w_q, w_s, bias=None, scale_format="fp32"):
    x_q, x_s = quantize_fp8_groups(x, scale_format=scale_format)
    y = dequantize_fp8_groups(x_q, x_s).double() @ dequantize_fp8_blocks(w_q, w_s).double().t()
    return y + bias.double() if bias is not None else y


# shipped, never / always swapped, short splits
SETTINGS = [DecodeGemmSettings(), DecodeGemmSettings(swap_below_m=16, block_n=128),
            DecodeGemmSettings(swap_below_m=128, waves=4), DecodeGemmSettings(min_groups_per_split=1)]  # fmt: skip


@pytest.fixture(params=SETTINGS, ids=["shipped", "unswapped-n128", "swapped-waves4", "min-groups1"])
def settings(request):
    return request.param


SHAPES = [(1, 4096, 4096), (5, 1024, 4096), (16, 12288, 4096), (33, 4096, 12288), (64, 200, 300), (64, 4096, 4096)]


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_the_gemm_matches_the_dequantized_reference(m, n, k, scale_format, settings):
    _need_kernel()
    x, w_q, w_s = _operands(m, n, k, torch.bfloat16, scale_format=scale_format)
    x_q, x_s = quantize_fp8_groups(x, scale_format=scale_format)
    out = dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, out_dtype=torch.float32, settings=settings)
    ref = _reference(x, w_q, w_s, scale_format=scale_format)
    # FP8 MMAs accumulate 128-long dots in reduced precision; the other backends land at 1.2-1.5e-4 too.
    assert out.shape == (m, n) and relative_error(out, ref) < 3e-4, relative_error(out, ref)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_bias_is_added_in_fp32_and_a_repeat_gives_the_same_bits(m, n, k, settings):
    """Deterministic; the bias added to the FP32 sums, rounded once; a rollout-phase QuantLinear's
    decode path (act-quant kernel, then this GEMM with the recipe's settings) gives the same bits."""
    _need_kernel()
    x, w_q, w_s = _operands(m, n, k, torch.bfloat16, seed=1)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x_q, x_s = quantize_fp8_groups(x)
    out = dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, bias, out_dtype=torch.bfloat16, settings=settings)
    again = dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, bias, out_dtype=torch.bfloat16, settings=settings)
    rollout = decode_linear_fp8(x, w_q, w_s, bias, FP8Recipe(decode_gemm=settings), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, again) and torch.equal(out, rollout)
    assert relative_error(out, _reference(x, w_q, w_s, bias)) < 4e-3  # one rounding to BF16, as the general path


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_partial_sums_reduced_in_order_give_the_gemms_bits(m, n, k, settings):
    """``fp8_decode_gemm_partials``: one FP32 slice per planned K split (the GEMM's own output when K
    is not split), which, added in split order with the bias and rounded once, is the full GEMM."""
    _need_kernel()
    x, w_q, w_s = _operands(m, n, k, torch.bfloat16, seed=2)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x_q, x_s = quantize_fp8_groups(x)
    parts = dg.fp8_decode_gemm_partials(x_q, x_s, w_q, w_s, settings=settings)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert parts.dtype == torch.float32 and parts.shape == (dg.plan(m, n, k, sms, settings).splits, m, n)
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    for b in (None, bias):
        total = acc + b.float() if b is not None else acc
        want = dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, b, out_dtype=torch.bfloat16, settings=settings)
        assert torch.equal(total.bfloat16(), want)


def _captured(fn):
    """``fn`` warmed up on a side stream (Triton compiles), then captured: ``(graph, its output)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@CUDA
def test_a_cuda_graph_replays_new_activations_and_refreshed_weights(settings):
    _need_kernel()
    x, w_q, w_s = _operands(16, 4096, 4096, torch.bfloat16, seed=2)
    x_q, x_s = (t.contiguous() for t in quantize_fp8_groups(x))
    graph, out = _captured(lambda: dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, settings=settings))
    x2, w_q2, w_s2 = _operands(16, 4096, 4096, torch.bfloat16, seed=3)
    q2, s2 = quantize_fp8_groups(x2)
    x_q.copy_(q2)
    x_s.copy_(s2)
    w_q.copy_(w_q2)
    w_s.copy_(w_s2)
    graph.replay()
    assert torch.equal(out, dg.fp8_decode_gemm_nt(q2, s2, w_q2, w_s2, settings=settings))


@pytest.mark.gpu
@CUDA
def test_a_rollout_phase_quantlinear_takes_the_kernel_at_decode_m_only(monkeypatch):
    """Up to the recipe's ``decode_gemm.max_m`` rows, launched with the recipe's settings; the general
    path above it and under autograd."""
    _need_kernel()
    linear = torch.nn.Linear(4096, 1024, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(linear, {"train": "bf16", "rollout": "fp8"})
    calls = []
    real = dg.fp8_decode_gemm_nt
    monkeypatch.setattr(dg, "fp8_decode_gemm_nt", lambda *a, **kw: calls.append((a[0].shape[0], kw["settings"]))
                        or real(*a, **kw))  # fmt: skip
    general = "scaled_mm" if "scaled_mm" in kernels.available_gemm_backends("cuda") else "triton"

    def check(m):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad(), PrecisionPhases(layer).rollout():
            y = layer(x)
            with kernels.use_gemm_backend(general):
                reference = layer(x)
        # The same FP8 operands; BF16 output rounding and summation order differ.
        assert relative_error(y, reference) < 4e-3, (m, relative_error(y, reference))

    for m in (1, 64, 65, 512):
        check(m)
    shipped = DecodeGemmSettings()
    assert calls == [(1, shipped), (64, shipped)]  # act quant, then the prequantized kernel
    narrow = DecodeGemmSettings(max_m=16, min_groups_per_split=1)
    layer.set_recipes(rollout=FP8Recipe(decode_gemm=narrow))
    for m in (16, 17):
        check(m)
    assert calls[2:] == [(16, narrow)]
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with PrecisionPhases(layer).rollout():
        layer(x).sum().backward()  # autograd keeps the general path (it saves X_q for the backward)
    assert len(calls) == 3 and x.grad is not None
    monkeypatch.setenv("JETRL_GEMM_BACKEND", general)  # picks the general path's backend only
    kernels.reset_kernel_caches()
    try:
        with torch.no_grad(), PrecisionPhases(layer).rollout():
            layer(torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16))
    finally:
        monkeypatch.delenv("JETRL_GEMM_BACKEND")
        kernels.reset_kernel_caches()
    assert len(calls) == 4 and calls[3] == (8, narrow)  # the decode GEMM still ran


GROUPS = [(16, [4096, 1024, 1024], 4096), (64, [4096, 1024, 1024], 4096), (1, [12288, 12288], 4096),
          (64, [12288, 12288], 4096), (7, [200, 72, 72], 300), (33, [128, 64], 1024),
          (256, [4096, 1024, 1024], 4096), (130, [200, 72, 72], 300)]  # fmt: skip  # the last two: several M tiles


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("m, widths, k", GROUPS)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_launch_computes_each_weight_and_is_deterministic(m, widths, k, bias, settings):
    """q/k/v (or gate/up) in one launch: each output matches its own weight's reference, as the
    single-weight kernel does, and a repeat gives the same bits."""
    _need_kernel()
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 3).to("cuda", torch.bfloat16)
    x_q, x_s = quantize_fp8_groups(x)
    weights = []
    for n in widths:
        w_q, w_s = quantize_fp8_blocks((torch.randn(n, k, generator=g) * 0.05).cuda())
        weights.append((w_q.contiguous(), w_s.contiguous()))
    biases = [torch.randn(n, generator=g).to("cuda", torch.bfloat16) for n in widths] if bias else []
    outs = dg.fp8_decode_gemm_grouped(x_q, x_s, weights, biases, out_dtype=torch.float32, settings=settings)
    again = dg.fp8_decode_gemm_grouped(x_q, x_s, weights, biases, out_dtype=torch.float32, settings=settings)
    for i, ((w_q, w_s), out) in enumerate(zip(weights, outs)):
        ref = _reference(x, w_q, w_s, biases[i] if bias else None)
        assert out.shape == (m, widths[i]) and relative_error(out, ref) < 3e-4, (i, relative_error(out, ref))
        assert torch.equal(out, again[i])
        single = dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, biases[i] if bias else None, out_dtype=torch.float32,
                                       settings=settings)  # fmt: skip
        assert relative_error(out, single) < 1e-5  # the same operands; only the K split may differ


@pytest.mark.gpu
@CUDA
def test_grouped_launch_replays_in_a_cuda_graph():
    _need_kernel()
    x_q, x_s = quantize_fp8_groups(torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16))
    weights = [tuple(t.contiguous() for t in quantize_fp8_blocks(torch.randn(n, 4096, device="cuda") * 0.05))
               for n in (4096, 1024, 1024)]  # fmt: skip
    graph, outs = _captured(lambda: dg.fp8_decode_gemm_grouped(x_q, x_s, weights))
    new_q, new_s = quantize_fp8_groups(torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16))
    x_q.copy_(new_q)
    x_s.copy_(new_s)
    graph.replay()
    for out, want in zip(outs, dg.fp8_decode_gemm_grouped(new_q, new_s, weights)):
        assert torch.equal(out, want)


def test_grouped_launch_refuses_bad_operands():
    w = quantize_fp8_blocks(torch.randn(128, 256))
    with pytest.raises(ValueError, match="2 or 3 weights"):
        dg.fp8_decode_gemm_grouped(*quantize_fp8_groups(torch.randn(4, 256)), [w])
    with pytest.raises(ValueError, match="every weight"):
        dg.fp8_decode_gemm_grouped(*quantize_fp8_groups(torch.randn(4, 256)), [w, w], [torch.zeros(128), None])
    with pytest.raises(ValueError, match="CUDA"):
        dg.fp8_decode_gemm_grouped(*quantize_fp8_groups(torch.randn(4, 256)), [w, w])


def test_grouped_plan_counts_the_tiles_of_every_weight():
    # gate alone of Qwen3-8B at M = 64 (192 N tiles) takes 2 K splits; gate and up together (384 tiles)
    # fill the GPU with one. q alone and q/k/v both take 4.
    assert dg.plan(64, 12288, 4096, sms=132).splits == 2
    assert dg.plan(64, [12288, 12288], 4096, sms=132).splits == 1
    assert dg.plan(64, [4096], 4096, sms=132) == dg.plan(64, 4096, 4096, sms=132)
    assert dg.plan(64, 4096, 4096, sms=132).splits == dg.plan(64, [4096, 1024, 1024], 4096, sms=132).splits == 4


def test_grouped_partials_refuse_bad_operands():
    w = quantize_fp8_blocks(torch.randn(128, 256))
    with pytest.raises(ValueError, match="2 or 3 weights"):
        dg.fp8_decode_gemm_grouped_partials(*quantize_fp8_groups(torch.randn(4, 256)), [w] * 4)
    with pytest.raises(ValueError, match="CUDA"):
        dg.fp8_decode_gemm_grouped_partials(*quantize_fp8_groups(torch.randn(4, 256)), [w, w])


# -- in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 pytest -m interpreter) -----------------------

# Triton's interpreter rounds FP32 -> BF16 toward zero where the GPU rounds to nearest even (2.6856
# becomes 2.671875, not torch's 2.6875), so the bit tests here compare FP32 results; the CUDA tests
# compare BF16 bits.


def _reference_gemm(x_q, x_s, w_q, w_s):
    return dequantize_fp8_groups(x_q, x_s).double() @ dequantize_fp8_blocks(w_q, w_s).double().t()


GEMMS = [(5, [200], 400), (16, [256, 64, 64], 512), (33, [128, 192], 384), (64, [130], 256), (16, [256, 64, 64], 2048)]


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


# -- compiled for sm_90 without a GPU (JETRL_COMPILE_SM90=1 pytest -m sm90) ----------------------------------


def _gemm_pointers() -> dict[str, str]:
    types = dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", w1_ptr="*fp8e4nv", w2_ptr="*fp8e4nv", out_ptr="*bf16",
                 out1_ptr="*bf16", out2_ptr="*bf16")  # fmt: skip
    for name in ("xs_ptr", "ws_ptr", "part_ptr", "bias_ptr", "ws1_ptr", "bias1_ptr", "ws2_ptr", "bias2_ptr"):
        types[name] = "*fp32"
    return types


@pytest.mark.sm90
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
    ptx = compile_sm90(jit.fp8_decode_gemm_kernel, _gemm_pointers(), constexprs,
                       launch=dict(num_warps=settings.num_warps, num_stages=settings.num_stages))  # fmt: skip
    assert "wgmma" in ptx
    assert "cp.async.cg.shared.global" in ptx


@pytest.mark.sm90
@pytest.mark.parametrize("partials", [False, True])
def test_one_split_grouped_launch_stores_its_partials_only_where_asked(partials):
    """``PARTIALS`` (``fp8_decode_gemm_grouped_partials`` with one K split): the FP32 sums go to the
    partials layout, and the output dtype's conversion and the bias are gone."""
    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_gemm_jit")
    constexprs = dict(GROUPS_PER_SPLIT=4, SPLITS=1, BLOCK_M=16, BLOCK_N=64, SWAP=True, HAS_BIAS=True, SEGMENTS=3,
                      PARTIALS=partials)  # fmt: skip
    ptx = compile_sm90(jit.fp8_decode_gemm_kernel, _gemm_pointers(), constexprs, launch=dict(num_warps=4, num_stages=3))
    assert "wgmma" in ptx
    assert ("cvt.rn.bf16" in ptx) != partials  # the BF16 output's rounding only without partials


@pytest.mark.sm90
@pytest.mark.parametrize("segments, bias", [(1, False), (3, True)])
def test_splitk_reduce_compiles(segments, bias):
    jit = importlib.import_module("jetrl_trainer.kernels._triton_decode_gemm_jit")
    pointers = dict(part_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", bias1_ptr="*bf16", out1_ptr="*bf16",
                    bias2_ptr="*bf16", out2_ptr="*bf16")  # fmt: skip
    constexprs = dict(SPLITS=3, HAS_BIAS=bias, BLOCK=1024, SEGMENTS=segments)
    ptx = compile_sm90(jit.splitk_reduce_kernel, pointers, constexprs, launch=dict(num_warps=4))
    assert "ld.global" in ptx and "st.global" in ptx
