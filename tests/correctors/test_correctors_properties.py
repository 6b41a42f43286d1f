"""Property-based checks of the corrector invariants (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetrl_trainer.correctors import get_corrector, merge_sums, metrics_from_sums, mismatch_metrics

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
LEVELS = ("token", "sequence", "geometric")
NON_FINITE = (float("nan"), float("inf"), -float("inf"))


@st.composite
def batches(draw, max_b=4, max_t=6):
    """(train, rollout, mask, advantages) with some non-finite log-probs, float32."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    n = b * t

    def grid(elements):
        return torch.tensor(draw(st.lists(elements, min_size=n, max_size=n)), dtype=torch.float32).view(b, t)

    train = grid(st.floats(-40.0, 0.0, width=32))
    rollout = train + grid(st.floats(-3.0, 3.0, width=32))
    # About one token in eight gets a NaN/±Inf log-prob, on either side.
    for logps in (train, rollout):
        pick = grid(st.sampled_from([0.0] * 21 + [1.0, 2.0, 3.0])).long()
        for code, value in enumerate(NON_FINITE, start=1):
            logps[pick == code] = value
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).view(b, t)
    adv = torch.tensor(draw(st.lists(st.floats(-3.0, 3.0, width=32), min_size=b, max_size=b)))
    return train, rollout, mask, adv


def corrector(name, level, clip=2.0):
    if name == "none":
        return get_corrector("none")
    if name == "tis":
        return get_corrector("tis", clip=clip, level=level)
    return get_corrector(name, level=level)


@pytest.mark.parametrize("name", ["none", "is", "tis", "mis", "ais"])
@SETTINGS
@given(data=batches(), level=st.sampled_from(LEVELS))
def test_weights_finite_non_negative_and_metrics_never_nan(name, data, level):
    out = corrector(name, level)(*data)
    w = out.weights
    assert w.shape == data[0].shape and w.dtype == torch.float32
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert not any(math.isnan(v) for v in out.metrics.values()), out.metrics
    valid = (data[2] != 0) & torch.isfinite(data[0]) & torch.isfinite(data[1])
    assert torch.equal(w[~valid], torch.ones_like(w[~valid]))
    assert out.metrics["mismatch/nonfinite_tokens"] == float(((data[2] != 0) & ~valid).sum())


@SETTINGS
@given(data=batches(), level=st.sampled_from(LEVELS), clip=st.floats(1.0, 10.0))
def test_tis_never_exceeds_clip(data, level, clip):
    w = corrector("tis", level, clip)(*data).weights
    assert (w <= torch.tensor(clip, dtype=torch.float32)).all()


@SETTINGS
@given(data=batches(), level=st.sampled_from(LEVELS))
def test_ais_weights_lie_between_one_and_truncated_ratio(data, level):
    out = get_corrector("ais", level=level)(*data)
    m = out.metrics
    assert 0.0 <= m["corrector/alpha"] <= 1.0 and 0.0 <= m["corrector/alpha_mis"] <= 1.0
    assert 0.0 <= m["corrector/alpha_ess"] <= 1.0 + 1e-12 and m["corrector/alpha_var"] >= 0.0
    assert ((out.weights >= 0) & (out.weights <= 2.0)).all()
    if m["corrector/alpha"] == 0.0:
        assert torch.equal(out.weights, torch.ones_like(out.weights))


@SETTINGS
@given(data=batches(), level=st.sampled_from(LEVELS[1:]))
def test_sequence_levels_give_one_weight_per_sequence(data, level):
    out = get_corrector("is", level=level)(*data)
    valid = (data[2] != 0) & torch.isfinite(data[0]) & torch.isfinite(data[1])
    for row, ok in zip(out.weights, valid):
        assert row[ok].unique().numel() <= 1


@SETTINGS
@given(data=batches(max_b=6), split=st.integers(1, 5))
def test_sums_over_splits_equal_the_whole(data, split):
    train, rollout, mask, adv = data
    split = min(split, train.shape[0])
    tis = get_corrector("tis")
    whole = tis(train, rollout, mask, adv).metrics
    parts = [tis(train[:split], rollout[:split], mask[:split])]
    if split < train.shape[0]:
        parts.append(tis(train[split:], rollout[split:], mask[split:]))
    merged = metrics_from_sums(merge_sums(*(p.sums for p in parts)))
    assert merged == pytest.approx(whole, rel=1e-9, abs=1e-12)
    mm = mismatch_metrics(train, rollout, mask)
    assert mm == pytest.approx({k: whole[k] for k in mm}, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name", ["is", "tis", "mis", "ais"])
@SETTINGS
@given(data=batches(), level=st.sampled_from(LEVELS), pad=st.integers(1, 3), junk=st.sampled_from(NON_FINITE + (7.0,)))
def test_padding_with_garbage_changes_nothing(name, data, level, pad, junk):
    train, rollout, mask, adv = data
    b, t = train.shape
    grow = torch.full((b, pad), junk)
    padded = (
        torch.cat([train, grow], 1),
        torch.cat([rollout, -grow], 1),
        torch.cat([mask, torch.zeros(b, pad, dtype=mask.dtype)], 1),
        adv,
    )
    corr = get_corrector(name, level=level)
    base, out = corr(*data), corr(*padded)
    assert torch.equal(out.weights[:, :t], base.weights)
    assert torch.equal(out.weights[:, t:], torch.ones(b, pad))
    assert out.metrics == pytest.approx(base.metrics, rel=1e-9, abs=1e-12)
