"""The rollout benchmark's bandwidth floor counts the bytes a decode step reads (CPU).

``benchmarks/bench_rollout.py`` reports each run as a fraction of the floor: (parameter bytes read per
step + live KV) over the copy bandwidth. A decode step reads every linear, the LM head and the norms,
and one row of the embedding table per sequence, not the table."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from jetrl_trainer.quant import QuantLinear, quantize_model
from jetrl_trainer.tiny import build_tiny_qwen3

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
bench_rollout = pytest.importorskip("bench_rollout")


@pytest.mark.parametrize("fp8", [False, True])
def test_weight_bytes_count_linears_lm_head_and_norms_not_the_embedding_table(fp8):
    model = build_tiny_qwen3(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, tie_word_embeddings=False, dtype=torch.bfloat16)  # fmt: skip
    quantize_model(model, train="bf16", rollout="fp8")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and model.lm_head not in linears  # the recipe keeps the LM head in BF16
    projection = sum(m.weight.numel() * (1 if fp8 else 2) + (m.weight.numel() // 128**2 * 4 if fp8 else 0) for m in linears)
    norms = sum(p.numel() * 2 for name, p in model.named_parameters() if "norm" in name)
    lm_head = model.lm_head.weight.numel() * 2
    assert norms > 0
    assert bench_rollout.weight_bytes(model, fp8) == projection + lm_head + norms
