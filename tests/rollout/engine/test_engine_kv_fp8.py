"""The engine's optional FP8 KV cache (``rollout_kv_cache_dtype="fp8"``): the cache's numerics, an engine
that really attends over FP8 keys/values, the config's refusals, and a training step that logs the
mismatch it adds. On CUDA: the RoPE/append and attention kernels on FP8 caches, bit for bit where
the format is defined, and the graphed engine against the eager one."""

from __future__ import annotations

import pytest
import torch
from _trainer_utils import make_args, make_trainer, tokenizer, train
from transformers import GenerationConfig

from jetrl_trainer.kernels.triton_decode_attention import decode_attention_reference
from jetrl_trainer.quant import PrecisionPhases, quantize_model
from jetrl_trainer.quant.fp8 import dequantize_fp8_groups, quantize_fp8_groups
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings
from jetrl_trainer.rollout.engine.kv_cache import KVCache
from jetrl_trainer.tiny import build_tiny_qwen3

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [5, 6, 7, 8, 9]]


def _cache(fp8, device="cpu", dtype=torch.float32):
    return KVCache(num_layers=2, num_slots=4, max_len=12, num_kv_heads=2, head_dim=16, dtype=dtype, device=device,
                   fp8=fp8)  # fmt: skip


def test_fp8_cache_stores_the_reference_quantization_and_reads_it_back():
    g = torch.Generator().manual_seed(0)
    cache = _cache(True)
    prompt_k, prompt_v = torch.randn(2, 5, 16, generator=g) * 3, torch.randn(2, 5, 16, generator=g)
    stacked = [cache.encode(x.expand(2, 1, *x.shape)) for x in (prompt_k, prompt_v)]  # (layers, N, H_kv, P, D)
    cache.store_encoded(torch.tensor([2]), *stacked, row=0, length=5)
    cache.lengths[0] = 0
    new_k, new_v = torch.randn(2, 2, 16, generator=g), torch.randn(2, 2, 16, generator=g)
    cache.append(1, torch.tensor([0, 2]), new_k, new_v)
    k, v = cache.read(1, torch.tensor([2, 0]))
    assert cache.k.dtype == torch.float8_e4m3fn and k.dtype == torch.float32
    for got, x in ((k[0, :, :5], prompt_k), (v[0, :, :5], prompt_v), (k[0, :, 5], new_k[1]), (k[1, :, 0], new_k[0])):
        q, s = quantize_fp8_groups(x, 16)
        assert torch.equal(got, dequantize_fp8_groups(q, s, 16))
    assert not torch.equal(k[0, :, :5], prompt_k)  # really quantized


def test_engine_attends_over_fp8_keys_and_values():
    torch.manual_seed(0)
    model = build_tiny_qwen3(tokenizer()).eval()
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=[-1])
    runs = {}
    for dtype in ("auto", "fp8"):
        runs[dtype] = DecodeEngine(model, kv_cache_dtype=dtype).generate(PROMPTS, config, eos_token_ids=[-1], seed=0)
    (tokens, exact), (tokens8, lp8) = runs["auto"], runs["fp8"]
    diffs = []
    for row, (a, b) in enumerate(zip(tokens, tokens8)):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        diffs += [abs(x - y) for x, y in zip(exact[row][:same], lp8[row][:same])]
    assert tokens8[0][0] == tokens[0][0] and len(diffs) >= 4
    assert 0 < max(diffs[1:] or diffs) and max(diffs) < 0.2, diffs  # the first token comes from the prefill


def test_the_config_refuses_fp8_kv_where_it_breaks_the_unified_flow_or_goes_unmanaged(tmp_path):
    unified = dict(rollout_backend="engine", rollout_kv_cache_dtype="fp8", train_precision="fp8", rollout_precision="fp8")
    with pytest.raises(ValueError, match="needs the exact contract"):
        make_args(tmp_path, exact_logprobs=False, **unified)
    with pytest.raises(ValueError, match="runs under the exact contract.*leave top_k"):
        make_args(tmp_path, top_k=5, **unified)
    assert make_args(tmp_path, **unified).rollout_kv_cache_dtype == "fp8"  # exact_logprobs=None turns it on
    with pytest.raises(ValueError, match="set a corrector"):
        make_args(tmp_path, rollout_backend="engine", rollout_kv_cache_dtype="fp8", train_precision="bf16",
                  rollout_precision="fp8", corrector="none")  # fmt: skip
    with pytest.raises(ValueError, match="set rollout_backend='engine'"):
        make_args(tmp_path, rollout_kv_cache_dtype="fp8", train_precision="bf16", rollout_precision="fp8",
                  corrector="tis")  # fmt: skip
    with pytest.raises(ValueError, match="rollout_kv_cache_dtype"):
        make_args(tmp_path, rollout_backend="engine", rollout_kv_cache_dtype="int8")
    args = make_args(tmp_path, rollout_backend="engine", rollout_kv_cache_dtype="FP8", train_precision="bf16",
                     rollout_precision="fp8", corrector="tis")  # fmt: skip
    assert args.rollout_kv_cache_dtype == "fp8"


def test_a_training_step_with_an_fp8_kv_cache_logs_its_mismatch(tmp_path):
    trainer = make_trainer(tmp_path, train_precision="bf16", rollout_precision="fp8", corrector="tis",
                           rollout_backend="engine", rollout_kv_cache_dtype="fp8")  # fmt: skip
    assert trainer.rollout_backend.kv_cache_dtype == "fp8"
    logs, _ = train(trainer)
    assert logs["mismatch/nonfinite_tokens"] == 0 and logs["jetrl/skipped_steps"] == 0
    assert logs["mismatch/logp_abs_diff_mean"] > 1e-3 and logs["corrector/weight_mean"] > 0


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _need_triton():
    from jetrl_trainer import kernels

    if not kernels.triton_available():
        pytest.skip("needs Triton")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_append_quantizes_as_the_reference_and_attention_reads_it(dtype):
    _need_triton()
    from transformers.models.qwen3 import modeling_qwen3

    from jetrl_trainer.kernels.triton_decode_attention import decode_attention
    from jetrl_trainer.kernels.triton_rope_append import rope_append

    B, H, H_kv, D, S, T = 5, 8, 2, 128, 6, 200
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(B, 1, H, D, generator=g) * 3).to("cuda", dtype)
    k = (torch.randn(B, 1, H_kv, D, generator=g) * 3).to("cuda", dtype)
    v = torch.randn(B, 1, H_kv, D, generator=g).to("cuda", dtype)
    angles = torch.rand(B, 1, D, generator=g).cuda() * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(S, generator=g)[:B].cuda()
    positions = torch.randint(0, T, (B,), generator=g).cuda()
    cache = KVCache(num_layers=1, num_slots=S, max_len=T, num_kv_heads=H_kv, head_dim=D, dtype=dtype,
                    device=torch.device("cuda"), fp8=True)  # fmt: skip
    full = torch.randn(S, H_kv, T, D, generator=g).to("cuda", dtype)
    for s in range(S):  # live history in every slot, quantized by the host path
        cache.store_encoded(torch.tensor([s], device="cuda"), *[cache.encode(full[s][None, None])] * 2, row=0, length=T)
    scales = dict(k_scale=cache.k_scale[0], v_scale=cache.v_scale[0])
    q_rot = rope_append(q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], cache.k[0], cache.v[0], slots, positions,
                        **scales)  # fmt: skip
    q_eager, k_eager = modeling_qwen3.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert torch.equal(q_rot, q_eager[:, :, 0])
    for got, got_s, x in ((cache.k, cache.k_scale, k_eager[:, :, 0]), (cache.v, cache.v_scale, v[:, 0])):
        q_ref, s_ref = quantize_fp8_groups(x, D)
        assert torch.equal(got[0, slots, :, positions].view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(got_s[0, slots, :, positions], s_ref[..., 0])
    lengths = positions + 1
    out = decode_attention(q_rot, cache.k[0], cache.v[0], slots, lengths, D**-0.5, **scales)
    ref = decode_attention_reference(q_rot, cache.k[0], cache.v[0], slots, lengths, D**-0.5, **scales)
    assert torch.allclose(out.float(), ref.float(), atol=3e-2 if dtype == torch.bfloat16 else 4e-3, rtol=0)


@pytest.mark.gpu
@CUDA
def test_graphed_engine_with_an_fp8_cache_matches_the_eager_one():
    _need_triton()
    model = build_tiny_qwen3(tokenizer()).cuda().eval()
    quantize_model(model, train="bf16", rollout="fp8")
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=[-1])
    with PrecisionPhases(model).rollout():
        runs = [DecodeEngine(model, settings=EngineSettings(decode_path=path), kv_cache_dtype="fp8").generate(
                    PROMPTS, config, eos_token_ids=[-1], seed=0)
                for path in ("graphs", "torch")]  # fmt: skip
    (graphed, graphed_lp), (eager, eager_lp) = runs
    assert graphed == eager
    for a, b in zip(graphed_lp, eager_lp):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-2, rtol=0)
