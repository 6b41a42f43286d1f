"""RoPE + KV append in one launch (kernels/triton_rope_append.py): the same bits as transformers'
eager ``apply_rotary_pos_emb`` and the engine's indexed cache append, for each supported family's
rotary module (llama3 scaling included), on CUDA; refused on CPU; in Triton's interpreter, the writes of
each row and the split-K reduction inside the launch. The append alone (``kv_append``, what
``KVCache.append`` launches on CUDA): the bytes of the torch append, BF16 / FP32 / FP8 caches, on CUDA
and in the interpreter. Both compile for sm_90 in test_kernels.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

from jetrl_trainer.kernels.triton_rope_append import kv_append, rope_append
from jetrl_trainer.quant.testing import assert_bits_equal
from jetrl_trainer.rollout.engine import kv_cache
from jetrl_trainer.rollout.engine.kv_cache import KVCache

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_refuses_cpu_tensors():
    q, k = torch.randn(2, 4, 32), torch.randn(2, 2, 32)
    cache = torch.zeros(3, 2, 8, 32)
    with pytest.raises(ValueError, match="CUDA kernel"):
        rope_append(q, k, k, torch.ones(2, 32), torch.zeros(2, 32), cache, cache, torch.arange(2), torch.zeros(2, dtype=torch.long))


def test_kv_append_refuses_cpu_tensors():
    k, cache = torch.randn(2, 2, 32), torch.zeros(3, 2, 8, 32)
    with pytest.raises(ValueError, match="CUDA kernel; on CPU KVCache.append writes with torch ops"):
        kv_append(k, k, cache, cache, torch.arange(2), torch.zeros(3, dtype=torch.long))


def test_the_head_dims_the_kernels_tile():
    """The one rule the kernels' checks and ``KVCache.append``'s routing (torch ops otherwise) share."""
    from jetrl_trainer.kernels.triton_rope_append import tiles_head_dim

    assert [d for d in (8, 16, 48, 64, 96, 128, 256) if tiles_head_dim(d)] == [16, 64, 128, 256]


# -- the append alone: a KVCache's layer written by the kernel and by the torch ops -----------------------

# (cache dtype, key dtype, value dtype): a BF16 cache; the exact decode's under autocast (keys FP32, values
# BF16, the cache their promoted FP32); FP8 caches encoded from either
APPEND_CASES = [
    ("bf16", torch.bfloat16, torch.bfloat16), ("fp32", torch.float32, torch.bfloat16),
    ("fp8", torch.bfloat16, torch.bfloat16), ("fp8", torch.float32, torch.bfloat16),
]  # fmt: skip
SLOTS = [4, 0, 5, 2]  # of 6: out of order, and a partial batch (slots 1 and 3 are not written)


def _filled_cache(device, cache: str, kv_heads: int, head_dim: int, seed: int) -> KVCache:
    """A 2-layer cache of 6 slots and 9 positions holding random bytes (so that any stray write shows),
    with random lengths below 9, one of them 8 (the last position) and one 0."""
    dtype = torch.float32 if cache == "fp32" else torch.bfloat16
    made = KVCache(num_layers=2, num_slots=6, max_len=9, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                   device=device, fp8=cache == "fp8")  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    for t in (made.k, made.v, made.k_scale, made.v_scale):
        if t is not None:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    lengths = torch.randint(0, 9, (6,), generator=g)
    lengths[SLOTS[:2]] = torch.tensor([8, 0])
    made.lengths.copy_(lengths)
    return made


def _new_rows(dtype: torch.dtype, kv_heads: int, head_dim: int, seed: int, specials: bool) -> torch.Tensor:
    """Keys or values ``(4, kv_heads, head_dim)`` over six decades, with an all-zero head vector, -0.0, a
    tiny vector (codes in the FP8 subnormals) and two FP8 rounding traps; ``specials`` adds NaN, Inf
    and FP32 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(SLOTS), kv_heads, head_dim, generator=g) * torch.logspace(-3, 3, len(SLOTS))[:, None, None]
    x[0, 0] = 0.0
    x[1, 0, :2] = torch.tensor([-0.0, 1e-4])
    x[2, -1] *= 1e-6
    x[2, 0, :2] = torch.tensor([448.0, 84.0])  # scale 1.0, code 84: a tie, 80 to nearest even (88 away from zero)
    if dtype == torch.float32:  # scale s: 0.094431184 / s is 15.5 exactly (16), times fp32(1 / s) 15.499999 (15)
        x[1, 0, 2:4] = torch.tensor([2.7293658, 0.094431184])
    if specials:
        x[1, -1, 0], x[3, 0, 1], x[3, -1, 2] = float("nan"), float("inf"), -float("inf")
        x[2, 0, 3:6] = torch.tensor([1e-39, -2e-40, 3e-45])
    return x.to(dtype)


def _assert_same_cache(got: KVCache, want: KVCache) -> None:
    for name in ("k", "v", "k_scale", "v_scale", "lengths"):
        if getattr(want, name) is not None:
            assert_bits_equal(getattr(got, name), getattr(want, name), name)


FAMILIES = {
    "qwen3": (modeling_qwen3, Qwen3Config(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                          rope_theta=1e6)),
    "llama3": (modeling_llama, LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                           rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                             high_freq_factor=4.0, original_max_position_embeddings=64))),
}  # fmt: skip


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_bits_as_the_eager_rope_and_append(family, dtype):
    from jetrl_trainer import kernels

    if not kernels.triton_available():
        pytest.skip("needs Triton")
    module, config = FAMILIES[family]
    B, H, H_kv, D, S, T = 7, config.num_attention_heads, config.num_key_value_heads, config.head_dim, 9, 300
    g = torch.Generator().manual_seed(0)
    rotary = module.__dict__[f"{type(config).__name__.removesuffix('Config')}RotaryEmbedding"](config, device="cuda")
    positions = torch.randint(0, T - 1, (B,), generator=g).cuda()
    positions[0] = 0
    x = torch.randn(B, 1, 8, device="cuda", dtype=dtype)
    cos, sin = rotary(x, positions[:, None])  # (B, 1, D), dtype of x
    q = (torch.randn(B, 1, H, D, generator=g) * 3).to("cuda", dtype)
    k = (torch.randn(B, 1, H_kv, D, generator=g) * 3).to("cuda", dtype)
    v = torch.randn(B, 1, H_kv, D, generator=g).to("cuda", dtype)
    slots = torch.randperm(S, generator=g)[:B].cuda()
    k_cache = torch.randn(S, H_kv, T, D, generator=g).to("cuda", dtype)
    v_cache = torch.randn(S, H_kv, T, D, generator=g).to("cuda", dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    q_eager, k_eager = module.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    k_ref[slots, :, positions] = k_eager[:, :, 0]
    v_ref[slots, :, positions] = v.transpose(1, 2)[:, :, 0]
    out = rope_append(q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], k_cache, v_cache, slots, positions)
    assert torch.equal(out, q_eager[:, :, 0])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # nothing else written


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_fused_qk_norm_gives_the_bits_of_fused_rmsnorm_then_rope(dtype, kv_fp8):
    """Qwen3's per-head q/k RMSNorms inside the launch: the bits of ``FusedRMSNorm`` (what both
    phases run) followed by the eager RoPE and the append."""
    from jetrl_trainer import kernels
    from jetrl_trainer.quant.fp8 import quantize_fp8_groups
    from jetrl_trainer.quant.fused import FusedRMSNorm

    if not kernels.triton_available():
        pytest.skip("needs Triton")
    module, config = FAMILIES["qwen3"]
    B, H, H_kv, D, S, T = 9, config.num_attention_heads, config.num_key_value_heads, config.head_dim, 11, 64
    g = torch.Generator().manual_seed(1)
    rotary = module.Qwen3RotaryEmbedding(config, device="cuda")
    positions = torch.randint(0, T - 1, (B,), generator=g).cuda()
    cos, sin = rotary(torch.zeros(B, 1, 8, device="cuda", dtype=dtype), positions[:, None])
    q = (torch.randn(B, 1, H, D, generator=g) * 3).to("cuda", dtype)
    k = (torch.randn(B, 1, H_kv, D, generator=g) * 3).to("cuda", dtype)
    q[0, 0, 0] = 0.0  # an all-zero head: 0 / sqrt(eps)
    v = torch.randn(B, 1, H_kv, D, generator=g).to("cuda", dtype)
    q_norm = FusedRMSNorm(torch.nn.Parameter((torch.randn(D, generator=g) * 0.2 + 1).to("cuda", dtype)), 1e-6)
    k_norm = FusedRMSNorm(torch.nn.Parameter((torch.randn(D, generator=g) * 0.2 + 1).to("cuda", dtype)), 1e-5)
    slots = torch.randperm(S, generator=g)[:B].cuda()
    cache_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    k_cache = torch.zeros(S, H_kv, T, D, device="cuda").to(cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = dict(k_scale=torch.zeros(S, H_kv, T, device="cuda"), v_scale=torch.zeros(S, H_kv, T, device="cuda")) if kv_fp8 else {}

    with torch.no_grad():
        q_eager, k_eager = module.apply_rotary_pos_emb(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)
        norms = (q_norm.weight, k_norm.weight, q_norm.variance_epsilon, k_norm.variance_epsilon)
        out = rope_append(q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], k_cache, v_cache, slots, positions,
                          qk_norms=norms, **scales)  # fmt: skip
    assert torch.equal(out, q_eager[:, :, 0])
    written = k_cache[slots, :, positions]  # (B, H_kv, D)
    if kv_fp8:
        k_q, k_s = quantize_fp8_groups(k_eager[:, :, 0].reshape(-1, D), group=D)
        assert torch.equal(written.view(torch.uint8).reshape(-1, D), k_q.view(torch.uint8))
        assert torch.equal(scales["k_scale"][slots, :, positions].reshape(-1), k_s.reshape(-1))
    else:
        assert torch.equal(written, k_eager[:, :, 0])
        assert torch.equal(v_cache[slots, :, positions], v[:, 0])


@pytest.mark.gpu
@CUDA
def test_refuses_norm_weights_of_another_shape_or_dtype():
    q, k = torch.randn(2, 4, 32, device="cuda"), torch.randn(2, 2, 32, device="cuda")
    cache = torch.zeros(3, 2, 8, 32, device="cuda")
    args = (q, k, k, torch.ones(2, 32, device="cuda"), torch.zeros(2, 32, device="cuda"), cache, cache,
            torch.arange(2, device="cuda"), torch.zeros(2, dtype=torch.long, device="cuda"))  # fmt: skip
    for bad in (torch.ones(16, device="cuda"), torch.ones(32, device="cuda", dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="qk_norms weights"):
            rope_append(*args, qk_norms=(bad, bad, 1e-6, 1e-6))


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("norms, bias", [(False, True), (True, False)])
@pytest.mark.parametrize("min_groups", [1, 8])
def test_from_partials_gives_the_bits_of_the_grouped_gemm_then_rope(norms, bias, min_groups):
    """q/k/v of one grouped decode GEMM left as split-K sums (several splits, or one) and reduced inside
    the RoPE + KV-append launch: the rotated q and the cache writes of the grouped launch (its own
    reduction, biases added there) followed by the plain RoPE launch, bit for bit in BF16."""
    from jetrl_trainer import kernels
    from jetrl_trainer.kernels import triton_decode_gemm as dg
    from jetrl_trainer.kernels.settings import DecodeGemmSettings
    from jetrl_trainer.kernels.triton_rope_append import rope_append_from_partials
    from jetrl_trainer.quant.fp8 import quantize_fp8_blocks, quantize_fp8_groups

    if not kernels.triton_available():
        pytest.skip("needs Triton")
    settings = DecodeGemmSettings(min_groups_per_split=min_groups)
    module, config = FAMILIES["qwen3"]
    B, H, H_kv, D, S, T, K, dtype = 16, 4, 2, 128, 20, 64, 1024, torch.bfloat16
    g = torch.Generator().manual_seed(min_groups)
    x_q, x_s = (t.cuda() for t in quantize_fp8_groups(torch.randn(B, K, generator=g) * 3))
    widths = (H * D, H_kv * D, H_kv * D)
    weights = [tuple(t.cuda() for t in quantize_fp8_blocks(torch.randn(n, K, generator=g) * 0.05)) for n in widths]
    biases = [torch.randn(n, generator=g).to("cuda", dtype) for n in widths] if bias else []
    rotary = module.Qwen3RotaryEmbedding(config, device="cuda")
    positions = torch.randint(0, T - 1, (B,), generator=g).cuda()
    cos, sin = rotary(torch.zeros(B, 1, 8, device="cuda", dtype=dtype), positions[:, None])
    slots = torch.randperm(S, generator=g)[:B].cuda()
    qk_norms = ((torch.rand(D, generator=g) + 0.5).to("cuda", dtype), (torch.rand(D, generator=g) + 0.5).to("cuda", dtype),
                1e-6, 1e-6) if norms else None  # fmt: skip
    caches = [torch.zeros(S, H_kv, T, D, device="cuda", dtype=dtype) for _ in range(4)]

    q, k, v = (t.view(B, -1, D) for t in dg.fp8_decode_gemm_grouped(x_q, x_s, weights, biases, settings=settings))
    want = rope_append(q, k, v, cos[:, 0], sin[:, 0], caches[0], caches[1], slots, positions, qk_norms=qk_norms)
    parts = dg.fp8_decode_gemm_grouped_partials(x_q, x_s, weights, settings=settings)
    assert (parts.shape[0] > 1) == (min_groups == 1)  # K = 8 groups: split, or one split (PARTIALS)
    got = rope_append_from_partials(parts, H, cos[:, 0], sin[:, 0], caches[2], caches[3], slots, positions,
                                    biases=biases or None, qk_norms=qk_norms)  # fmt: skip
    assert torch.equal(got, want)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("cache, k_dtype, v_dtype", APPEND_CASES)
def test_kv_cache_append_on_cuda_writes_the_torch_appends_bits(cache, k_dtype, v_dtype, head_dim, monkeypatch):
    """``KVCache.append`` on CUDA (the fused launch) writes the bytes its torch ops write (values, FP8
    codes and scales): what the exact contract's training forward reads back (``fp8_kv_encode``)."""
    from jetrl_trainer import kernels

    if not kernels.triton_available():
        pytest.skip("needs Triton")
    kv_heads = 8 if head_dim == 128 else 2
    k = _new_rows(k_dtype, kv_heads, head_dim, seed=1, specials=True).cuda()
    v = _new_rows(v_dtype, kv_heads, head_dim, seed=2, specials=True).cuda()
    slots = torch.tensor(SLOTS, device="cuda")
    fused, torch_ops = (_filled_cache("cuda", cache, kv_heads, head_dim, seed=head_dim) for _ in range(2))
    assert kv_cache._kv_append_kernel(k) is not None  # the fused launch runs here
    fused.append(1, slots, k, v)
    monkeypatch.setattr(kv_cache, "_kv_append_kernel", lambda x: None)
    torch_ops.append(1, slots, k, v)
    _assert_same_cache(fused, torch_ops)


# -- in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 pytest -m interpreter) -----------------------

# Triton's interpreter rounds FP32 -> BF16 toward zero where the GPU rounds to nearest even (2.6856
# becomes 2.671875, not torch's 2.6875), so the bit tests here compare FP32 results; the CUDA tests
# compare BF16 bits.


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.fixture
def fp8_cast_as_on_the_gpu(monkeypatch):
    """Triton 3.6's interpreter casts FP32 -> FP8 E4M3 rounding half away from zero and truncating in
    the subnormals (tests/conftest.py), where sm_90's ``cvt.rn.satfinite.e4m3x2.f32`` (the kernels'
    cast, checked in their PTX) rounds to nearest even and saturates at ±448. Here that cast is
    torch's: a clamp to ±448, then ``.to(float8_e4m3fn)``. So the interpreter tests check the FP8
    bytes of everything the kernel computes before the cast (scale rule, division, indexing); the GPU
    test checks the cast too."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def as_on_the_gpu(x, from_dtype, to_dtype, rounding):
        if from_dtype != tl.float32 or to_dtype != tl.float8e4nv:
            return convert(x, from_dtype, to_dtype, rounding)
        fp32 = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        return fp32.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()

    monkeypatch.setattr(interpreter, "_convert_float", as_on_the_gpu)


@pytest.mark.interpreter
@pytest.mark.parametrize("strided_slots", [False, True])
@pytest.mark.parametrize("head_dim, kv_heads", [(64, 1), (64, 2), (128, 4), (128, 8)])
@pytest.mark.parametrize("cache, k_dtype, v_dtype", APPEND_CASES)
def test_kv_append_writes_the_torch_appends_bytes(cache, k_dtype, v_dtype, head_dim, kv_heads, strided_slots,
                                                  fp8_cast_as_on_the_gpu):  # fmt: skip
    """The kernel (the op's launch code) writes one layer of a ``KVCache`` at each row's slot and length,
    byte for byte as the torch ``KVCache.append`` does (BF16 / FP32 values, FP8 codes and scales), for
    slots out of order in a partial batch, and nothing else; the slots also as the engine passes them,
    a column of its step inputs (a view with a stride of 4: read with unit stride it wrote out of bounds)."""
    from jetrl_trainer.kernels import triton_rope_append as kernel

    k = _new_rows(k_dtype, kv_heads, head_dim, seed=kv_heads, specials=False)
    v = _new_rows(v_dtype, kv_heads, head_dim, seed=kv_heads + 1, specials=False)
    slots = torch.tensor(SLOTS)
    if strided_slots:
        slots = torch.stack([slots, slots + 100, slots + 200, slots + 300], dim=1)[:, 0]
        assert slots.stride() == (4,)
    launched, torch_ops = (_filled_cache("cpu", cache, kv_heads, head_dim, seed=head_dim) for _ in range(2))
    torch_ops.append(1, slots, k, v)  # CPU tensors: the torch ops
    scales = (launched.k_scale[1], launched.v_scale[1]) if launched.fp8 else (None, None)
    kernel._kv_append_op._init_fn(k, v, launched.k[1], launched.v[1], slots, launched.lengths, *scales)
    _assert_same_cache(launched, torch_ops)
    assert not torch.equal(torch_ops.k, _filled_cache("cpu", cache, kv_heads, head_dim, seed=head_dim).k)  # written


@pytest.mark.interpreter
def test_the_engines_decode_through_the_fused_append_gives_the_torch_appends_tokens(monkeypatch):
    """The engine's torch decode path with ``KVCache.append`` launching the kernel (in the interpreter, as
    CUDA would) decodes the tokens of the torch append: the operands as the engine really passes them."""
    from transformers import GenerationConfig

    from jetrl_trainer.kernels import triton_rope_append as kernel
    from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings
    from jetrl_trainer.rollout.engine import kv_cache
    from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

    model = build_tiny_qwen3(build_tiny_tokenizer()).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [5, 6, 7, 8, 9]]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=[-1])

    def decode():
        engine = DecodeEngine(model, settings=EngineSettings(decode_path="torch"))
        return engine.generate(prompts, config, eos_token_ids=[-1], seed=0, pad_token_id=0)[0]

    expected = decode()
    launches = []

    def launch(k, v, k_cache, v_cache, slots, lengths, k_scale=None, v_scale=None):
        launches.append(slots.stride())
        kernel._kv_append_op._init_fn(k, v, k_cache, v_cache, slots, lengths, k_scale, v_scale)

    monkeypatch.setattr(kv_cache, "_kv_append_kernel", lambda x: launch)
    assert decode() == expected
    assert launches  # the kernel ran, every layer of every step
