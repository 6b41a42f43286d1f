"""The exact attention kernel (`kernels/triton_exact_attention.py`, `jetrl_trainer.exact` on CUDA).

In the interpreter and on the GPU: it computes softmax attention over each query's run of keys
(ragged left padding, causal, GQA), and a query's bits are the same alone (a decode step over the
live keys), inside a whole causal sequence, with the GQA heads packed or repeated, and with
other rows around it. On the GPU also at 1k, 4k, 8k and 16k positions, against the FP64 reference.
On sm_90: it compiles.
"""

from __future__ import annotations

import pytest
import torch
from _tensors import seeded_randn as _rand

DOTS = ["fp32", "bf16"]  # ExactAttentionSettings.dot: FP32 FMA products, or tensor cores on BF16 operands
# Triton 3.6's interpreter computes a dot of BF16 operands on their raw bits (outputs ~1e8): the BF16
# dot runs on the GPU only.
DEVICE_DOTS = [pytest.param("cpu", "fp32", marks=pytest.mark.interpreter, id="cpu-fp32"),
               *(pytest.param("cuda", dot, marks=pytest.mark.gpu, id=f"cuda-{dot}") for dot in DOTS)]  # fmt: skip


# ExactAttentionSettings.split_keys: one program per row's keys, or splits of 128 keys (two tiles; the
# sequences below hold up to 200, so rows run one to three splits and some split is partly empty)
SPLITS = [pytest.param(0, id="whole"), pytest.param(128, id="split128")]


def _settings(dot, split_keys=0):
    from jetrl_trainer.kernels.settings import ExactAttentionSettings

    return ExactAttentionSettings(dot=dot, split_keys=split_keys)


def _reference(q, k, v, first, last, scale):
    """FP64 softmax attention over keys first[b] .. last[b, s]."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    t = torch.arange(k.shape[2], device=q.device)
    valid = (t[None, None, :] >= first[:, None, None]) & (t[None, None, :] <= last[:, :, None])  # (B, S, T)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v


def _causal(b, s, pads, device):
    """A left-padded causal batch: row i's keys start at pads[i], query p reads up to p."""
    first = torch.tensor(pads, device=device)
    last = torch.arange(s, device=device)[None].expand(b, s).clone()
    last[torch.arange(s, device=device)[None] < first[:, None]] = -1  # padding queries read nothing
    return first, last


@pytest.mark.parametrize(("device", "dot"), DEVICE_DOTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", SPLITS)
def test_a_decode_query_has_the_bits_of_the_same_query_in_the_sequence(device, dtype, dot, split):
    from functools import partial

    from jetrl_trainer.kernels.triton_exact_attention import exact_attention

    exact_attention = partial(exact_attention, settings=_settings(dot, split))

    b, h, h_kv, s, d = 3, 8, 2, 150, 64
    q, k, v = (_rand(b, n, s, d, dtype=dtype, device=device, seed=i) for i, n in enumerate((h, h_kv, h_kv)))
    pads = [0, 37, 100]
    first, last = _causal(b, s, pads, device)
    full = exact_attention(q, k, v, first, last, 0.125)
    real = last >= 0
    ref = _reference(q, k, v, first, last, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 and dot == "fp32" else 2e-2
    assert torch.allclose(full.double().transpose(1, 2)[real], ref.transpose(1, 2)[real], atol=tolerance)
    for pos in (pads[2], 120, s - 1):  # one query per row over its live keys, as a decode step reads the cache
        live = pos + 1
        step = exact_attention(q[:, :, pos : pos + 1], k[:, :, :live], v[:, :, :live], first,
                               torch.full((b, 1), pos, device=device), 0.125)  # fmt: skip
        for row in range(b):
            if pos >= pads[row]:
                assert torch.equal(step[row, :, 0], full[row, :, pos]), (pos, row)
    repeated = exact_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), first, last, 0.125)
    assert torch.equal(repeated[real[:, None].expand(b, h, s)], full[real[:, None].expand(b, h, s)])
    alone = exact_attention(q[1:2], k[1:2], v[1:2], first[1:2], last[1:2], 0.125)
    assert torch.equal(alone[0][:, pads[1]:], full[1][:, pads[1]:])


@pytest.mark.parametrize(("device", "dot"), DEVICE_DOTS)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("split", SPLITS)
def test_the_cache_in_place_gives_the_bits_of_its_values_read_out(device, fp8, dot, split):
    """A decode step over the engine's cache (``kv_rows`` picking slots, FP8 values with their scales)
    equals the same step over the rows' keys and values read out (FP8: `fp8_kv_roundtrip`'s FP32 values),
    which is what the training forward's attention reads."""
    from jetrl_trainer.kernels.triton_exact_attention import exact_attention
    from jetrl_trainer.rollout.engine.kv_cache import KVCache

    slots, h, h_kv, max_len, d = 5, 8, 2, 200, 64
    cache = KVCache(num_layers=1, num_slots=slots, max_len=max_len, num_kv_heads=h_kv, head_dim=d,
                    dtype=torch.bfloat16, device=torch.device(device), fp8=fp8)  # fmt: skip
    for position in range(max_len):
        k, v = (_rand(slots, h_kv, d, dtype=torch.bfloat16, device=device, seed=position * 2 + i) * 3 for i in (0, 1))
        cache.lengths.fill_(position)
        cache.append(0, torch.arange(slots, device=device), k, v)
    rows = torch.tensor([3, 0, 4], device=device)
    lengths = torch.tensor([200, 17, 130], device=device)
    q = _rand(3, h, 1, d, dtype=torch.bfloat16, device=device, seed=99)
    first, last = torch.zeros(3, dtype=torch.long, device=device), (lengths - 1)[:, None]
    scales = dict(k_scale=cache.k_scale[0], v_scale=cache.v_scale[0]) if fp8 else {}
    settings = _settings(dot, split)
    in_place = exact_attention(q, cache.k[0], cache.v[0], first, last, 0.125, settings, kv_rows=rows, **scales)
    keys, values = cache.read(0, rows, dtype=torch.float32)
    read_out = exact_attention(q, keys, values, first, last, 0.125, settings)
    assert torch.equal(in_place, read_out)


@pytest.mark.gpu
@pytest.mark.parametrize("positions", [1024, 4096, 8192, 16384])
@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("split", [pytest.param(0, id="whole"), pytest.param(1024, id="split1024")])
def test_long_contexts_against_the_reference(positions, dot, split):
    from functools import partial

    from jetrl_trainer.kernels.triton_exact_attention import exact_attention

    exact_attention = partial(exact_attention, settings=_settings(dot, split))

    b, h, h_kv, d = 2, 32, 8, 128
    k, v = (_rand(b, h_kv, positions, d, dtype=torch.bfloat16, device="cuda", seed=i) for i in (1, 2))
    q = _rand(b, h, 4, d, dtype=torch.bfloat16, device="cuda")  # the last 4 positions' queries
    first = torch.tensor([0, 300], device="cuda")
    last = torch.arange(positions - 4, positions, device="cuda")[None].expand(b, 4).contiguous()
    out = exact_attention(q, k, v, first, last, d**-0.5)
    assert torch.allclose(out.double(), _reference(q, k, v, first, last, d**-0.5), atol=2e-2)
    one = exact_attention(q[:, :, -1:], k, v, first, last[:, -1:], d**-0.5)
    assert torch.equal(one, out[:, :, -1:])


@pytest.mark.parametrize(("device", "dot"), DEVICE_DOTS)
@pytest.mark.parametrize("split", [pytest.param(0, id="whole"), pytest.param(64, id="split64")])
def test_the_exact_ops_run_it_and_differentiate_it(device, dot, split, monkeypatch):
    """`jetrl_trainer.exact.exact_attention` through the kernel (CUDA; CPU in the interpreter): its
    forward (padding queries give 0, not NaN), and its flash-style backward's gradients against
    autograd through the torch version, with GQA, left padding and tiles of 64 keys."""
    from jetrl_trainer.exact import ops

    monkeypatch.setattr(ops, "ATTENTION", _settings(dot, split))
    b, h, h_kv, s, d = 2, 4, 2, 80, 32
    q, k, v = (_rand(b, n, s, d, device=device, seed=i).requires_grad_() for i, n in enumerate((h, h_kv, h_kv)))
    first, last = _causal(b, s, [0, 10], device)
    t = torch.arange(s, device=device)
    valid = (t[None, None, :] >= first[:, None, None]) & (t[None, None, :] <= last[:, :, None])
    out = ops.exact_attention(q, k, v, valid, 0.2)
    assert torch.isfinite(out).all() and torch.equal(out[1, :, :10], torch.zeros_like(out[1, :, :10]))
    reference = ops._torch_attention(q, k, v, valid, 0.2)
    real = (last >= 0)[:, None, :, None].expand_as(out)
    tolerance = dict(fp32=(1e-5, 1e-4), bf16=(2e-2, 5e-2))[dot]  # BF16 products: flash attention's accuracy
    assert torch.allclose(out[real], reference[real], atol=tolerance[0])
    weights = _rand(*out.shape, device=device, seed=9) * real
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    assert all(torch.allclose(g, e, atol=tolerance[1]) for g, e in zip(grads, expected))


def test_auto_takes_tensor_cores_for_bf16_queries_only(monkeypatch):
    """The shipped ``dot="auto"``: tensor cores where the queries are BF16 (nothing of theirs rounded),
    FP32 FMA for FP32 and FP16 ones and under the interpreter (its BF16 dots are wrong)."""
    from jetrl_trainer.kernels.triton_exact_attention import uses_tensor_cores

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    auto = _settings("auto")
    assert uses_tensor_cores(auto, torch.bfloat16)
    assert not uses_tensor_cores(auto, torch.float32) and not uses_tensor_cores(auto, torch.float16)
    assert uses_tensor_cores(_settings("bf16"), torch.float32) and not uses_tensor_cores(_settings("fp32"), torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not uses_tensor_cores(auto, torch.bfloat16)
    with pytest.raises(ValueError, match="'auto', 'fp32' or 'bf16'"):
        _settings("tf32")


@pytest.mark.parametrize(("device", "dot"), DEVICE_DOTS)
def test_a_long_query_run_split_in_chunks_of_positions_keeps_every_bit(device, dot, monkeypatch):
    """A training forward's split states are made a chunk of positions at a time
    (``max_split_state_bytes``): 7 positions a chunk here, across the row blocks, gives the bits of
    one launch over all 150."""
    import dataclasses
    import types

    from jetrl_trainer.kernels import triton_exact_attention as module

    b, h, h_kv, s, d = 2, 4, 2, 150, 32
    q, k, v = (_rand(b, n, s, d, device=device, seed=i) for i, n in enumerate((h, h_kv, h_kv)))
    first, last = _causal(b, s, [0, 37], device)
    whole = module.exact_attention(q, k, v, first, last, 0.125, _settings(dot, 128))
    per_position = b * h * 2 * (d + 2) * 4  # two splits of 128 keys cover the 150
    chunked = dataclasses.replace(_settings(dot, 128), max_split_state_bytes=7 * per_position)
    real, launches = module.load_jit("_triton_exact_attention_jit"), []

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real.exact_attention_kernel[grid]

    monkeypatch.setattr(module, "load_jit", lambda name: types.SimpleNamespace(
        exact_attention_kernel=Counted(), exact_attention_combine_kernel=real.exact_attention_combine_kernel))  # fmt: skip
    assert torch.equal(module.exact_attention(q, k, v, first, last, 0.125, chunked), whole)
    assert len(launches) == -(-s // 7)  # 22 chunks, each its own launch
    with pytest.raises(ValueError, match="max_split_state_bytes"):
        dataclasses.replace(chunked, max_split_state_bytes=0)


def test_a_split_that_would_cut_a_key_tile_is_refused():
    """Splits are whole key tiles (a tile across two splits would be summed in neither's order)."""
    assert _settings("auto", 128).split_keys == 128
    for bad in (100, -64):
        with pytest.raises(ValueError, match="multiple of block_n"):
            _settings("auto", bad)


@pytest.mark.sm90
def test_it_compiles_for_sm90():
    from _sm90 import compile_sm90

    from jetrl_trainer.kernels import _triton_exact_attention_jit as jit

    parts = dict(part_m_ptr="*fp32", part_sum_ptr="*fp32", part_acc_ptr="*fp32")
    for kv, scaled in (("*bf16", False), ("*fp8e4nv", True)):  # the training forward; the engine's FP8 cache
        pointers = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, out_ptr="*bf16", first_ptr="*i64",
                        last_ptr="*i64", kv_rows_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                        **parts)  # fmt: skip
        for bf16_dot, split in ((False, 0), (True, 0), (True, 1024)):
            constexprs = dict(GROUP=4, HEADS_KV=8, D=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=64, KV_ROWS=scaled,
                              SCALED=scaled, BF16_DOT=bf16_dot, SPLIT=split)  # fmt: skip
            ptx = compile_sm90(jit.exact_attention_kernel, pointers, constexprs, floats=("scale",),
                               launch=dict(num_warps=4), odd=("S", "T", "ROWS", "SPLITS"))  # fmt: skip
            assert "ex2" in ptx and ("mma" in ptx) == bf16_dot  # tensor-core instructions only for the BF16 dot
    pointers = dict(out_ptr="*bf16", first_ptr="*i64", last_ptr="*i64", **parts)
    constexprs = dict(HEADS=32, D=128, BLOCK_D=128, BLOCK_R=16, SPLIT=1024)
    ptx = compile_sm90(jit.exact_attention_combine_kernel, pointers, constexprs, odd=("S", "QUERIES", "SPLITS"))
    assert "ex2" in ptx


def test_auto_takes_tensor_cores_under_bf16_autocast(monkeypatch):
    """FP32 queries under BF16 autocast (FP32 master weights with ``bf16=True``) take the tensor cores,
    as their plain attention computes in BF16 too; without autocast, or under FP16 autocast, FP32 FMA."""
    pytest.importorskip("triton", reason="the exact attention kernel needs Triton")
    from jetrl_trainer.exact import ops

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(ops, "ATTENTION", _settings("auto"))
    q = torch.zeros(1, 1, 1, 8)
    assert ops._attention_settings(q).dot == "auto"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops._attention_settings(q).dot == "bf16"
    with torch.autocast("cpu", dtype=torch.float16):
        assert ops._attention_settings(q).dot == "auto"
    monkeypatch.setattr(ops, "ATTENTION", _settings("fp32"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops._attention_settings(q).dot == "fp32"
