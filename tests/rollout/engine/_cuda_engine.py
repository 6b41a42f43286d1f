"""Prompts and a tiny model for the engine's CUDA tests (test_engine*.py)."""

from __future__ import annotations

import pytest
from _trainer_utils import tokenizer

from jetrl_trainer.quant import quantize_model
from jetrl_trainer.tiny import build_tiny_qwen3

CUDA_PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [5, 6, 7, 8, 9]]


def cuda_model(precision):
    """A tiny Qwen3 on CUDA, BF16 in training, ``precision`` in rollouts."""
    model = build_tiny_qwen3(tokenizer()).cuda().eval()
    quantize_model(model, train="bf16", rollout=precision)
    return model


def graphs_or_skip():
    from jetrl_trainer.kernels import triton_available

    if not triton_available():
        pytest.skip("needs Triton (the graphed decode step runs the Triton attention kernel)")
