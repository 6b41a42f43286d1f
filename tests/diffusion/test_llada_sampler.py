"""LLaDA sampler: transfer schedule, block order, no leftover masks, determinism, padding invariance; on
CUDA, in BF16 and FP8, deterministic (greedy) or seeded (sampling) with every option."""

from __future__ import annotations

import math

import pytest
import torch
from _llada_cuda import CUDA_MASK, cuda_prompts, model_fp8

from jetrl_trainer.diffusion import build_tiny_llada, generate
from jetrl_trainer.diffusion.sampler import (
    add_gumbel_noise,
    denoise_step,
    get_num_transfer_tokens,
    mask_tokens,
    remask_low_confidence,
)
from jetrl_trainer.quant import PrecisionPhases

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


class RecordMasks(torch.nn.Module):
    """Wraps a model and records the attention mask of every forward."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.masks = model, model.config, []

    def forward(self, *args, attention_mask=None, **kwargs):
        self.masks.append(attention_mask)
        return self.inner(*args, attention_mask=attention_mask, **kwargs)


def test_padding_is_decided_once_and_an_all_ones_mask_is_dropped(model):
    ids, mask, _ = prompts()
    kw = dict(steps=4, gen_length=8, block_length=4)
    unpadded, padded = RecordMasks(model), RecordMasks(model)
    generate(unpadded, ids, torch.ones_like(mask), **kw)
    generate(padded, ids, mask, **kw)
    assert len(unpadded.masks) == 4 and all(m is None for m in unpadded.masks)
    assert len(padded.masks) == 4 and all(torch.equal(m[:, : ids.shape[1]], mask) and m[:, ids.shape[1]:].all()
                                          for m in padded.masks)  # fmt: skip


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


# -- parity with the published generate.py -------------------------------------------------------------


def published_generate(model, prompt, attention_mask, *, steps, gen_length, block_length, cfg_scale=0.0,
                       logits_eos_inf=False, confidence_eos_eot_inf=False, eos=None, eot=None):
    """LLaDA's published greedy sampler, re-stated from its algorithm (not its code) as a test oracle.

    Whole-sequence logits, x0 = argmax over the full vocabulary ([MASK] included), confidence =
    softmax of the (EOS/EoT-adjusted) logits at x0, -inf outside the current block and at committed
    positions, per-row top-k. Greedy only (the published noise stream is not reproduced).
    """
    B, P = prompt.shape
    x = torch.cat([prompt, torch.full((B, gen_length), MASK)], dim=1)
    mask = None if attention_mask is None else torch.cat([attention_mask, torch.ones(B, gen_length, dtype=attention_mask.dtype)], 1)
    is_prompt = x != MASK
    blocks, per_block = gen_length // block_length, steps // (gen_length // block_length)
    for b in range(blocks):
        hi = P + (b + 1) * block_length
        n_masked = int((x[0, P + b * block_length:hi] == MASK).sum())
        counts = [n_masked // per_block + (i < n_masked % per_block) for i in range(per_block)]
        for i in range(per_block):
            masked = x == MASK
            if cfg_scale > 0:
                un = x.masked_fill(is_prompt, MASK)
                both = model(torch.cat([x, un]), attention_mask=None if mask is None else torch.cat([mask, mask])).logits
                cond, uncond = both.chunk(2)
                logits = uncond + (cfg_scale + 1) * (cond - uncond)
            else:
                logits = model(x, attention_mask=mask).logits
            if logits_eos_inf:
                logits[..., eos] = -torch.inf
            x0 = logits.argmax(-1)
            if confidence_eos_eot_inf:  # at temperature 0 the published line reaches both ids
                logits[..., eos] = logits[..., eot] = -torch.inf
            conf = torch.softmax(logits, -1).gather(-1, x0[..., None]).squeeze(-1)
            conf[:, hi:] = -torch.inf
            conf = torch.where(masked, conf, -torch.inf)
            x0 = torch.where(masked, x0, x)
            for row in range(B):  # top-k; equal confidences (unspecified in topk) go by position
                pick = conf[row].sort(descending=True, stable=True).indices[:counts[i]]
                x[row, pick] = x0[row, pick]
    return x


class MaskRunnerUp(torch.nn.Module):
    """[MASK] gets a large probability at every position, but is never the argmax (a raw model's worst case)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        others = out.logits.clone()
        others[..., MASK] = -torch.inf
        top = others.max(-1).values  # (B, L)
        # a gap in (0.05, 4) that varies with the logits, so p([MASK]) differs from position to position
        gap = 0.05 + 3.95 * torch.frac(out.logits[..., 0].abs() * 1000.0)
        out.logits[..., MASK] = top - gap
        return out


PARITY_SETTINGS = [
    dict(steps=8, gen_length=8, block_length=8),
    dict(steps=6, gen_length=12, block_length=4),
    dict(steps=12, gen_length=12, block_length=4),
]  # CFG is checked on the raw model below: guidance can lift [MASK] to the argmax, our documented departure


@pytest.mark.parametrize("settings", PARITY_SETTINGS)
@pytest.mark.parametrize("padded", [False, True])
def test_greedy_matches_the_published_sampler_when_mask_is_likely(model, settings, padded):
    """The confidence includes p([MASK]): dividing it out (confidence after [MASK] = -inf) reorders commits."""
    ids, mask, _ = prompts(lengths=(5, 3, 7, 7) if padded else (6, 6, 6, 6), seed=3)
    wrapped = MaskRunnerUp(model)
    ours = generate(wrapped, ids, mask if padded else None, **settings)
    reference = published_generate(wrapped, ids, mask if padded else None, **settings)
    assert torch.equal(ours, reference)


def test_the_published_order_differs_from_renormalised_confidences(model):
    """Guards the parity test: with [MASK] likely, p/(1 - p_MASK) commits in another order."""
    ids, _, _ = prompts(lengths=(6,) * 8, seed=3)
    wrapped = MaskRunnerUp(model)
    with torch.no_grad():
        logits = wrapped(mask_tokens(ids, 8, MASK)).logits[:, 6:]
    published = torch.softmax(logits, -1).max(-1).values
    renormalised = torch.softmax(logits.masked_fill(torch.arange(VOCAB) == MASK, -torch.inf), -1).max(-1).values
    assert not torch.equal(published.argsort(-1), renormalised.argsort(-1))


@pytest.mark.parametrize("options", [dict(logits_eos_inf=True), dict(confidence_eos_eot_inf=True),
                                     dict(logits_eos_inf=True, confidence_eos_eot_inf=True)])
def test_eos_options_match_the_published_sampler(options):
    EOS, EOT = 3, 4
    # a model that likes EOS/EoT: they are proposed often, so both options change the result
    raw = build_tiny_llada(vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS, seed=5).eval()

    class LikesEos(MaskRunnerUp):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits[..., [EOS, EOT]] += 1.5
            return out

    wrapped = LikesEos(raw)
    ids, mask, _ = prompts(lengths=(5, 3, 7), seed=4)
    kw = dict(steps=6, gen_length=12, block_length=4)
    ours = generate(wrapped, ids, mask, eot_token_id=EOT, **kw, **options)
    reference = published_generate(wrapped, ids, mask, eos=EOS, eot=EOT, **kw, **options)
    assert torch.equal(ours, reference)
    assert not torch.equal(ours, generate(wrapped, ids, mask, **kw))  # the option did something
    if options.get("logits_eos_inf"):
        assert not (ours[:, ids.shape[1]:] == EOS).any()


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_raw_model_greedy_matches_the_published_sampler(cfg_scale):
    """No wrapper: a raw model with a vocabulary large enough that [MASK] is (here) never the argmax."""
    raw = build_tiny_llada(vocab_size=512, mask_token_id=511, pad_token_id=0, seed=7).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 511, (16, 6), generator=g)
    ref_mask = torch.ones_like(ids)
    ref_mask[::3, :2] = 0
    ids = ids.masked_fill(ref_mask == 0, 0)
    kw = dict(steps=8, gen_length=16, block_length=8, cfg_scale=cfg_scale)
    global MASK
    saved, MASK = MASK, 511  # the oracle reads the module-level id
    try:
        reference = published_generate(raw, ids, ref_mask, **kw)
    finally:
        MASK = saved
    assert not (reference == 511).any()  # precondition: the published sampler committed no [MASK]
    assert torch.equal(generate(raw, ids, ref_mask, **kw), reference)


def test_eos_option_ids_are_checked(model):
    ids, mask, _ = prompts()
    with pytest.raises(ValueError, match="eot_token_id=126348 is outside"):
        generate(model, ids, mask, steps=2, gen_length=4, block_length=4, eos_token_id=3, confidence_eos_eot_inf=True)
    with pytest.raises(ValueError, match="need an EOS id"):
        generate(model, ids, mask, steps=2, gen_length=4, block_length=4, logits_eos_inf=True)


# -- approximate, opt-in speed-ups (Fast-dLLM) ---------------------------------------------------------

from jetrl_trainer.diffusion.modeling_llada import LLaDAPrefixCache  # noqa: E402
from jetrl_trainer.diffusion.sampler import remask_below_threshold  # noqa: E402


def test_remask_below_threshold_commits_the_confident_and_at_least_one():
    x_block = torch.tensor([[MASK, MASK, MASK, 7], [MASK, MASK, 3, MASK], [1, 2, 3, 4]])
    x0 = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    confidence = torch.tensor([[0.95, 0.5, 0.91, 0.99], [0.2, 0.3, 0.99, 0.1], [0.99, 0.99, 0.99, 0.99]])
    transferred = remask_below_threshold(x_block, x0, confidence, 0.9, MASK)
    assert transferred.tolist() == [[True, False, True, False], [False, True, False, False], [False] * 4]
    assert x_block.tolist() == [[10, MASK, 12, 7], [MASK, 21, 3, MASK], [1, 2, 3, 4]]


@pytest.mark.parametrize("threshold, per_block", [(1e-9, 1), (1.0, 4)])
def test_threshold_decoding_fills_blocks_in_order_in_fewer_or_more_steps(model, threshold, per_block):
    ids, mask, _ = prompts()
    out, trail = trace(model, ids, mask, steps=4, gen_length=8, block_length=4, threshold=threshold)
    assert [b for b, *_ in trail] == [0] * per_block + [1] * per_block  # a low threshold fills a block at once
    P = ids.shape[1]
    for b, _, x, transferred in trail:
        assert not transferred[:, : P + 4 * b].any() and not transferred[:, P + 4 * (b + 1):].any()
    assert not (out == MASK).any()


def test_threshold_keeps_confident_commits_of_the_fixed_schedule(model):
    """A threshold above every confidence commits one token per step: the 1-token schedule exactly."""
    ids, mask, _ = prompts()
    kw = dict(gen_length=8, block_length=4)
    assert torch.equal(generate(model, ids, mask, steps=8, threshold=1.0, **kw), generate(model, ids, mask, steps=8, **kw))


def test_bad_threshold_is_refused(model):
    ids, mask, _ = prompts()
    with pytest.raises(ValueError, match=r"threshold must be a confidence in \(0, 1\]"):
        generate(model, ids, mask, steps=4, gen_length=8, block_length=4, threshold=1.5)
    with pytest.raises(ValueError, match="remasking='low_confidence'"):
        generate(model, ids, mask, steps=4, gen_length=8, block_length=4, threshold=0.9, remasking="random")


def test_prefix_cache_reproduces_the_full_forward_while_the_rest_is_unchanged(model):
    ids, mask, _ = prompts()
    x = mask_tokens(ids, 8, MASK)
    attn = torch.cat([mask, torch.ones(3, 8, dtype=torch.long)], 1)
    P = ids.shape[1]
    cache = LLaDAPrefixCache(P + 4)
    with torch.no_grad():
        full = model(x, attention_mask=attn).logits
        filled = model(x, attention_mask=attn, prefix_cache=cache).logits  # fills
        cached = model(x, attention_mask=attn, prefix_cache=cache, logits_to_keep=slice(P + 4, P + 8)).logits
        torch.testing.assert_close(filled, full)
        torch.testing.assert_close(cached, full[:, P + 4:], rtol=1e-5, atol=1e-5)
        assert len(cache.keys) == 2 and cache.keys[0].shape[2] == P + 4
        x2 = x.clone()
        x2[:, P + 4:] = 5  # the suffix changed: the cached prefix is now stale -- the approximation
        stale = model(x2, attention_mask=attn, prefix_cache=cache, logits_to_keep=slice(P + 4, P + 8)).logits
        fresh = model(x2, attention_mask=attn).logits[:, P + 4:]
    assert not torch.allclose(stale, fresh, atol=1e-5)
    with pytest.raises(ValueError, match="must lie after it"):
        model(x, attention_mask=attn, prefix_cache=cache, logits_to_keep=slice(0, 4))


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
def test_prefix_cache_generation_keeps_the_schedule_and_starts_each_block_exactly(model, cfg_scale):
    ids, mask, _ = prompts()
    kw = dict(steps=6, gen_length=12, block_length=4, cfg_scale=cfg_scale)
    out, trail = trace(model, ids, mask, prefix_cache=True, **kw)
    exact, exact_trail = trace(model, ids, mask, **kw)
    assert [t.sum(1).tolist() for *_, t in trail] == [t.sum(1).tolist() for *_, t in exact_trail]
    assert torch.equal(trail[0][3], exact_trail[0][3])  # the first step of the first block is a full forward
    assert not (out == MASK).any()


# -- on CUDA, in BF16 and FP8 --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["train", "rollout"])  # BF16, FP8
@pytest.mark.parametrize("kw", [dict(), dict(cfg_scale=1.0), dict(confidence_eos_eot_inf=True, eot_token_id=1),
                                dict(prefix_cache=True), dict(prefix_cache=True, cfg_scale=1.0), dict(threshold=0.002)])
def test_greedy_sampling_on_cuda_is_deterministic_and_complete(phase, kw):
    model, (ids, mask) = model_fp8(), cuda_prompts()
    common = dict(steps=16, gen_length=32, block_length=8, **kw)
    with PrecisionPhases(model).use(phase):
        first, again = [generate(model, ids, mask, **common) for _ in range(2)]
        # an all-ones mask is dropped once on the host: the run is the unmasked one
        unpadded = [generate(model, ids[1::2], m, **common) for m in (None, torch.ones_like(mask[1::2]))]
    assert torch.equal(first, again)
    assert torch.equal(unpadded[0], unpadded[1])
    assert not (first == CUDA_MASK).any() and not (unpadded[0] == CUDA_MASK).any()


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_is_reproducible():
    model, (ids, mask) = model_fp8(), cuda_prompts()
    kw = dict(steps=8, gen_length=16, block_length=8, temperature=1.0)

    def sample(seed):
        return generate(model, ids, mask, generator=torch.Generator(device="cuda").manual_seed(seed), **kw)

    with PrecisionPhases(model).rollout():
        a, again, other = sample(0), sample(0), sample(1)
    assert not (a == CUDA_MASK).any()
    assert torch.equal(a, again)  # the generator seeds every draw
    assert not torch.equal(a, other)
