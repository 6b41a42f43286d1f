"""LLaDA likelihood: one-step mean-field estimator, mask seeds, mask rates, batch invariance, registry."""

from __future__ import annotations

import pytest
import torch

from jetrl_trainer.diffusion import (
    LikelihoodEstimator,
    available_estimators,
    build_tiny_llada,
    get_estimator,
    mask_seeds_for_step,
    mean_field_logps,
    register_estimator,
)
from jetrl_trainer.diffusion import likelihood
from jetrl_trainer.diffusion.likelihood import _mix32, mask_prompt_tokens, token_logps

VOCAB, MASK, PAD = 40, 39, 0


@pytest.fixture(scope="module")
def model():
    return build_tiny_llada(vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=PAD, seed=2).eval()


class Recorder(torch.nn.Module):
    """Wraps a model and keeps the inputs of its last call."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.calls = model, model.config, []

    def forward(self, input_ids, **kwargs):
        self.calls.append((input_ids.clone(), kwargs))
        return self.inner(input_ids, **kwargs)


def batch(B=6, P=10, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, MASK, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    for i in range(B):
        prompt_mask[i, : i % 4] = 0  # left padding of 0..3
    prompt = prompt.masked_fill(prompt_mask == 0, PAD)
    completion = torch.randint(1, MASK, (B, T), generator=g)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[0, 5:] = 0
    return prompt, prompt_mask, completion, completion_mask


def masks_of(prompt, prompt_mask, completion, completion_mask, seed, p=0.5):
    return mask_prompt_tokens(prompt, prompt_mask, completion, completion_mask, mask_seed=seed, p_mask_prompt=p)


# -- seeds ----------------------------------------------------------------------------------------------


def test_mask_seeds_are_reproducible_and_distinct_per_iteration_and_step():
    seeds = mask_seeds_for_step(42, generation_step=3, num_iterations=4)
    assert seeds == mask_seeds_for_step(42, generation_step=3, num_iterations=4)
    assert len(set(seeds)) == 4
    assert not set(seeds) & set(mask_seeds_for_step(42, generation_step=4, num_iterations=4))
    assert not set(seeds) & set(mask_seeds_for_step(43, generation_step=3, num_iterations=4))
    assert mask_seeds_for_step(42, 3, 2) == seeds[:2]  # iteration i's seed does not depend on the count
    with pytest.raises(ValueError, match="num_iterations"):
        mask_seeds_for_step(0, 0, 0)


def test_mix32_is_exact_32bit_arithmetic():
    x = torch.tensor([0, 1, 0xFFFFFFFF, 123456789], dtype=torch.int64)

    def lowbias32(v):  # the same hash in plain Python integers
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)

    assert _mix32(x).tolist() == [lowbias32(int(v)) for v in x]


# -- masking ----------------------------------------------------------------------------------------


def test_completion_fully_masked_prompt_partly_padding_never(model):
    prompt, prompt_mask, completion, completion_mask = batch()
    rec = Recorder(model)
    mean_field_logps(rec, prompt, prompt_mask, completion, completion_mask, mask_seed=5, p_mask_prompt=0.5)
    (input_ids, kwargs), = rec.calls
    P = prompt.shape[1]
    assert (input_ids[:, P:] == MASK).all()
    padding = prompt_mask == 0
    assert torch.equal(input_ids[:, :P][padding], prompt[padding])
    masked = input_ids[:, :P] == MASK
    assert masked.any() and (~masked & prompt_mask.bool()).any()
    assert torch.equal(input_ids[:, :P][~masked], prompt[~masked])  # unmasked tokens are untouched
    assert torch.equal(kwargs["attention_mask"], torch.cat([prompt_mask, torch.ones_like(completion_mask)], 1))
    assert kwargs["logits_to_keep"] == completion.shape[1]


@pytest.mark.parametrize("p", [0.0, 0.15, 0.3, 0.7, 1.0])
def test_empirical_prompt_mask_rate(p):
    prompt, prompt_mask, completion, completion_mask = batch(B=64, P=64, seed=1)
    masked = masks_of(prompt, prompt_mask, completion, completion_mask, seed=11, p=p)
    real = prompt_mask.bool()
    rate = masked[real].float().mean().item()
    assert not masked[~real].any()
    assert abs(rate - p) < 0.02  # ~4000 real tokens: binomial sigma <= 0.008
    if p in (0.0, 1.0):
        assert rate == p


def test_same_seed_same_mask_across_calls_order_chunking_and_padding():
    prompt, prompt_mask, completion, completion_mask = batch()
    m = masks_of(prompt, prompt_mask, completion, completion_mask, seed=3)
    assert torch.equal(m, masks_of(prompt, prompt_mask, completion, completion_mask, seed=3))
    # shuffled rows (TRL shuffles the rollout batch before training passes)
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    shuffled = masks_of(prompt[perm], prompt_mask[perm], completion[perm], completion_mask[perm], seed=3)
    assert torch.equal(shuffled, m[perm])
    # a micro-batch on its own
    assert torch.equal(masks_of(prompt[2:4], prompt_mask[2:4], completion[2:4], completion_mask[2:4], seed=3), m[2:4])
    # more left padding
    pad = torch.zeros(6, 3, dtype=torch.long)
    padded = masks_of(torch.cat([pad, prompt], 1), torch.cat([pad, prompt_mask], 1), completion, completion_mask, seed=3)
    assert torch.equal(padded[:, 3:], m) and not padded[:, :3].any()


def test_different_seeds_and_rows_get_different_masks():
    prompt, prompt_mask, completion, completion_mask = batch(B=8, P=32)
    seeds = mask_seeds_for_step(0, 0, 3)
    masks = [masks_of(prompt, prompt_mask, completion, completion_mask, seed=s) for s in seeds]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    # identical prompts with different completions (a GRPO group) still get different masks, as in d1
    same_prompt = prompt[:1].expand(8, -1)
    group = masks_of(same_prompt, prompt_mask[:1].expand(8, -1), completion, completion_mask, seed=seeds[0])
    assert len({tuple(r.tolist()) for r in group}) > 1


def test_per_row_seeds_equal_per_seed_calls():
    prompt, prompt_mask, completion, completion_mask = batch()
    seeds = torch.tensor([3, 3, 9, 9, 2**40 + 1, -5])
    per_row = masks_of(prompt, prompt_mask, completion, completion_mask, seed=seeds)
    for i, s in enumerate(seeds.tolist()):
        assert torch.equal(per_row[i], masks_of(prompt, prompt_mask, completion, completion_mask, seed=s)[i])
    with pytest.raises(ValueError, match="mask_seed"):
        masks_of(prompt, prompt_mask, completion, completion_mask, seed=seeds[:2])


def test_tokens_after_eos_do_not_change_the_mask():
    prompt, prompt_mask, completion, completion_mask = batch()
    other = completion.clone()
    other[0, 5:] = 1  # only where completion_mask == 0
    assert torch.equal(masks_of(prompt, prompt_mask, completion, completion_mask, seed=9),
                       masks_of(prompt, prompt_mask, other, completion_mask, seed=9))


# -- log-probs ------------------------------------------------------------------------------------------


def test_logps_equal_a_direct_computation_with_temperature(model):
    prompt, prompt_mask, completion, completion_mask = batch()
    temperature = 0.7
    with torch.no_grad():
        logps = mean_field_logps(model, prompt, prompt_mask, completion, completion_mask, mask_seed=4,
                                 temperature=temperature, p_mask_prompt=0.3)
        masked = masks_of(prompt, prompt_mask, completion, completion_mask, seed=4, p=0.3)
        inputs = torch.cat([prompt.masked_fill(masked, MASK), torch.full_like(completion, MASK)], 1)
        attn = torch.cat([prompt_mask, torch.ones_like(completion_mask)], 1)
        logits = model(inputs, attention_mask=attn).logits[:, prompt.shape[1]:]
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, completion[..., None]).squeeze(-1)
    assert logps.shape == completion.shape and logps.dtype == torch.float32
    torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)
    assert (logps <= 0).all()


def test_same_seed_gives_same_logps_and_another_seed_different(model):
    args = batch()
    with torch.no_grad():
        a = mean_field_logps(model, *args, mask_seed=1)
        b = mean_field_logps(model, *args, mask_seed=1)
        c = mean_field_logps(model, *args, mask_seed=2)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_a_rows_logps_do_not_depend_on_its_batch(model):
    prompt, prompt_mask, completion, completion_mask = batch()
    with torch.no_grad():
        full = mean_field_logps(model, prompt, prompt_mask, completion, completion_mask, mask_seed=8)
        for i in range(prompt.shape[0]):
            keep = prompt_mask[i].bool()
            alone = mean_field_logps(model, prompt[i, keep][None], prompt_mask[i, keep][None],
                                     completion[i][None], completion_mask[i][None], mask_seed=8)
            torch.testing.assert_close(alone[0], full[i], rtol=1e-4, atol=1e-4)


def test_gradients_flow(model):
    model.zero_grad()
    logps = mean_field_logps(model, *batch(), mask_seed=0)
    logps.sum().backward()
    assert model.model.transformer.blocks[0].q_proj.weight.grad.abs().sum() > 0


def test_token_logps_matches_log_softmax_in_bf16():
    logits = torch.randn(3, 5, 11).bfloat16()
    ids = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits.float() / 2.0, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logps(logits, ids, 2.0), expected)
    with pytest.raises(ValueError, match="temperature"):
        token_logps(logits, ids, 0.0)


def test_bad_inputs_raise(model):
    prompt, prompt_mask, completion, completion_mask = batch()
    with pytest.raises(ValueError, match="p_mask_prompt"):
        mean_field_logps(model, prompt, prompt_mask, completion, completion_mask, mask_seed=0, p_mask_prompt=1.5)
    with pytest.raises(ValueError, match="same B"):
        mean_field_logps(model, prompt[:2], prompt_mask[:2], completion, completion_mask, mask_seed=0)
    with pytest.raises(ValueError, match="shapes"):
        mean_field_logps(model, prompt, prompt_mask[:, 1:], completion, completion_mask, mask_seed=0)


# -- registry -------------------------------------------------------------------------------------------


def test_registry(monkeypatch):
    monkeypatch.setattr(likelihood, "_REGISTRY", dict(likelihood._REGISTRY))  # keep the global registry clean
    assert get_estimator("mean_field") is mean_field_logps
    assert "mean_field" in available_estimators()
    assert isinstance(mean_field_logps, LikelihoodEstimator)
    with pytest.raises(ValueError, match="mean_field"):
        get_estimator("elbo_128")

    def custom(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, mask_seed, **kw):
        return torch.zeros(completion_ids.shape)

    assert get_estimator(custom) is custom
    register_estimator("zeros_for_test")(custom)
    assert get_estimator("zeros_for_test") is custom
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("mean_field")(custom)


def test_each_phase_scores_the_same_masked_input_in_its_own_precision():
    from jetrl_trainer.quant import PrecisionPhases, quantize_model

    base = build_tiny_llada(vocab_size=VOCAB, mask_token_id=MASK, seed=2, dtype=torch.bfloat16).eval()
    rec = Recorder(quantize_model(base, train="bf16", rollout="fp8"))
    args = batch()
    with torch.no_grad():
        with PrecisionPhases(base).rollout():
            rollout = mean_field_logps(rec, *args, mask_seed=6)
        with PrecisionPhases(base).train():
            train = mean_field_logps(rec, *args, mask_seed=6)
    (rollout_ids, _), (train_ids, _) = rec.calls
    assert torch.equal(rollout_ids, train_ids)  # like is compared with like
    assert not torch.equal(rollout, train)  # FP8 rollout vs BF16 train: the mismatch correctors manage
    assert (rollout - train).abs().max() < 0.5


# -- ELBO ----------------------------------------------------------------------------------------------

import math  # noqa: E402
from itertools import combinations  # noqa: E402

from jetrl_trainer.diffusion import elbo_logps  # noqa: E402
from jetrl_trainer.diffusion.likelihood import elbo_masks  # noqa: E402


def small_batch():
    """Two rows: 4 real completion tokens, and 3 (a padded prompt and a token past the completion)."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(1, MASK, (2, 3), generator=g)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    prompt = prompt.masked_fill(prompt_mask == 0, PAD)
    completion = torch.randint(1, MASK, (2, 4), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    return prompt, prompt_mask, completion, completion_mask


@torch.no_grad()
def exact_elbo(model, prompt, prompt_mask, completion, completion_mask):
    """E_l E_{M | l}[(L/l) 1[i in M] log p(x_i | x with M masked)] per token, by enumerating every mask."""
    out = torch.zeros(completion.shape)
    for b in range(completion.shape[0]):
        L = int(completion_mask[b].sum())
        real = list(range(L))
        for l in range(1, L + 1):
            subsets = list(combinations(real, l))
            for subset in subsets:
                noisy = completion[b].clone()
                noisy[list(subset)] = MASK
                noisy[L:] = MASK  # past the completion: always hidden
                x = torch.cat([prompt[b], noisy])[None]
                attn = torch.cat([prompt_mask[b], torch.ones(completion.shape[1], dtype=torch.long)])[None]
                logits = model(x, attention_mask=attn, logits_to_keep=completion.shape[1]).logits[0]
                logp = torch.log_softmax(logits, -1)
                for i in subset:
                    out[b, i] += (1 / L) * (1 / len(subsets)) * (L / l) * logp[i, completion[b, i]]
    return out


def test_elbo_mask_sizes_and_weights_follow_the_published_forward_process():
    prompt, prompt_mask, completion, completion_mask = batch(B=64, P=4, T=9, seed=2)
    completion_mask[:, 6:] = 0  # L = 6 (row 0 has 5 real tokens: its own mask from batch())
    counts = torch.zeros(7)
    for seed in range(40):
        masked, weight = elbo_masks(prompt, prompt_mask, completion, completion_mask, mask_seed=seed, n_mc=4)
        assert not (masked & ~completion_mask.bool()).any()  # only real completion tokens
        L = completion_mask.sum(1)
        l = masked.sum(-1)  # (n_mc, B)
        assert ((l >= 1) & (l <= L)).all()
        torch.testing.assert_close(weight, (L / l).float())
        counts += torch.bincount(l[:, 1:].flatten(), minlength=7).float()  # rows with L = 6
    # l ~ U{1..6}: 40 seeds x 4 samples x 63 rows = 10080 draws, ~1680 each (sd ~37)
    assert (counts[1:] - counts[1:].mean()).abs().max() < 150 and counts[0] == 0


def test_elbo_masks_are_uniform_subsets_given_their_size():
    prompt, prompt_mask, completion, completion_mask = batch(B=32, P=4, T=3, seed=4)
    completion_mask[:] = 1
    seen = {}
    for seed in range(60):
        masked, _ = elbo_masks(prompt, prompt_mask, completion, completion_mask, mask_seed=seed, n_mc=3)
        for m in masked.reshape(-1, 3):
            if int(m.sum()) == 1:
                seen[tuple(m.tolist())] = seen.get(tuple(m.tolist()), 0) + 1
    assert len(seen) == 3 and max(seen.values()) / min(seen.values()) < 1.25  # ~640 draws per size-1 set


def test_elbo_antithetic_pairs_cover_the_completion():
    prompt, prompt_mask, completion, completion_mask = batch(B=8, P=4, T=7, seed=3)
    masked, weight = elbo_masks(prompt, prompt_mask, completion, completion_mask, mask_seed=1, n_mc=6, antithetic=True)
    L = completion_mask.sum(1)
    first, second = masked[0::2], masked[1::2]
    assert torch.equal(first | second, completion_mask.bool().expand_as(first))  # every real token scored
    assert ((first & second).sum(-1) == 1).all()  # and exactly one of them twice
    assert torch.equal(first.sum(-1) + second.sum(-1), (L + 1).expand_as(first.sum(-1)))
    with pytest.raises(ValueError, match="n_mc must be even"):
        elbo_masks(prompt, prompt_mask, completion, completion_mask, mask_seed=1, n_mc=3, antithetic=True)
    with pytest.raises(ValueError, match="n_mc must be a positive int"):
        elbo_masks(prompt, prompt_mask, completion, completion_mask, mask_seed=1, n_mc=0)


def test_elbo_equals_the_published_formula_on_the_same_masks(model):
    """Row sum == -(1/n) Σ_j Σ_{masked} CE / p_mask, the published get_log_likelihood, for our masks."""
    prompt, prompt_mask, completion, completion_mask = batch()
    n_mc, temperature = 5, 1.0
    with torch.no_grad():
        ours = elbo_logps(model, prompt, prompt_mask, completion, completion_mask, mask_seed=7, n_mc=n_mc)
        masked, _ = elbo_masks(prompt, prompt_mask, completion, completion_mask, mask_seed=7, n_mc=n_mc)
        for b in range(prompt.shape[0]):
            keep, L = prompt_mask[b].bool(), int(completion_mask[b].sum())
            seq = torch.cat([prompt[b, keep], completion[b, :L]])[None]  # the published input: no padding
            prompt_len = int(keep.sum())
            losses = []
            for j in range(n_mc):
                is_mask = torch.cat([torch.zeros(prompt_len, dtype=torch.bool), masked[j, b, :L]])[None]
                noisy = torch.where(is_mask, MASK, seq)
                # the published canvas has no tokens past the answer; ours keeps them as [MASK]
                tail = torch.full((1, completion.shape[1] - L), MASK)
                logits = model(torch.cat([noisy, tail], 1)).logits[:, : seq.shape[1]]
                p_mask = masked[j, b, :L].sum() / L
                losses.append(torch.nn.functional.cross_entropy(logits[is_mask], seq[is_mask], reduction="none").sum() / p_mask)
            published = -sum(losses) / n_mc
            torch.testing.assert_close(ours[b].sum(), published, rtol=1e-4, atol=1e-4)
    assert (ours[completion_mask == 0] == 0).all()


@pytest.mark.parametrize("antithetic", [False, True])
def test_elbo_monte_carlo_mean_converges_to_exact_enumeration(model, antithetic):
    args = small_batch()
    exact = exact_elbo(model, *args)
    with torch.no_grad():
        draws = torch.stack([elbo_logps(model, *args, mask_seed=s, n_mc=4, antithetic=antithetic) for s in range(300)])
    mean, se = draws.mean(0), draws.std(0) / 300**0.5
    real = args[3].bool()
    assert (se[real] > 0).all()
    assert ((mean - exact).abs()[real] <= 4 * se[real] + 1e-6).all(), (mean - exact, se)
    assert (mean[~real] == 0).all()
    # the row sums (what a sequence-level ratio uses) converge too
    rows = draws.sum(-1)
    assert ((rows.mean(0) - exact.sum(-1)).abs() <= 4 * rows.std(0) / 300**0.5).all()


def favourite(T):
    """The token ContextHelps predicts at completion position i."""
    return (torch.arange(T) * 7 + 3) % (MASK - 1) + 1


class ContextHelps(torch.nn.Module):
    """A stand-in LM whose log-prob of ``favourite(T)[i]`` at completion position i grows with the share
    of the completion left visible -- the regime where the ELBO's noise level matters (a random tiny
    model hardly uses its context, so it cannot tell a biased estimator from an unbiased one)."""

    def __init__(self, real):
        super().__init__()
        self.real = real  # (B, T) or (T,): the completion's real tokens
        self.config = type("C", (), {"mask_token_id": MASK})()

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        T = self.real.shape[-1]
        real = self.real.expand(input_ids.shape[0], T).bool()
        visible = ((input_ids[:, -T:] != MASK) & real).sum(1) / real.sum(1)  # (B,)
        logits = torch.zeros(input_ids.shape[0], T, VOCAB)
        logits.scatter_(-1, favourite(T).expand(input_ids.shape[0], T)[..., None], 4.0 * visible[:, None, None].expand(-1, T, 1))
        return type("Out", (), {"logits": logits})()


@pytest.mark.parametrize("antithetic", [False, True])
def test_elbo_converges_to_exact_enumeration_when_context_matters(antithetic):
    prompt, prompt_mask, _, completion_mask = small_batch()
    completion = favourite(4).expand(2, 4).clone()
    completion[1, 3] = PAD
    args = (prompt, prompt_mask, completion, completion_mask)
    exact = torch.cat([exact_elbo(ContextHelps(completion_mask[b]), *(a[b:b + 1] for a in args)) for b in range(2)])
    draws = torch.stack([elbo_logps(ContextHelps(completion_mask), *args, mask_seed=s, n_mc=4, antithetic=antithetic)
                         for s in range(400)])  # fmt: skip
    rows, exact_rows = draws.sum(-1), exact.sum(-1)
    se = rows.std(0) / 400**0.5
    assert ((rows.mean(0) - exact_rows).abs() <= 4 * se + 1e-6).all(), (rows.mean(0), exact_rows, se)
    # the test can tell: the one-step mean-field value (nothing visible) is many standard errors away
    mean_field = exact_rows.new_tensor([4 * math.log(1 / VOCAB), 3 * math.log(1 / VOCAB)])
    assert ((mean_field - exact_rows).abs() > 20 * se).all()


def test_elbo_antithetic_pairs_reduce_the_variance_when_context_matters():
    prompt, prompt_mask, completion, completion_mask = batch(B=6, P=4, T=8, seed=5)
    completion = favourite(8).expand(6, 8).clone()
    lm = ContextHelps(completion_mask)
    args = (prompt, prompt_mask, completion, completion_mask)
    plain = torch.stack([elbo_logps(lm, *args, mask_seed=s, n_mc=4).sum(-1) for s in range(200)])
    anti = torch.stack([elbo_logps(lm, *args, mask_seed=s, n_mc=4, antithetic=True).sum(-1) for s in range(200)])
    assert (anti.var(0) < 0.5 * plain.var(0)).all(), (anti.var(0), plain.var(0))
    assert ((anti.mean(0) - plain.mean(0)).abs() < 4 * (plain.var(0) / 200).sqrt() + 1e-3).all()  # same mean


def test_elbo_is_batch_invariant_and_seeded(model):
    prompt, prompt_mask, completion, completion_mask = batch()
    with torch.no_grad():
        full = elbo_logps(model, prompt, prompt_mask, completion, completion_mask, mask_seed=8, n_mc=3)
        assert torch.equal(full, elbo_logps(model, prompt, prompt_mask, completion, completion_mask, mask_seed=8, n_mc=3))
        assert not torch.allclose(full, elbo_logps(model, prompt, prompt_mask, completion, completion_mask, mask_seed=9, n_mc=3))
        other = completion.clone()
        other[0, 5:] = 1  # past row 0's completion_mask: changes nothing
        torch.testing.assert_close(full, elbo_logps(model, prompt, prompt_mask, other, completion_mask, mask_seed=8, n_mc=3))
        for i in range(prompt.shape[0]):
            keep = prompt_mask[i].bool()
            alone = elbo_logps(model, prompt[i, keep][None], prompt_mask[i, keep][None], completion[i][None],
                               completion_mask[i][None], mask_seed=8, n_mc=3)
            torch.testing.assert_close(alone[0], full[i], rtol=1e-4, atol=1e-4)


def test_elbo_gradients_flow_and_it_is_registered(model):
    assert get_estimator("elbo") is elbo_logps and "elbo" in available_estimators()
    assert isinstance(elbo_logps, LikelihoodEstimator)
    model.zero_grad()
    elbo_logps(model, *batch(), mask_seed=0, n_mc=2).sum().backward()
    assert model.model.transformer.blocks[0].q_proj.weight.grad.abs().sum() > 0


def test_elbo_scores_every_phase_on_the_same_masked_inputs():
    from jetrl_trainer.quant import PrecisionPhases, quantize_model

    base = build_tiny_llada(vocab_size=VOCAB, mask_token_id=MASK, seed=2, dtype=torch.bfloat16).eval()
    rec = Recorder(quantize_model(base, train="bf16", rollout="fp8"))
    args = batch()
    with torch.no_grad():
        with PrecisionPhases(base).rollout():
            rollout = elbo_logps(rec, *args, mask_seed=6, n_mc=3)
        with PrecisionPhases(base).train():
            train = elbo_logps(rec, *args, mask_seed=6, n_mc=3)
    inputs = [ids for ids, _ in rec.calls]
    assert len(inputs) == 6 and all(torch.equal(a, b) for a, b in zip(inputs[:3], inputs[3:]))
    assert len({tuple(ids.flatten().tolist()) for ids in inputs[:3]}) == 3  # three different masks
    assert not torch.equal(rollout, train) and (rollout - train).abs().max() < 0.5


def test_scorer_reads_the_elbo_entropy_where_it_reads_its_logps(model):
    """DiffusionScorer's entropy for the ELBO: each forward weighted as its log-probs (masked tokens only)."""
    from jetrl_trainer.diffusion.scoring import DiffusionScorer, diffusion_logps

    prompt, prompt_mask, completion, completion_mask = batch()
    ids, attn = torch.cat([prompt, completion], 1), torch.cat([prompt_mask, completion_mask], 1)
    seeds = torch.full((ids.shape[0], 1), 5)
    T = completion.shape[1]
    with torch.no_grad():
        logps, entropy = diffusion_logps(model, ids, attn, T, seeds, estimator=elbo_logps, gen_length=T,
                                         mask_token_id=MASK, temperature=1.0, compute_entropy=True, n_mc=3)  # fmt: skip
        masked, weight = elbo_masks(prompt, prompt_mask, completion, completion_mask, mask_seed=seeds[:, 0], n_mc=3)
        expected = torch.zeros(completion.shape)
        for m, w in zip(masked, weight):
            noisy = completion.masked_fill(m | (completion_mask == 0), MASK)
            logits = model(torch.cat([prompt, noisy], 1), attention_mask=torch.cat([prompt_mask, torch.ones_like(completion)], 1)).logits[:, -T:]
            logp = torch.log_softmax(logits, -1)
            expected += -(logp.exp() * logp).sum(-1) * m * w[:, None] / 3
    torch.testing.assert_close(entropy[:, 0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logps[:, 0], elbo_logps(model, prompt, prompt_mask, completion, completion_mask,
                                                       mask_seed=seeds[:, 0], n_mc=3))  # fmt: skip
    assert (entropy[:, 0][completion_mask == 0] == 0).all()
    scorer = DiffusionScorer(estimator="elbo", p_mask_prompt=0.3, n_mc=4, antithetic=True, gen_length=T,
                             mask_token_id=MASK, temperature=1.0, seed=0, num_iterations=1)  # fmt: skip
    assert scorer.estimator_options == dict(n_mc=4, antithetic=True)  # the ELBO never masks the prompt
    with pytest.raises(ValueError, match="takes no antithetic, n_mc"):
        DiffusionScorer(estimator="mean_field", p_mask_prompt=0.3, n_mc=4, antithetic=True, gen_length=T,
                        mask_token_id=MASK, temperature=1.0, seed=0, num_iterations=1)  # fmt: skip
