"""LLaDA on CUDA: the sampler in BF16 and FP8 is deterministic (greedy) or seeded (sampling) with every
option, and the fused SwiGLU + FP8 quant is bit-identical to the plain expression (and actually runs)."""

from __future__ import annotations

import pytest
import torch

from jetrl_trainer.diffusion import build_tiny_llada, generate
from jetrl_trainer.kernels import optional_module, triton_available
from jetrl_trainer.quant import PrecisionPhases, quantize_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

VOCAB, MASK, PAD = 1024, 1023, 0


def model_fp8():
    """BF16 master weights, FP8 rollout phase; 128-multiple sizes so every GEMM takes the FP8 kernels."""
    base = build_tiny_llada(vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=2, d_model=256,
                            n_heads=4, n_kv_heads=2, mlp_hidden_size=512, seed=3, dtype=torch.bfloat16)  # fmt: skip
    return quantize_model(base.cuda(), train="bf16", rollout="fp8").eval()


def prompts(B=6, P=9):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, MASK, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[::2, :3] = 0  # left padding on every other row
    return ids.masked_fill(mask == 0, PAD).cuda(), mask.cuda()


@pytest.mark.parametrize("phase", ["train", "rollout"])  # BF16, FP8
@pytest.mark.parametrize("kw", [dict(), dict(cfg_scale=1.0), dict(confidence_eos_eot_inf=True, eot_token_id=1),
                                dict(prefix_cache=True), dict(prefix_cache=True, cfg_scale=1.0), dict(threshold=0.002)])
def test_greedy_sampling_on_cuda_is_deterministic_and_complete(phase, kw):
    model, (ids, mask) = model_fp8(), prompts()
    common = dict(steps=16, gen_length=32, block_length=8, **kw)
    with PrecisionPhases(model).use(phase):
        first, again = [generate(model, ids, mask, **common) for _ in range(2)]
        # an all-ones mask is dropped once on the host: the run is the unmasked one
        unpadded = [generate(model, ids[1::2], m, **common) for m in (None, torch.ones_like(mask[1::2]))]
    assert torch.equal(first, again)
    assert torch.equal(unpadded[0], unpadded[1])
    assert not (first == MASK).any() and not (unpadded[0] == MASK).any()


def test_seeded_sampling_on_cuda_is_reproducible():
    model, (ids, mask) = model_fp8(), prompts()
    kw = dict(steps=8, gen_length=16, block_length=8, temperature=1.0)

    def sample(seed):
        return generate(model, ids, mask, generator=torch.Generator(device="cuda").manual_seed(seed), **kw)

    with PrecisionPhases(model).rollout():
        a, again, other = sample(0), sample(0), sample(1)
    assert not (a == MASK).any()
    assert torch.equal(a, again)  # the generator seeds every draw
    assert not torch.equal(a, other)


@pytest.mark.skipif(not triton_available() or optional_module("triton_swiglu") is None, reason="needs Triton")
def test_fused_swiglu_is_bit_identical_and_runs(monkeypatch):
    from jetrl_trainer.diffusion import _fused

    model, (ids, mask) = model_fp8(), prompts()
    calls = []
    real = _fused.fused_swiglu
    monkeypatch.setattr(_fused, "fused_swiglu", lambda *a: calls.append(1) or real(*a))
    canvas = torch.cat([ids, torch.full((ids.shape[0], 16), MASK, device="cuda")], 1)
    attn = torch.cat([mask, torch.ones_like(canvas[:, 9:])], 1)
    with torch.no_grad(), PrecisionPhases(model).rollout():
        fused = model(canvas, attention_mask=attn).logits
        served = [c for c in calls]
        for block in model.model.transformer.blocks:
            block.swiglu.fused = False
        plain = model(canvas, attention_mask=attn).logits
    assert len(served) == len(model.model.transformer.blocks)
    assert torch.equal(fused, plain)
    # and it feeds ff_out: the fused path returned a value (not None) in the FP8 phase
    assert real(torch.randn(4, 512, device="cuda", dtype=torch.bfloat16),
                torch.randn(4, 512, device="cuda", dtype=torch.bfloat16), model.model.transformer.blocks[0]) is None
    with PrecisionPhases(model).rollout():
        assert real(torch.randn(4, 512, device="cuda", dtype=torch.bfloat16),
                    torch.randn(4, 512, device="cuda", dtype=torch.bfloat16),
                    model.model.transformer.blocks[0]) is not None
