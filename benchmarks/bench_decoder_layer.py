"""One Qwen3-8B decoder layer, training step (forward + backward), BF16 vs FP8 linears.

Built from ``transformers.Qwen3Config`` with the 8B dimensions (no download): hidden 4096, 32 query
/ 8 KV heads of 128, MLP 12288; batch 4 × 2048 tokens, SDPA attention in BF16 (causal). Variants:
* ``bf16``: the layer as transformers builds it;
* ``fp8``: ``quantize_model(layer)`` as users get it — the seven linears become FP8
  ``QuantLinear``s and, on CUDA with Triton, the RMSNorms and the SwiGLU are fused with the FP8
  quantization of their output, which goes straight to the next GEMMs;
* ``fp8_unfused``: ``quantize_model(layer, fuse_norms=False)`` — FP8 linears only.
The FP8 weight is re-quantized every iteration (one optimizer step per iteration).
Target (issue 6): ≥ 1.3× BF16. Also reports the FP8 weight-cache memory against the BF16 weights.
"""

from __future__ import annotations

import argparse
import copy

import torch

from _common import TRAINING_KERNEL_KINDS, bench_graph_ms, bench_ms, dump, environment, kernels_by_kind
from jetrl_trainer.quant import QuantLinear, invalidate_weight_caches, quantize_model
from jetrl_trainer.quant.fused import FusedRMSNorm

BATCH, SEQ = 4, 2048


def _layer():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    config = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, num_hidden_layers=1, rms_norm_eps=1e-6, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    layer = Qwen3DecoderLayer(config, layer_idx=0).to("cuda", torch.bfloat16)
    rotary = Qwen3RotaryEmbedding(config).to("cuda")
    return config, layer, rotary


def _step(layer, hidden, pos_emb, grad):
    def fn():
        invalidate_weight_caches(layer)
        for p in layer.parameters():
            p.grad = None
        hidden.grad = None
        out = layer(hidden, position_embeddings=pos_emb)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    return fn


def _weight_memory(layer) -> dict:
    """Bytes of the FP8 weight cache of a freshly quantized layer (nothing cached yet) vs its BF16 weights."""
    bf16 = sum(m.weight.numel() * m.weight.element_size() for m in layer.modules() if isinstance(m, QuantLinear))
    invalidate_weight_caches(layer)
    for m in layer.modules():
        if isinstance(m, QuantLinear):
            m._weight_cache = {}  # drop what the timing runs cached, so the allocation below is new
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cached = [m.quantized_weight(m.recipes["train"]) for m in layer.modules() if isinstance(m, QuantLinear)]
    torch.cuda.synchronize()
    measured = torch.cuda.memory_allocated() - before
    exact = sum(t.numel() * t.element_size() for pair in cached for t in pair)
    return {"bf16_weight_bytes": bf16, "fp8_cache_bytes": exact, "fp8_cache_allocated_bytes": measured,
            "ratio_cache_over_bf16": round(exact / bf16, 4)}


def run() -> dict:
    torch.manual_seed(0)
    config, layer, rotary = _layer()
    hidden = torch.randn(BATCH, SEQ, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(SEQ, device="cuda")[None].expand(BATCH, -1)
    pos_emb = rotary(hidden, position_ids)
    grad = torch.randn_like(hidden)
    result = {"environment": environment(), "tokens": BATCH * SEQ, "target_speedup": 1.3}
    times = {"bf16": bench_ms(_step(layer, hidden, pos_emb, grad))}

    fp8 = quantize_model(copy.deepcopy(layer))
    unfused = quantize_model(copy.deepcopy(layer), fuse_norms=False)
    result["fp8_fused_norms"] = any(isinstance(m, FusedRMSNorm) for m in fp8.modules())
    times["fp8"] = bench_ms(_step(fp8, hidden, pos_emb, grad))
    times["fp8_unfused"] = bench_ms(_step(unfused, hidden, pos_emb, grad))
    result["memory"] = _weight_memory(fp8)
    graphed = {}
    for name, module in (("bf16", layer), ("fp8", fp8), ("fp8_unfused", unfused)):
        try:
            graphed[name] = round(bench_graph_ms(_step(module, hidden, pos_emb, grad), calls=2, replays=10), 3)
        except Exception as exc:  # capture can fail where an op syncs; report it
            graphed[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    result["cuda_graph_ms"] = graphed
    result["cuda_graph_speedup_vs_bf16"] = {
        k: round(graphed["bf16"] / v, 3) for k, v in graphed.items() if k != "bf16" and isinstance(v, float)
    }
    result["ms"] = {k: round(v, 3) for k, v in times.items()}
    result["speedup_vs_bf16"] = {k: round(times["bf16"] / v, 3) for k, v in times.items() if k != "bf16"}
    return result


def run_profile(steps: int = 5) -> dict:
    """GPU time per layer step by kernel kind, BF16 against FP8 as shipped (torch.profiler, eager)."""
    torch.manual_seed(0)
    config, layer, rotary = _layer()
    hidden = torch.randn(BATCH, SEQ, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos_emb = rotary(hidden, torch.arange(SEQ, device="cuda")[None].expand(BATCH, -1))
    grad = torch.randn_like(hidden)
    variants = {"bf16": layer, "fp8": quantize_model(copy.deepcopy(layer))}
    return {"environment": environment(), "tokens": BATCH * SEQ,
            "profile": {name: kernels_by_kind(_step(m, hidden, pos_emb, grad), steps, TRAINING_KERNEL_KINDS, top=40)
                        for name, m in variants.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="GPU time by kernel kind (torch.profiler) instead of timings")
    args = ap.parse_args()
    dump(run_profile() if args.profile else run())
