"""RoPE + KV append in one launch (kernels/triton_rope_append.py): the same bits as transformers'
eager ``apply_rotary_pos_emb`` and the engine's indexed cache append, for each supported family's
rotary module (llama3 scaling included), on CUDA; refused on CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

from jetrl_trainer.kernels.triton_rope_append import rope_append

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_refuses_cpu_tensors():
    q, k = torch.randn(2, 4, 32), torch.randn(2, 2, 32)
    cache = torch.zeros(3, 2, 8, 32)
    with pytest.raises(ValueError, match="CUDA kernel"):
        rope_append(q, k, k, torch.ones(2, 32), torch.zeros(2, 32), cache, cache, torch.arange(2), torch.zeros(2, dtype=torch.long))


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
