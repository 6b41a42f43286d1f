"""The decode-sized FP8 linear (kernels/triton_decode_gemm.py): its launch plan and dispatch on CPU;
on CUDA, the prologue's quantization bit for bit against ``quantize_fp8_groups``, the GEMM against
the dequantized reference, both operand modes, bias, determinism, CUDA-graph replay, and that a
rollout-phase ``QuantLinear`` takes it at decode M and only there."""

from __future__ import annotations

import math

import pytest
import torch

from jetrl_trainer import kernels
from jetrl_trainer.kernels import triton_decode_gemm as dg
from jetrl_trainer.quant import PrecisionPhases, QuantLinear
from jetrl_trainer.quant._dispatch import decode_gemm_module, decode_linear_fp8
from jetrl_trainer.quant.fp8 import dequantize_fp8_blocks, dequantize_fp8_groups, quantize_fp8_blocks, quantize_fp8_groups
from jetrl_trainer.quant.testing import relative_error


@pytest.mark.parametrize("balance", [0, 1])
@pytest.mark.parametrize("min_groups", [1, 4])
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64, 100])
@pytest.mark.parametrize("n, k", [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (200, 300)])
def test_plan_covers_every_k_group_exactly_once(m, n, k, min_groups, balance):
    cfg = dg.plan(m, n, k, sms=132, launch=dict(MIN_GROUPS_PER_SPLIT=min_groups, BALANCE=balance))
    groups = math.ceil(k / 128)
    per, splits = cfg["GROUPS_PER_SPLIT"], cfg["SPLITS"]
    assert per * splits >= groups > per * (splits - 1)  # no split is empty, none is missing
    assert 16 <= cfg["BLOCK_M"] <= 64 and cfg["BLOCK_M"] & (cfg["BLOCK_M"] - 1) == 0
    assert cfg["BLOCK_M"] >= min(m, 64)
    tiles = math.ceil(n / cfg["BLOCK_N"]) * math.ceil(m / cfg["BLOCK_M"])
    if splits > 1:  # never below the minimum length; the WAVES rule splits only as far as the GPU needs programs
        assert per >= min(min_groups, groups) or per * splits == groups
        assert balance or tiles * (splits - 1) < dg.LAUNCH["WAVES"] * 132


def test_plan_keeps_splits_long_enough_to_stream():
    # k/v of Qwen3-8B on 132 SMs: 16 N tiles; 2 waves would want 17 splits of 2 groups, the minimum gives 8 of 4.
    waves = dict(BALANCE=0)  # the WAVES rule
    cfg = dg.plan(64, 1024, 4096, sms=132, launch=waves)
    assert (cfg["SPLITS"], cfg["GROUPS_PER_SPLIT"]) == (8, 4)
    assert dg.plan(64, 1024, 4096, sms=132) == cfg  # balanced (the default): the same 8 of 4
    cfg = dg.plan(64, 1024, 4096, sms=132, launch=dict(waves, MIN_GROUPS_PER_SPLIT=1))
    assert (cfg["SPLITS"], cfg["GROUPS_PER_SPLIT"]) == (16, 2)
    assert dg.plan(16, 4096, 12288, sms=132, launch=waves)["SPLITS"] == 5  # down: long K, the waves decide


def _busiest_sm_groups(cfg, tiles, sms=132):
    """K groups the busiest SM streams when the launch's programs spread evenly over ``sms`` SMs."""
    return math.ceil(tiles * cfg["SPLITS"] / sms) * cfg["GROUPS_PER_SPLIT"]


def test_balanced_plan_evens_the_sms_work_out():
    """LAUNCH["BALANCE"]: the Qwen3-8B decode launches at M <= 64 (one M tile of 64-row N tiles) split
    K so that no SM holds a third program while others hold two (q/k/v: 4 splits, not 3; o and down: 4,
    not 5); gate/up keep one split. Over many shapes it never leaves the busiest SM more K groups than
    the WAVES rule, covers every group once and keeps splits as long as the minimum asks."""
    balance = dict(BALANCE=1)
    for m in (1, 16, 64):
        assert dg.plan(m, [4096, 1024, 1024], 4096, sms=132, launch=balance)["SPLITS"] == 4  # 384 programs of 8
        assert dg.plan(m, 4096, 4096, sms=132, launch=balance)["SPLITS"] == 4  # o: 256 programs of 8
        assert dg.plan(m, 4096, 12288, sms=132, launch=balance)["SPLITS"] == 4  # down: 256 programs of 24
        assert dg.plan(m, [12288, 12288], 4096, sms=132, launch=balance)["SPLITS"] == 1
    assert dg.plan(64, 4096, 12288, sms=132)["SPLITS"] == 4  # on by default
    assert dg.plan(64, 4096, 12288, sms=132, launch=dict(BALANCE=0))["SPLITS"] == 5
    for m in (1, 16, 33, 64, 128, 256):
        for widths, k in [([4096], 4096), ([1024], 4096), ([4096, 1024, 1024], 4096), ([12288, 12288], 4096),
                          ([4096], 12288), ([200], 300), ([5120, 1024, 1024], 5120), ([2048], 8192)]:  # fmt: skip
            for sms in (78, 114, 132):
                launch = dict(MAX_BLOCK_M=64, BALANCE=1)
                cfg, waves = dg.plan(m, widths, k, sms, launch), dg.plan(m, widths, k, sms, dict(launch, BALANCE=0))
                tiles = sum(math.ceil(w / cfg["BLOCK_N"]) for w in widths) * math.ceil(m / cfg["BLOCK_M"])
                groups, per, splits = math.ceil(k / 128), cfg["GROUPS_PER_SPLIT"], cfg["SPLITS"]
                assert per * splits >= groups > per * (splits - 1)
                assert per >= min(4, groups)
                assert _busiest_sm_groups(cfg, tiles, sms) <= _busiest_sm_groups(waves, tiles, sms), (m, widths, k, sms)


def test_weight_prefetch_hints_go_to_split_launches_only():
    """LAUNCH["PREFETCH_AHEAD"]: the short launches that split K take it; the one-split gate/up launch
    (whose registers it would push to two programs per SM) does not; off by default."""
    ahead = dict(PREFETCH_AHEAD=4)
    assert dg.plan(64, [4096, 1024, 1024], 4096, sms=132, launch=ahead)["PREFETCH_AHEAD"] == 4
    assert dg.plan(64, 4096, 12288, sms=132, launch=ahead)["PREFETCH_AHEAD"] == 4
    assert dg.plan(64, [12288, 12288], 4096, sms=132, launch=ahead)["PREFETCH_AHEAD"] == 0
    assert dg.plan(64, 4096, 12288, sms=132)["PREFETCH_AHEAD"] == 0


def test_dispatch_steps_aside_off_cuda_and_in_a_use_gemm_backend_block_only(monkeypatch):
    x = torch.randn(4, 256)
    w_q, w_s = quantize_fp8_blocks(torch.randn(128, 256))
    assert decode_linear_fp8(x, w_q, w_s, None, "fp32", torch.float32) is None  # CPU: the general path
    # The rest of the rule on a stand-in for a CUDA activation and the kernel module.
    kernel = type("DecodeGemm", (), {"DECODE_MAX_M": 64})
    monkeypatch.setattr(kernels, "triton_enabled", lambda: True)
    monkeypatch.setattr(kernels, "optional_module", lambda name: kernel if name == "triton_decode_gemm" else None)
    decode_sized = type("CudaActivation", (), {"is_cuda": True, "shape": (4, 256)})()
    assert decode_gemm_module(decode_sized) is kernel
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "emulated")
    kernels.reset_kernel_caches()
    try:
        assert kernels.gemm_backend_forced() == "emulated"  # the general path's backend...
        assert decode_gemm_module(decode_sized) is kernel  # ...and the rollout's decode GEMM stays on
    finally:
        monkeypatch.delenv("JETRL_GEMM_BACKEND")
        kernels.reset_kernel_caches()
    with kernels.use_gemm_backend("emulated"):  # the scoped switch of tests and benchmarks: every GEMM
        assert decode_gemm_module(decode_sized) is None


def test_the_kernel_refuses_cpu_tensors():
    w_q, w_s = quantize_fp8_blocks(torch.randn(128, 256))
    with pytest.raises(ValueError, match="CUDA"):
        dg.fp8_decode_linear(torch.randn(4, 256), w_q, w_s)


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


# shipped, never / always swapped, short splits, scales loaded in place (before SCALE_AHEAD), TMA loads,
# the K split by the WAVES rule (before BALANCE)
LAUNCHES = [dict(), dict(SWAP_BELOW_M=0, BLOCK_N=128), dict(SWAP_BELOW_M=128, WAVES=4), dict(MIN_GROUPS_PER_SPLIT=1),
            dict(SCALE_AHEAD=0), dict(TMA=1), dict(BALANCE=0)]  # fmt: skip


@pytest.fixture(params=LAUNCHES, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def launch(request, monkeypatch):
    for key, value in request.param.items():
        monkeypatch.setitem(dg.LAUNCH, key, value)
    return request.param


SHAPES = [(1, 4096, 4096), (5, 1024, 4096), (16, 12288, 4096), (33, 4096, 12288), (64, 200, 300), (64, 4096, 4096)]


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_prologue_quantization_is_bit_identical_and_the_gemm_matches(m, n, k, dtype, scale_format, launch):
    _need_kernel()
    x, w_q, w_s = _operands(m, n, k, dtype, scale_format=scale_format)
    out, q, s = dg.fp8_decode_linear(x, w_q, w_s, scale_format=scale_format, out_dtype=torch.float32,
                                     return_quantized=True)  # fmt: skip
    q_ref, s_ref = quantize_fp8_groups(x, scale_format=scale_format)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    ref = _reference(x, w_q, w_s, scale_format=scale_format)
    # FP8 MMAs accumulate 128-long dots in reduced precision; the other backends land at 1.2-1.5e-4 too.
    assert out.shape == (m, n) and relative_error(out, ref) < 3e-4, relative_error(out, ref)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_prequantized_operand_gives_the_same_bits_and_bias_is_added_in_fp32(m, n, k, launch):
    _need_kernel()
    x, w_q, w_s = _operands(m, n, k, torch.bfloat16, seed=1)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    fused = dg.fp8_decode_linear(x, w_q, w_s, bias)
    again = dg.fp8_decode_linear(x, w_q, w_s, bias)
    pre = dg.fp8_decode_gemm_nt(*quantize_fp8_groups(x), w_q, w_s, bias, out_dtype=torch.bfloat16)
    assert fused.dtype == torch.bfloat16 and torch.equal(fused, again) and torch.equal(fused, pre)  # deterministic
    assert relative_error(fused, _reference(x, w_q, w_s, bias)) < 4e-3  # one rounding to BF16, as the general path


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_partial_sums_reduced_in_order_give_the_gemms_bits(m, n, k, launch):
    """``fp8_decode_gemm_partials``: one FP32 slice per planned K split (the GEMM's own output when K
    is not split), which, added in split order with the bias and rounded once, is the full GEMM."""
    _need_kernel()
    x, w_q, w_s = _operands(m, n, k, torch.bfloat16, seed=2)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x_q, x_s = quantize_fp8_groups(x)
    parts = dg.fp8_decode_gemm_partials(x_q, x_s, w_q, w_s)
    assert parts.dtype == torch.float32 and parts.shape == (dg.plan(m, n, k, torch.cuda.get_device_properties(0)
                                                                    .multi_processor_count)["SPLITS"], m, n)  # fmt: skip
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    for b in (None, bias):
        total = acc + b.float() if b is not None else acc
        assert torch.equal(total.bfloat16(), dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, b, out_dtype=torch.bfloat16))


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
def test_a_cuda_graph_replays_new_activations_and_refreshed_weights(launch):
    _need_kernel()
    x, w_q, w_s = _operands(16, 4096, 4096, torch.bfloat16, seed=2)
    static = x.clone()
    graph, out = _captured(lambda: dg.fp8_decode_linear(static, w_q, w_s))
    x2, w_q2, w_s2 = _operands(16, 4096, 4096, torch.bfloat16, seed=3)
    static.copy_(x2)
    w_q.copy_(w_q2)
    w_s.copy_(w_s2)
    graph.replay()
    assert torch.equal(out, dg.fp8_decode_linear(x2, w_q2, w_s2))


@pytest.mark.gpu
@CUDA
def test_a_rollout_phase_quantlinear_takes_the_kernel_at_decode_m_only(monkeypatch):
    _need_kernel()
    linear = torch.nn.Linear(4096, 1024, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(linear, {"train": "bf16", "rollout": "fp8"})
    calls = {"prologue": [], "prequantized": []}
    for name, kind in (("fp8_decode_linear", "prologue"), ("fp8_decode_gemm_nt", "prequantized")):
        real = getattr(dg, name)
        monkeypatch.setattr(dg, name, lambda *a, _real=real, _kind=kind, **kw: calls[_kind].append(a[0].shape[0]) or _real(*a, **kw))
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
    assert calls == {"prologue": [], "prequantized": [1, 64]}  # act quant, then the prequantized form
    monkeypatch.setattr(dg, "PROLOGUE_MAX_M", 16)
    for m in (1, 17):
        check(m)
    assert calls == {"prologue": [1], "prequantized": [1, 64, 17]}
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with PrecisionPhases(layer).rollout():
        layer(x).sum().backward()  # autograd keeps the general path (it saves X_q for the backward)
    assert calls == {"prologue": [1], "prequantized": [1, 64, 17]} and x.grad is not None
    monkeypatch.setenv("JETRL_GEMM_BACKEND", general)  # picks the general path's backend only
    kernels.reset_kernel_caches()
    try:
        with torch.no_grad(), PrecisionPhases(layer).rollout():
            layer(torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16))
    finally:
        monkeypatch.delenv("JETRL_GEMM_BACKEND")
        kernels.reset_kernel_caches()
    assert calls == {"prologue": [1, 8], "prequantized": [1, 64, 17]}  # the decode GEMM still ran


GROUPS = [(16, [4096, 1024, 1024], 4096), (64, [4096, 1024, 1024], 4096), (1, [12288, 12288], 4096),
          (64, [12288, 12288], 4096), (7, [200, 72, 72], 300), (33, [128, 64], 1024),
          (256, [4096, 1024, 1024], 4096), (130, [200, 72, 72], 300)]  # fmt: skip  # the last two: several M tiles


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("m, widths, k", GROUPS)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_launch_computes_each_weight_and_is_deterministic(m, widths, k, bias, launch):
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
    outs = dg.fp8_decode_gemm_grouped(x_q, x_s, weights, biases, out_dtype=torch.float32)
    again = dg.fp8_decode_gemm_grouped(x_q, x_s, weights, biases, out_dtype=torch.float32)
    for i, ((w_q, w_s), out) in enumerate(zip(weights, outs)):
        ref = _reference(x, w_q, w_s, biases[i] if bias else None)
        assert out.shape == (m, widths[i]) and relative_error(out, ref) < 3e-4, (i, relative_error(out, ref))
        assert torch.equal(out, again[i])
        single = dg.fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, biases[i] if bias else None, out_dtype=torch.float32)
        assert relative_error(out, single) < 1e-5  # the same operands; only the K split may differ


# name: (the plain launch's overrides, the variant's).
VARIANTS = {"TMA": ({}, dict(TMA=1)), "SCALE_AHEAD": (dict(SCALE_AHEAD=0), dict(SCALE_AHEAD=1)),
            "PREFETCH_AHEAD": (dict(PREFETCH_AHEAD=0), dict(PREFETCH_AHEAD=4))}  # fmt: skip


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m, widths, k", GROUPS + [(m, [n], k) for m, n, k in SHAPES])
def test_launch_variants_give_the_bits_of_the_plain_launch(m, widths, k, variant, monkeypatch):
    """LAUNCH["TMA"]: weight and activation tiles through tensor descriptors; operands TMA cannot
    address (rows not 16-byte aligned) keep pointer loads. LAUNCH["SCALE_AHEAD"]: the scales loaded
    one K group early. LAUNCH["PREFETCH_AHEAD"]: L2 hints for the weight lines 4 groups ahead. Each
    eagerly and replayed in a CUDA graph on a fresh activation."""
    _need_kernel()
    if variant == "TMA" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * 3).to("cuda", torch.bfloat16)
    x_q, x_s = quantize_fp8_groups(x)
    x_q = x_q.contiguous()
    weights = [tuple(t.contiguous() for t in quantize_fp8_blocks((torch.randn(n, k, generator=g) * 0.05).cuda()))
               for n in widths]  # fmt: skip

    def run():
        if len(weights) > 1:
            return dg.fp8_decode_gemm_grouped(x_q, x_s, weights, out_dtype=torch.float32)
        return [dg.fp8_decode_gemm_nt(x_q, x_s, *weights[0], out_dtype=torch.float32),
                dg.fp8_decode_linear(x, *weights[0], out_dtype=torch.float32)]  # fmt: skip

    plain, changed = VARIANTS[variant]
    for key, value in plain.items():
        monkeypatch.setitem(dg.LAUNCH, key, value)
    want = run()
    for key, value in changed.items():
        monkeypatch.setitem(dg.LAUNCH, key, value)
    if variant == "TMA":
        assert dg.tma_loads_apply(x_q, [w for w, _ in weights]) == (k % 16 == 0)
    for got, ref in zip(run(), want):
        assert torch.equal(got, ref)
    graph, outs = _captured(run)
    fresh = (torch.randn(m, k, generator=g) * 3).to("cuda", torch.bfloat16)
    q, s = quantize_fp8_groups(fresh)
    x_q.copy_(q), x_s.copy_(s), x.copy_(fresh)
    graph.replay()
    for key, value in plain.items():
        monkeypatch.setitem(dg.LAUNCH, key, value)
    for key in set(changed) - set(plain):
        monkeypatch.setitem(dg.LAUNCH, key, 0)
    for got, ref in zip(outs, run()):
        assert torch.equal(got, ref)


def test_tma_loads_need_a_gpu_and_aligned_rows():
    w = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    assert not dg.tma_loads_apply(None, [w])  # CPU
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        assert dg.tma_loads_apply(None, [w.cuda()])
        assert not dg.tma_loads_apply(None, [torch.zeros(64, 300, dtype=torch.float8_e4m3fn, device="cuda")])


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
    # q/k/v of Qwen3-8B at M = 64: 96 N tiles together, so the WAVES rule splits K less than for q
    # alone (64 tiles); the balanced split (the default) gives both 4.
    waves = dict(BALANCE=0)
    alone, grouped = dg.plan(64, 4096, 4096, sms=132, launch=waves), dg.plan(64, [4096, 1024, 1024], 4096, sms=132, launch=waves)
    assert grouped["SPLITS"] < alone["SPLITS"] and grouped["GROUPS_PER_SPLIT"] * grouped["SPLITS"] >= 32
    assert dg.plan(64, [4096], 4096, sms=132, launch=waves) == alone
    assert dg.plan(64, [4096], 4096, sms=132) == dg.plan(64, 4096, 4096, sms=132)
    assert dg.plan(64, 4096, 4096, sms=132)["SPLITS"] == dg.plan(64, [4096, 1024, 1024], 4096, sms=132)["SPLITS"] == 4


def test_programmatic_dependent_launch_is_off_by_default_and_only_on_hopper_cuda():
    from jetrl_trainer.kernels import _triton_support as support

    assert support.pdl_launch(torch.device("cpu")) == {"PDL": False}
    with kernels.programmatic_dependent_launch():
        assert support.pdl_launch(torch.device("cpu")) == {"PDL": False}  # no griddepcontrol off CUDA
        with kernels.programmatic_dependent_launch(False):
            assert not support._PDL["enabled"]
        assert support._PDL["enabled"]
    assert not support._PDL["enabled"]
    cfg = dg.plan(64, 1024, 4096, sms=132, launch=dict(PREFETCH_GROUPS=9))
    assert cfg["PREFETCH_GROUPS"] == cfg["GROUPS_PER_SPLIT"] == 4  # never past the program's own K slice


def _decode_layer_chain(m, k=4096, inter=12288, seed=0):
    """The FP8 kernels of one decode layer, each reading the previous one's output: norm + quant,
    grouped q/k/v, (norm + quant of q standing in for attention), o partials, add + norm + quant,
    grouped gate/up, SwiGLU + quant, down partials, add + norm + quant. Returns the input and a
    function of it giving every intermediate."""
    from jetrl_trainer.kernels import triton_norm, triton_swiglu

    g = torch.Generator(device="cuda").manual_seed(seed)

    def weight(n, kk):
        return tuple(t.contiguous() for t in quantize_fp8_blocks(torch.randn(n, kk, device="cuda", generator=g) * 0.02))

    qkv, o = [weight(n, k) for n in (k, k // 4, k // 4)], weight(k, k)
    gate_up, down = [weight(inter, k) for _ in range(2)], weight(k, inter)
    norm_w = torch.rand(k, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16) + 0.5
    h = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)

    def chain(h):
        _, x_q, x_s = triton_norm.rmsnorm_quant_fp8(h, norm_w, 1e-6)
        q, kk, v = dg.fp8_decode_gemm_grouped(x_q, x_s, qkv)
        _, a_q, a_s = triton_norm.rmsnorm_quant_fp8(q, norm_w, 1e-6)
        h1, _, y_q, y_s = triton_norm.add_rmsnorm_quant_fp8(h, dg.fp8_decode_gemm_partials(a_q, a_s, *o), norm_w, 1e-6)
        gate, up = dg.fp8_decode_gemm_grouped(y_q, y_s, gate_up)
        _, s_q, s_s = triton_swiglu.swiglu_quant_fp8(gate, up)
        h2, _, z_q, z_s = triton_norm.add_rmsnorm_quant_fp8(h1, dg.fp8_decode_gemm_partials(s_q, s_s, *down), norm_w, 1e-6)
        return [q, kk, v, h1, gate, up, h2, z_q.view(torch.uint8), z_s]

    return h, chain


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("m", [1, 16, 64])
def test_programmatic_dependent_launch_keeps_every_bit(m, monkeypatch):
    """The decode layer's kernels launched with programmatic dependent launch (and the weight
    prefetch before each GEMM's wait), eagerly and in a CUDA graph replayed on fresh inputs: every
    output bit as without it. A kernel reading before its wait would see stale or unwritten data."""
    _need_kernel()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    from jetrl_trainer.kernels import _triton_support as support
    from jetrl_trainer.kernels import triton_norm, triton_swiglu

    h, chain = _decode_layer_chain(m)
    want = chain(h)
    launched = []

    def counting(device):
        launched.append(support.pdl_launch(device)["PDL"])
        return support.pdl_launch(device)

    for module in (dg, triton_norm, triton_swiglu):
        monkeypatch.setattr(module, "pdl_launch", counting)
    with kernels.programmatic_dependent_launch():
        eager = chain(h)
        static = h.clone()
        graph, outs = _captured(lambda: chain(static))
    assert len(launched) == 3 * 9 and all(launched), launched  # 3 chains (eager, warm-up, capture) of 9 launch sites
    for a, b in zip(eager, want):
        assert torch.equal(a, b)
    for seed in range(1, 6):
        fresh = torch.randn(m, h.shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        static.copy_(fresh.to(torch.bfloat16))
        reference = chain(static.clone())  # without PDL
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(outs, reference):
                assert torch.equal(a, b), seed


def test_grouped_partials_refuse_bad_operands():
    w = quantize_fp8_blocks(torch.randn(128, 256))
    with pytest.raises(ValueError, match="2 or 3 weights"):
        dg.fp8_decode_gemm_grouped_partials(*quantize_fp8_groups(torch.randn(4, 256)), [w] * 4)
    with pytest.raises(ValueError, match="CUDA"):
        dg.fp8_decode_gemm_grouped_partials(*quantize_fp8_groups(torch.randn(4, 256)), [w, w])
