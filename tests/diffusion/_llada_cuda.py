"""A tiny LLaDA in FP8 on CUDA, and left-padded prompts for it: the LLaDA tests' CUDA set-up."""

from __future__ import annotations

import torch

from jetrl_trainer.diffusion import build_tiny_llada
from jetrl_trainer.quant import quantize_model

CUDA_VOCAB, CUDA_MASK, CUDA_PAD = 1024, 1023, 0


def model_fp8():
    """BF16 master weights, FP8 rollout phase; 128-multiple sizes so every GEMM takes the FP8 kernels."""
    base = build_tiny_llada(vocab_size=CUDA_VOCAB, mask_token_id=CUDA_MASK, pad_token_id=CUDA_PAD, eos_token_id=2,
                            d_model=256, n_heads=4, n_kv_heads=2, mlp_hidden_size=512, seed=3,
                            dtype=torch.bfloat16)  # fmt: skip
    return quantize_model(base.cuda(), train="bf16", rollout="fp8").eval()


def cuda_prompts(B=6, P=9):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, CUDA_MASK, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[::2, :3] = 0  # left padding on every other row
    return ids.masked_fill(mask == 0, CUDA_PAD).cuda(), mask.cuda()
