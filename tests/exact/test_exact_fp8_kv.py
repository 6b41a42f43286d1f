"""The exact contract with the FP8 KV cache: the engine stores keys (after RoPE) and values in FP8 E4M3
with one scale per token and KV head, and the training forward's attention reads them through the
same rounding (`fp8_kv_roundtrip`), so every recorded log-prob is still the training forward's bit
for bit: tiny Llama (llama3 RoPE), Qwen2 and Qwen3, FP8 and BF16 recipes, ragged left-padded prompts,
refill with fewer slots than sequences, and rollouts past 1,024 positions."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _engine_contract import BUILDERS, DEVICES, assert_exact, autocast_for, rollout, tiny_model, training_forward

from jetrl_trainer.exact import straight_through
from jetrl_trainer.rollout.engine import fp8_kv_roundtrip
from jetrl_trainer.rollout.engine.kv_cache import KVCache

NONE = contextlib.nullcontext
# Ragged prompts, one of 900 tokens, and rollouts that end at different lengths: the first row decodes
# past position 1,024 (a long prompt rather than a long completion keeps the CPU test short).
_tokens = torch.randint(3, 200, (1200,), generator=torch.Generator().manual_seed(0)).tolist()
LONG_PROMPTS = [_tokens[:900], [5, 6, 7], _tokens[900:1200], [5, 6, 7]]
LONG_BUDGETS = [140, 100, 60, 90]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize(("master", "autocast"), [(torch.float32, False), (torch.bfloat16, False),
                                                  (torch.float32, True)])  # fmt: skip
def test_fp8_cache_recorded_logprobs_are_the_training_forwards_bits(device, recipe, master, autocast):
    """Qwen3 (q/k norms before RoPE) in both recipes and every precision setting; the three
    architectures run in the long test below."""
    model = tiny_model("qwen3", recipe, master, device)
    ac = autocast_for(device, autocast)
    tokens, recorded = rollout(model, autocast=ac, kv_cache_dtype="fp8")
    assert_exact(model, tokens, recorded, autocast=ac, device=device, kv_cache_dtype="fp8")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_fp8_cache_past_1024_positions_with_refill(device, arch):
    """Ragged prompts, 2 slots for 4 sequences (refilled as rows finish), the longest row at 1,040
    positions: the same bits as all slots at once with the prompts prefilled 100 positions at a time
    (`EngineSettings.prefill_chunk`), and those are the training forward's."""
    model = tiny_model(arch, "fp8", torch.float32, device, max_position_embeddings=2048)
    run = dict(autocast=NONE, prompts=LONG_PROMPTS, new_tokens=max(LONG_BUDGETS), budgets=LONG_BUDGETS,
               kv_cache_dtype="fp8")  # fmt: skip
    tokens, recorded = rollout(model, slots=2, **run)
    assert [len(t) for t in tokens] == LONG_BUDGETS
    assert max(len(p) + len(t) for p, t in zip(LONG_PROMPTS, tokens)) > 1024
    assert (tokens, recorded) == rollout(model, prefill_chunk=100, **run)
    assert_exact(model, tokens, recorded, autocast=NONE, device=device, prompts=LONG_PROMPTS, kv_cache_dtype="fp8",
                 micro_batches=((False, 4), (True, 3)))  # fmt: skip


def test_fp8_cache_read_plainly_breaks_the_contract():
    """The check can fail: the FP8 cache's rollout scored by a training forward that reads keys and values
    unrounded differs, and the FP8 cache records other log-probs than the model-dtype cache."""
    model = tiny_model("qwen3", "fp8", torch.float32, "cpu")
    tokens, recorded = rollout(model, autocast=NONE, kv_cache_dtype="fp8")
    plain, mask, expected = training_forward(model, tokens, recorded, autocast=NONE, device="cpu", grad=False,
                                             batch_size=len(tokens))  # fmt: skip
    assert not torch.equal(plain[mask], expected[mask])
    assert torch.allclose(plain[mask], expected[mask], atol=0.1)  # the same policy, keys and values rounded
    model_dtype_cache = rollout(model, autocast=NONE)
    assert model_dtype_cache[1] != recorded


def test_the_roundtrip_is_what_the_cache_returns():
    """`fp8_kv_roundtrip` gives the bits `KVCache.read(dtype=float32)` returns for an appended key."""
    torch.manual_seed(0)
    cache = KVCache(num_layers=1, num_slots=2, max_len=4, num_kv_heads=3, head_dim=16, dtype=torch.bfloat16,
                    device=torch.device("cpu"), fp8=True)  # fmt: skip
    k, v = torch.randn(2, 3, 16, dtype=torch.bfloat16) * 5, torch.randn(2, 3, 16, dtype=torch.bfloat16)
    cache.append(0, torch.tensor([1, 0]), k, v)
    keys, values = cache.read(0, torch.tensor([1, 0]), 1, dtype=torch.float32)
    assert torch.equal(keys[:, :, 0], fp8_kv_roundtrip(k)) and torch.equal(values[:, :, 0], fp8_kv_roundtrip(v))
    assert not torch.equal(fp8_kv_roundtrip(k), k.float())  # it does round


def test_gradients_pass_straight_through_the_rounding():
    x = torch.randn(5, 16, requires_grad=True)
    y = straight_through(x, fp8_kv_roundtrip)
    assert torch.equal(y, fp8_kv_roundtrip(x.detach()))
    (y * torch.arange(16.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(16.0).expand(5, 16))


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_kernel_reads_the_training_forwards_keys_as_a_decode_step_reads_the_cache(device):
    """Head dim 128, BF16 queries (on CUDA the tensor-core products): each query's output over the cache
    in place (codes and scales, one decode step) equals the training forward's exact attention through
    the roundtrip, whose gradients are the torch version's through the straight-through rounding.
    Handing the kernel the roundtrip's FP32 values instead changed bits in one query of three on an
    H100 (session 24), whence `FP8KVRoundtrip.encode`."""
    from jetrl_trainer.exact import ops
    from jetrl_trainer.rollout.engine import kv_roundtrip

    b, h, h_kv, t, d = (2, 32, 8, 300, 128) if device == "cuda" else (2, 4, 2, 70, 128)  # the interpreter is slow
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=g).to(device, torch.bfloat16).requires_grad_() for n in (h, h_kv, h_kv))
    valid = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None].expand(b, t, t)
    roundtrip = kv_roundtrip("fp8")
    trained = ops.exact_attention(q, k, v, valid, 0.088, kv_roundtrip=roundtrip)
    (k_codes, k_scale), (v_codes, v_scale) = roundtrip.encode(k.detach()), roundtrip.encode(v.detach())
    first, rows = torch.zeros(b, dtype=torch.long, device=device), torch.arange(b, device=device)
    for p in (0, 5, 64, t // 2 + 7, t - 1):
        step = ops.exact_attention_over_runs(q.detach()[:, :, p : p + 1], k_codes, v_codes, first,
                                             torch.full((b, 1), p, device=device), 0.088, kv_rows=rows,
                                             k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        assert torch.equal(step[:, :, 0], trained.detach()[:, :, p]), f"query {p}"
    weights = torch.randn(trained.shape, generator=g).to(device)
    grads = torch.autograd.grad((trained.float() * weights).sum(), (q, k, v))
    reference = ops._torch_attention(q, straight_through(k, roundtrip), straight_through(v, roundtrip), valid, 0.088)
    expected = torch.autograd.grad((reference.float() * weights).sum(), (q, k, v))
    assert all(torch.allclose(a.float(), e.float(), atol=5e-2, rtol=5e-2) for a, e in zip(grads, expected))
