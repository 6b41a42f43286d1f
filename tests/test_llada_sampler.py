"""LLaDA sampler: transfer schedule, block order, no leftover masks, determinism, padding invariance."""

from __future__ import annotations

import math

import pytest
import torch

from jetrl_trainer.diffusion import build_tiny_llada, generate
from jetrl_trainer.diffusion.sampler import (
    add_gumbel_noise,
    denoise_step,
    get_num_transfer_tokens,
    mask_tokens,
    remask_low_confidence,
)

VOCAB, MASK, PAD = 40, 39, 0


@pytest.fixture(scope="module")
def model():
    return build_tiny_llada(vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=PAD, n_kv_heads=2, seed=1).eval()


def prompts(lengths=(5, 3, 7), seed=0):
    """Left-padded prompts of the given lengths, plus each prompt on its own."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, MASK, (n,), generator=g) for n in lengths]
    P = max(lengths)
    ids = torch.full((len(rows), P), PAD)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = r
        mask[i, P - len(r):] = 1
    return ids, mask, rows


class PreferMask(torch.nn.Module):
    """Wraps a model so that [MASK] is by far its most likely prediction everywhere."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        out.logits[..., MASK] += 100.0
        return out


def trace(model, ids, mask, **kw):
    steps = []
    out = generate(model, ids, mask, on_step=lambda s: steps.append((s.block, s.step, s.x.clone(), s.transferred)), **kw)
    return out, steps


# -- pieces -----------------------------------------------------------------------------------------


def test_num_transfer_tokens_splits_evenly_remainder_first():
    block_mask = torch.tensor([[True] * 5 + [False] * 3, [True] * 3 + [False] * 5, [True] * 8])
    assert get_num_transfer_tokens(block_mask, 3).tolist() == [[2, 2, 1], [1, 1, 1], [3, 3, 2]]
    assert get_num_transfer_tokens(block_mask[:1], 7).tolist() == [[1, 1, 1, 1, 1, 0, 0]]


def test_remask_low_confidence_commits_the_most_confident_masked_positions():
    x_block = torch.tensor([[MASK, MASK, MASK, MASK, 7], [MASK, 3, MASK, MASK, MASK]])
    x0 = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    confidence = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.99], [0.2, 0.99, 0.8, 0.1, 0.3]])
    transferred = remask_low_confidence(x_block, x0, confidence, torch.tensor([2, 1]), MASK)
    # position 4 of row 0 and 1 of row 1 are already unmasked: their high confidence must not count
    assert transferred.tolist() == [[False, True, False, True, False], [False, False, True, False, False]]
    assert x_block.tolist() == [[MASK, 11, MASK, 13, 7], [MASK, 3, 22, MASK, MASK]]


def test_gumbel_noise_is_float64_identity_at_zero_and_samples_softmax():
    logits = torch.tensor([[0.0, math.log(3.0)]]).expand(40000, 2)
    assert add_gumbel_noise(logits, 0.0) is logits
    noisy = add_gumbel_noise(logits, 1.0, torch.Generator().manual_seed(0))
    assert noisy.dtype == torch.float64
    frac = (noisy.argmax(-1) == 1).double().mean().item()
    assert abs(frac - 0.75) < 0.01  # softmax([0, log 3]) = [1/4, 3/4]
    hot = add_gumbel_noise(logits, 2.0, torch.Generator().manual_seed(0))  # softmax(l/2) = [.366, .634]
    assert abs((hot.argmax(-1) == 1).double().mean().item() - math.sqrt(3) / (1 + math.sqrt(3))) < 0.01


def test_mask_tokens_appends_masks():
    ids = torch.tensor([[1, 2], [3, 4]])
    assert mask_tokens(ids, 3, MASK).tolist() == [[1, 2, MASK, MASK, MASK], [3, 4, MASK, MASK, MASK]]


def test_denoise_step_only_touches_the_block_and_never_proposes_mask(model):
    x = mask_tokens(torch.randint(1, MASK, (2, 4)), 8, MASK)
    with torch.no_grad():
        x0, conf = denoise_step(PreferMask(model), x, None, slice(4, 8), prompt_length=4, mask_token_id=MASK)
    assert x0.shape == conf.shape == (2, 4)
    assert not (x0 == MASK).any()


# -- generate -----------------------------------------------------------------------------------------


def test_exact_tokens_per_step_and_blocks_in_order(model):
    ids, mask, _ = prompts()
    P, gen, block, steps = ids.shape[1], 12, 4, 9  # 3 blocks x 3 steps; 4 = 2 + 1 + 1
    out, trail = trace(model, ids, mask, steps=steps, gen_length=gen, block_length=block)
    assert [(b, s) for b, s, _, _ in trail] == [(b, s) for b in range(3) for s in range(3)]
    previous = mask_tokens(ids, gen, MASK)
    for b, s, x, transferred in trail:
        assert transferred.sum(dim=1).tolist() == [[2, 1, 1][s]] * 3
        lo, hi = P + b * block, P + (b + 1) * block
        assert not transferred[:, :lo].any() and not transferred[:, hi:].any()
        assert (previous[transferred] == MASK).all() and (x[transferred] != MASK).all()
        assert torch.equal(x[~transferred], previous[~transferred])  # nothing else changes
        assert (x[:, hi:] == MASK).all()  # later blocks untouched
        if s == 2:
            assert (x[:, lo:hi] != MASK).all()  # block done before the next starts
        previous = x
    assert torch.equal(out, previous)
    assert torch.equal(out[:, :P], ids)


def test_no_mask_left_even_when_the_model_prefers_mask(model):
    ids, mask, _ = prompts()
    out = generate(PreferMask(model), ids, mask, steps=4, gen_length=8, block_length=4, temperature=1.0,
                   generator=torch.Generator().manual_seed(0))
    assert not (out[:, ids.shape[1]:] == MASK).any()


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_random_remasking_and_temperature_keep_the_schedule(model, remasking):
    ids, mask, _ = prompts()
    out, trail = trace(model, ids, mask, steps=6, gen_length=10, block_length=5, temperature=0.7,
                       remasking=remasking, generator=torch.Generator().manual_seed(0))
    assert [t.sum(dim=1).tolist() for *_, t in trail] == [[2] * 3, [2] * 3, [1] * 3] * 2
    assert not (out == MASK).any()


def test_temperature_zero_is_deterministic_and_seeded_sampling_reproducible(model):
    ids, mask, _ = prompts()
    kw = dict(steps=4, gen_length=8, block_length=4)
    assert torch.equal(generate(model, ids, mask, **kw), generate(model, ids, mask, **kw))
    sample = lambda seed: generate(model, ids, mask, temperature=1.0, generator=torch.Generator().manual_seed(seed), **kw)  # noqa: E731
    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))


def test_padding_does_not_change_a_rows_result(model):
    ids, mask, rows = prompts(lengths=(6, 2, 4))
    kw = dict(steps=6, gen_length=9, block_length=3)
    batched = generate(model, ids, mask, **kw)
    for i, r in enumerate(rows):
        alone = generate(model, r[None], torch.ones(1, len(r), dtype=torch.long), **kw)
        assert torch.equal(batched[i, -9:], alone[0, -9:])
    # extra left padding for the whole batch leaves every row unchanged, even when sampling
    more_ids = torch.cat([torch.full((3, 5), PAD), ids], dim=1)
    more_mask = torch.cat([torch.zeros(3, 5, dtype=torch.long), mask], dim=1)
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    sampled = generate(model, ids, mask, temperature=1.0, generator=g(), **kw)
    sampled_padded = generate(model, more_ids, more_mask, temperature=1.0, generator=g(), **kw)
    assert torch.equal(sampled[:, -9:], sampled_padded[:, -9:])


def test_without_attention_mask_padding_would_leak(model):
    """Guards the padding test: the mask is what makes rows independent of their padding."""
    ids, mask, rows = prompts(lengths=(6, 2, 4))
    kw = dict(steps=6, gen_length=9, block_length=3)
    alone = generate(model, rows[1][None], None, **kw)
    assert not torch.equal(generate(model, ids, None, **kw)[1, -9:], alone[0, -9:])


def test_cfg_runs_with_padding_and_changes_the_result(model):
    ids, mask, rows = prompts(lengths=(6, 2, 4))
    kw = dict(steps=4, gen_length=8, block_length=4)
    guided = generate(model, ids, mask, cfg_scale=2.0, **kw)
    alone = generate(model, rows[0][None], torch.ones(1, 6, dtype=torch.long), cfg_scale=2.0, **kw)
    assert torch.equal(guided[0], alone[0])
    assert not (guided == MASK).any()
    assert not torch.equal(guided, generate(model, ids, mask, **kw))


def test_mask_token_id_defaults_to_config_and_progress_bar_runs(model, capsys):
    ids, mask, _ = prompts()
    a = generate(model, ids, mask, steps=2, gen_length=4, block_length=4, progress=True)
    b = generate(model, ids, mask, steps=2, gen_length=4, block_length=4, mask_token_id=MASK)
    assert torch.equal(a, b)
    assert "LLaDA denoising" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(steps=4, gen_length=10, block_length=4), "multiple of block_length"),
        (dict(steps=5, gen_length=8, block_length=4), "multiple of the number of blocks"),
        (dict(steps=0, gen_length=8, block_length=4), "steps must be a positive int"),
        (dict(steps=4, gen_length=8, block_length=4, remasking="topk"), "remasking"),
        (dict(steps=4, gen_length=8, block_length=4, temperature=-1.0), "temperature"),
        (dict(steps=4, gen_length=8, block_length=4, cfg_scale=-1.0), "cfg_scale"),
    ],
)
def test_bad_arguments_raise_clear_errors(model, kw, match):
    ids, mask, _ = prompts()
    with pytest.raises(ValueError, match=match):
        generate(model, ids, mask, **kw)


def test_int32_prompts_keep_their_dtype(model):
    ids, mask, _ = prompts()
    out = generate(model, ids.int(), mask, steps=2, gen_length=4, block_length=4)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), generate(model, ids, mask, steps=2, gen_length=4, block_length=4))


def test_bad_shapes_raise(model):
    ids, mask, _ = prompts()
    with pytest.raises(ValueError, match="attention_mask shape"):
        generate(model, ids, mask[:, 1:], steps=2, gen_length=4, block_length=4)
    with pytest.raises(ValueError, match="integer tensor"):
        generate(model, ids.float(), mask, steps=2, gen_length=4, block_length=4)
