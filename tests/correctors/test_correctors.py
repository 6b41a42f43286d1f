"""Correctors: hand-worked values, levels, AIS gates, padding, non-finite input, sums, registry."""

from __future__ import annotations

import math

import pytest
import torch

from jetrl_trainer.correctors import (
    MAX_KEYS,
    MIN_KEYS,
    MISMATCH_METRICS,
    SUM_KEYS,
    AISCorrector,
    Correction,
    Corrector,
    TISCorrector,
    available_correctors,
    get_corrector,
    merge_sums,
    metrics_from_sums,
    mismatch_metrics,
    mismatch_sums,
    reduce_op,
    register_corrector,
)

L2, L3 = math.log(2.0), math.log(3.0)
NAN, INF = float("nan"), float("inf")
ALL = ("none", "is", "tis", "mis", "ais")
LEVELED = ("is", "tis", "mis", "ais")


def batch():
    """ρ = [[2, 1/2, 1, 4], [1/4, 1, 3, pad]]: rollout 0, train = log ρ (exact in float64)."""
    train = torch.tensor([[L2, -L2, 0.0, 2 * L2], [-2 * L2, 0.0, L3, NAN]], dtype=torch.float64)
    rollout = torch.zeros_like(train)
    rollout[1, 3] = INF  # garbage in the padded slot
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    return train, rollout, mask, adv


def run(name, level=None, **params):
    if level is not None:
        params["level"] = level
    return get_corrector(name, **params)(*batch())


def valid_weights(out: Correction) -> list[float]:
    w = out.weights
    return w[0].tolist() + w[1, :3].tolist()


# ---------------------------------------------------------------- mismatch block, by hand
# n = 7 tokens, log r = ln2, -ln2, 0, 2ln2, -2ln2, 0, ln3; r = 2, .5, 1, 4, .25, 1, 3.
HAND_MISMATCH = {
    "mismatch/logp_abs_diff_mean": (6 * L2 + L3) / 7,
    "mismatch/logp_abs_diff_max": 2 * L2,
    "mismatch/kl_k1": -L3 / 7,  # mean(-log r)
    # Σ (r - 1 - log r) = (1-ln2) + (-.5+ln2) + 0 + (3-2ln2) + (-.75+2ln2) + 0 + (2-ln3) = 4.75 - ln3
    "mismatch/kl_k3": (4.75 - L3) / 7,
    "mismatch/ppl_ratio": 3 ** (-1 / 7),  # exp(mean(rollout - train))
    "mismatch/ess_ratio": 11.75**2 / (7 * 31.3125),  # Σr = 11.75, Σr² = 31.3125
    "mismatch/nonfinite_tokens": 0.0,
    "mismatch/logp_bits_equal_share": 2 / 7,  # rho = 1 exactly at two of the seven tokens
}


@pytest.mark.parametrize("name", ALL)
def test_every_corrector_reports_the_hand_worked_mismatch_block(name):
    out = run(name)
    for key, expected in HAND_MISMATCH.items():
        assert out.metrics[key] == pytest.approx(expected, rel=1e-12, abs=1e-15), key


def test_standalone_mismatch_metrics_match_hand_values():
    train, rollout, mask, _ = batch()
    got = mismatch_metrics(train, rollout, mask)
    assert set(got) == set(MISMATCH_METRICS)
    assert got == pytest.approx(HAND_MISMATCH, rel=1e-12)


def test_k3_is_non_negative_and_k1_sign_follows_direction():
    # rollout more confident than train on every sampled token: KL(rollout‖train) > 0 both ways.
    train = torch.tensor([[-1.0, -2.0]])
    rollout = torch.tensor([[-0.5, -1.0]])
    m = mismatch_metrics(train, rollout, torch.ones(1, 2))
    assert m["mismatch/kl_k1"] == pytest.approx(0.75)  # mean(rollout − train)
    assert m["mismatch/kl_k3"] == pytest.approx(((math.exp(-0.5) - 1 + 0.5) + (math.exp(-1) - 1 + 1)) / 2)
    assert m["mismatch/ppl_ratio"] == pytest.approx(math.exp(0.75))


# ---------------------------------------------------------------- weights, by hand, three levels
SEQ = [4.0] * 4 + [0.75] * 3  # row sums: 2 ln2 → 4, ln(3/4) → 0.75
GEO = [math.sqrt(2)] * 4 + [0.75 ** (1 / 3)] * 3  # row means: ln2/2, ln(3/4)/3


@pytest.mark.parametrize(
    ("name", "level", "params", "weights", "frac"),
    [
        ("none", None, {}, [1.0] * 7, None),
        ("is", "token", {}, [2, 0.5, 1, 4, 0.25, 1, 3], None),
        ("is", "sequence", {}, SEQ, None),
        ("is", "geometric", {}, GEO, None),
        ("tis", "token", {"clip": 2.0}, [2, 0.5, 1, 2, 0.25, 1, 2], ("clipped_frac", 2 / 7)),
        ("tis", "sequence", {"clip": 2.0}, [2.0] * 4 + [0.75] * 3, ("clipped_frac", 4 / 7)),
        ("tis", "geometric", {"clip": 1.2}, [1.2] * 4 + GEO[4:], ("clipped_frac", 4 / 7)),
        # bounds inclusive: ρ = 2 and ρ = 1/2 are kept
        ("mis", "token", {}, [2, 0.5, 1, 0, 0, 1, 0], ("masked_frac", 3 / 7)),
        ("mis", "sequence", {}, [0.0] * 4 + [0.75] * 3, ("masked_frac", 4 / 7)),
        ("mis", "geometric", {"low": 0.95, "high": 2.0}, GEO[:4] + [0.0] * 3, ("masked_frac", 3 / 7)),
    ],
)
def test_weights_by_hand(name, level, params, weights, frac):
    out = run(name, level, **params)
    assert valid_weights(out) == pytest.approx(weights, rel=1e-6)
    assert out.weights[1, 3].item() == 1.0  # padding: neutral weight
    m = out.metrics
    assert m["corrector/weight_mean"] == pytest.approx(sum(weights) / 7, rel=1e-6)
    assert m["corrector/weight_min"] == pytest.approx(min(weights), rel=1e-6)
    assert m["corrector/weight_max"] == pytest.approx(max(weights), rel=1e-6)
    if frac is not None:
        assert m[f"corrector/{frac[0]}"] == pytest.approx(frac[1])


def test_geometric_level_divides_by_each_rows_own_token_count():
    # row 0: one valid token (log ρ = 0.6); row 1: two (0.2, -0.8) → mean -0.3
    train = torch.tensor([[0.6, 9.0, 9.0], [0.2, -0.8, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    out = get_corrector("is", level="geometric")(train, torch.zeros_like(train), mask, None)
    assert out.weights.tolist()[0][0] == pytest.approx(math.exp(0.6), rel=1e-6)
    assert out.weights.tolist()[1][:2] == pytest.approx([math.exp(-0.3)] * 2, rel=1e-6)


def test_weights_are_float32_detached_and_on_the_input_device():
    train, rollout, mask, adv = batch()
    train = train.float().requires_grad_(True)
    for name in ALL:
        out = get_corrector(name)(train, rollout.float(), mask, adv)
        assert out.weights.dtype == torch.float32 and out.weights.shape == (2, 4)
        assert not out.weights.requires_grad and out.weights.device == train.device


def test_bf16_inputs_and_float_mask_are_accepted():
    train, rollout, mask, adv = batch()
    out = get_corrector("tis")(train.bfloat16(), rollout.bfloat16(), mask.float(), adv)
    ref = get_corrector("tis")(train.bfloat16().double(), rollout.bfloat16().double(), mask, adv)
    assert torch.equal(out.weights, ref.weights)


def test_metric_names_are_exactly_the_documented_ones():
    weight = {"corrector/weight_mean", "corrector/weight_min", "corrector/weight_max"}
    alpha = {"corrector/alpha", "corrector/alpha_ess", "corrector/alpha_mis", "corrector/alpha_var"}
    expected = {
        "none": weight,
        "is": weight,
        "tis": weight | {"corrector/clipped_frac"},
        "mis": weight | {"corrector/masked_frac"},
        "ais": weight | {"corrector/clipped_frac"} | alpha,
    }
    for name, own in expected.items():
        out = run(name)
        assert set(out.metrics) == set(MISMATCH_METRICS) | own
        assert set(out.metric_tensors) == set(out.metrics)
        assert all(isinstance(v, float) for v in out.metrics.values())


def test_tis_weights_never_exceed_a_clip_that_float32_cannot_represent():
    train = torch.tensor([[5.0, math.log(2.1), 0.3]], dtype=torch.float64)
    out = get_corrector("tis", clip=2.1)(train, torch.zeros_like(train), torch.ones(1, 3), None)
    assert (out.weights.double() <= 2.1).all()
    assert out.weights[0, 2].item() == pytest.approx(math.exp(0.3), rel=1e-6)


def test_huge_log_ratio_stays_finite():
    train = torch.tensor([[500.0, -500.0, 0.0]])
    out = get_corrector("is", level="sequence")(train, torch.zeros_like(train) - 1000, torch.ones(1, 3), None)
    assert torch.isfinite(out.weights).all()
    assert all(math.isfinite(v) for k, v in out.metrics.items() if k != "mismatch/kl_k3")
    assert not any(math.isnan(v) for v in out.metrics.values())


# ---------------------------------------------------------------- AIS
def ais_parts(w_bar, adv_tokens, d_bar, delta, gamma, beta):
    """The AIS formulas on python floats (population statistics)."""
    n = len(w_bar)
    mean = sum(w_bar) / n
    var = sum((w - mean) ** 2 for w in w_bar) / n
    a_ess = (1 + var / mean**2) ** -0.5
    a_mis = min(1.0, d_bar / delta)

    def std(xs):
        mu = sum(xs) / len(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / len(xs))

    d_sigma = std([w * a for w, a in zip(w_bar, adv_tokens)]) / std(adv_tokens) - 1
    a_var = max(0.0, (d_sigma - gamma) / gamma)
    alpha = min(1.0, max(0.0, a_ess - beta * a_var)) * a_mis
    return alpha, a_ess, a_mis, a_var


def test_ais_by_hand():
    # w̄ = min(ρ, 2) = [2, .5, 1, 2, .25, 1, 2]; A per sequence [1, -1] → tokens [1,1,1,1,-1,-1,-1].
    w_bar = [2, 0.5, 1, 2, 0.25, 1, 2]
    adv = [1, 1, 1, 1, -1, -1, -1]
    # CV² = (14.3125/7 − 1.25²) / 1.25² → α_ess = 0.8741808…; Δσ = 0.4077535…
    alpha, a_ess, a_mis, a_var = ais_parts(w_bar, adv, (6 * L2 + L3) / 7, delta=2.0, gamma=0.3, beta=1.0)
    assert a_ess == pytest.approx(0.87418083926, rel=1e-9)
    assert 0 < alpha < 1 and 0 < a_var < 1 and a_mis < 1  # every gate active and unsaturated
    out = run("ais", clip=2.0, delta=2.0, gamma=0.3, beta=1.0)
    m = out.metrics
    assert m["corrector/alpha_ess"] == pytest.approx(a_ess, rel=1e-12)
    assert m["corrector/alpha_mis"] == pytest.approx(a_mis, rel=1e-12)
    assert m["corrector/alpha_var"] == pytest.approx(a_var, rel=1e-9)
    assert m["corrector/alpha"] == pytest.approx(alpha, rel=1e-9)
    assert m["corrector/clipped_frac"] == pytest.approx(2 / 7)
    assert valid_weights(out) == pytest.approx([1 + alpha * (w - 1) for w in w_bar], rel=1e-6)


def test_ais_default_gamma_turns_strong_amplification_off():
    # The same batch with the defaults: Δσ ≈ 0.41 ≥ 2γ = 0.2 → α_var ≈ 3.08 → α = 0 → exact ones.
    _, a_ess, _, a_var = ais_parts([2, 0.5, 1, 2, 0.25, 1, 2], [1] * 4 + [-1] * 3, 0.75, 0.05, 0.1, 1.0)
    assert a_var == pytest.approx(3.0775382554, rel=1e-9) and a_var > a_ess
    out = run("ais")
    assert out.metrics["corrector/alpha_var"] == pytest.approx(a_var, rel=1e-9)
    assert out.metrics["corrector/alpha"] == 0.0
    assert torch.equal(out.weights, torch.ones(2, 4))


def const_batch(rho, n=6, adv=None):
    train = torch.full((2, n // 2), math.log(rho), dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0]) if adv is None else adv
    return train, torch.zeros_like(train), torch.ones(2, n // 2), adv


def test_ais_alpha_mis_saturates_at_delta():
    # constant ρ = e^0.02 → d̄ = 0.02; α_ess = 1 (no spread), Δσ = ρ − 1 ≈ 0.02 < γ.
    for delta, expected in [(0.04, 0.5), (0.02, 1.0), (0.01, 1.0)]:
        out = AISCorrector(delta=delta)(*const_batch(math.exp(0.02)))
        assert out.metrics["corrector/alpha_mis"] == pytest.approx(expected)
        assert out.metrics["corrector/alpha_ess"] == pytest.approx(1.0, abs=1e-12)
        assert out.metrics["corrector/alpha"] == pytest.approx(expected)


def test_ais_alpha_var_is_zero_up_to_gamma_and_one_at_two_gamma():
    # constant w̄ = c ⇒ std(cA)/std(A) = c ⇒ Δσ = c − 1 exactly.
    for c, expected in [(1.05, 0.0), (1.1, 0.0), (1.15, 0.5), (1.2, 1.0), (1.4, 3.0)]:
        out = AISCorrector(gamma=0.1, delta=1e-3)(*const_batch(c))
        assert out.metrics["corrector/alpha_var"] == pytest.approx(expected, abs=1e-9)
        assert out.metrics["corrector/alpha"] == pytest.approx(max(0.0, 1 - expected), abs=1e-9)


def test_ais_alpha_var_is_zero_when_advantages_are_constant():
    train, rollout, mask, _ = batch()
    for adv in (torch.zeros(2), torch.full((2,), 0.1)):
        out = AISCorrector()(train, rollout, mask, adv)
        assert out.metrics["corrector/alpha_var"] == 0.0
        assert out.metrics["corrector/alpha"] == pytest.approx(out.metrics["corrector/alpha_ess"])


def test_ais_alpha_ess_is_one_for_equal_weights_and_falls_with_spread():
    assert AISCorrector(delta=1e-3)(*const_batch(1.5)).metrics["corrector/alpha_ess"] == pytest.approx(1.0)
    # one token at C, five tokens with ρ ≈ 0: α_ess → mean/sqrt(meansq) = (C/6)/(C/sqrt 6) = 1/sqrt 6
    train = torch.tensor([[5.0, -60.0, -60.0], [-60.0, -60.0, -60.0]], dtype=torch.float64)
    out = AISCorrector(gamma=100.0)(train, torch.zeros_like(train), torch.ones(2, 3), torch.tensor([1.0, -1.0]))
    assert out.metrics["corrector/alpha_ess"] == pytest.approx(1 / math.sqrt(6), rel=1e-9)


def test_ais_gives_exact_ones_when_policies_agree():
    train = torch.randn(4, 7, generator=torch.Generator().manual_seed(0)) - 3
    out = AISCorrector()(train, train.clone(), torch.ones(4, 7), torch.randn(4))
    assert out.metrics["corrector/alpha_mis"] == 0.0 and out.metrics["corrector/alpha"] == 0.0
    assert torch.equal(out.weights, torch.ones(4, 7))


def test_ais_variance_amplification_reduces_alpha():
    # same ratios; advantages aligned with the large weights amplify spread more than misaligned.
    train = torch.tensor([[0.6, 0.6, 0.6], [-0.6, -0.6, -0.6]], dtype=torch.float64)
    rollout = torch.zeros_like(train)
    mask = torch.ones(2, 3)
    corr = AISCorrector(gamma=0.5, beta=0.5)
    aligned = corr(train, rollout, mask, torch.tensor([2.0, -0.5])).metrics
    opposed = corr(train, rollout, mask, torch.tensor([0.5, -2.0])).metrics
    assert aligned["corrector/alpha_ess"] == pytest.approx(opposed["corrector/alpha_ess"])
    assert aligned["corrector/alpha_var"] > opposed["corrector/alpha_var"]
    assert aligned["corrector/alpha"] < opposed["corrector/alpha"]
    assert opposed["corrector/alpha_var"] == 0.0 and 0 < aligned["corrector/alpha"] < 1
    # larger β penalises the same amplification harder
    harder = AISCorrector(gamma=0.5, beta=2.0)(train, rollout, mask, torch.tensor([2.0, -0.5])).metrics
    assert 0 < harder["corrector/alpha"] < aligned["corrector/alpha"]


def test_ais_needs_advantages():
    train, rollout, mask, _ = batch()
    with pytest.raises(ValueError, match="advantages"):
        AISCorrector()(train, rollout, mask, None)


# ---------------------------------------------------------------- padding never leaks
def padded(train, rollout, mask, adv):
    """Append 3 padded columns and one padded row full of garbage."""
    b, t = train.shape
    garbage = torch.tensor([NAN, INF, -1e30], dtype=train.dtype)
    tr = torch.cat([train, garbage.expand(b, 3)], 1)
    ro = torch.cat([rollout, -garbage.expand(b, 3)], 1)
    tr = torch.cat([tr, torch.full((1, t + 3), 7.0, dtype=tr.dtype)])
    ro = torch.cat([ro, torch.full((1, t + 3), NAN, dtype=ro.dtype)])
    m = torch.cat([torch.cat([mask, torch.zeros(b, 3, dtype=mask.dtype)], 1), torch.zeros(1, t + 3, dtype=mask.dtype)])
    a = torch.cat([adv, torch.tensor([123.0])])
    return tr, ro, m, a


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_padding_never_leaks(name, level):
    params = {} if name == "none" else {"level": level}
    corr = get_corrector(name, **params)
    args = batch()
    if name == "ais":
        corr = AISCorrector(gamma=0.5, level=level)  # an α strictly between 0 and 1
    base = corr(*args)
    pad = corr(*padded(*args))
    b, t = args[0].shape
    assert torch.equal(pad.weights[:b, :t], base.weights)
    assert torch.equal(pad.weights[b:], torch.ones(1, t + 3))
    assert torch.equal(pad.weights[:, t:], torch.ones(b + 1, 3))
    assert pad.metrics == pytest.approx(base.metrics, rel=1e-12, abs=1e-15)


def test_per_token_advantages_padding_garbage_does_not_leak():
    train, rollout, mask, adv = batch()
    adv_tok = adv[:, None].expand(2, 4).clone()
    adv_tok[1, 3] = NAN
    a = AISCorrector(gamma=0.5)(train, rollout, mask, adv)
    b = AISCorrector(gamma=0.5)(train, rollout, mask, adv_tok)
    assert torch.equal(a.weights, b.weights) and a.metrics == b.metrics


# ---------------------------------------------------------------- non-finite and empty input
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_tokens_are_counted_excluded_and_weighted_one(name, bad):
    train, rollout, mask, adv = batch()
    bad_train, bad_rollout = train.clone(), rollout.clone()
    bad_train[0, 3] = bad
    bad_rollout[1, 1] = bad
    out = get_corrector(name)(bad_train, bad_rollout, mask, adv)
    clean_mask = mask.clone()
    clean_mask[0, 3] = clean_mask[1, 1] = False
    ref = get_corrector(name)(train, rollout, clean_mask, adv)
    assert torch.isfinite(out.weights).all()
    assert out.weights[0, 3].item() == 1.0 and out.weights[1, 1].item() == 1.0
    assert torch.equal(out.weights, ref.weights)
    assert out.metrics["mismatch/nonfinite_tokens"] == 2.0
    ref.metrics["mismatch/nonfinite_tokens"] = 2.0
    assert out.metrics == pytest.approx(ref.metrics, rel=1e-12)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(2, 4), (0, 4), (3, 0)])
def test_no_valid_tokens_gives_ones_and_zero_metrics(name, shape):
    train = torch.full(shape, NAN)
    out = get_corrector(name)(train, torch.full(shape, -1.0), torch.zeros(shape, dtype=torch.bool), torch.ones(shape[0]))
    assert torch.equal(out.weights, torch.ones(shape))
    assert out.metrics and all(v == 0.0 for v in out.metrics.values()), out.metrics


# ---------------------------------------------------------------- sums gather exactly
@pytest.mark.parametrize("name", ALL)
def test_merged_sums_reproduce_metrics_over_the_whole_batch(name):
    g = torch.Generator().manual_seed(1)
    train = -torch.rand(6, 9, generator=g) * 3
    rollout = train + 0.3 * torch.randn(6, 9, generator=g)
    mask = torch.rand(6, 9, generator=g) > 0.3
    adv = torch.randn(6, generator=g)
    corr = get_corrector(name) if name != "ais" else AISCorrector(gamma=10.0)
    whole = corr(train, rollout, mask, adv)
    parts = [corr(train[i:j], rollout[i:j], mask[i:j], adv[i:j]) for i, j in [(0, 2), (2, 3), (3, 6)]]
    merged = metrics_from_sums(merge_sums(*(p.sums for p in parts)))
    exact = [k for k in whole.metrics if not k.startswith("corrector/alpha")]
    if name in ("none", "is", "tis", "mis"):  # token level: weights do not depend on the split
        assert {k: merged[k] for k in exact} == pytest.approx({k: whole.metrics[k] for k in exact}, rel=1e-9)
    else:  # AIS mixes per batch; the mismatch block still gathers exactly, gates average over parts
        assert {k: merged[k] for k in MISMATCH_METRICS} == pytest.approx(
            {k: whole.metrics[k] for k in MISMATCH_METRICS}, rel=1e-9
        )
        mean_alpha = sum(p.metrics["corrector/alpha"] for p in parts) / 3
        assert merged["corrector/alpha"] == pytest.approx(mean_alpha)
    assert mismatch_metrics(train, rollout, mask) == pytest.approx(
        {k: whole.metrics[k] for k in MISMATCH_METRICS}, rel=1e-12
    )


def test_reduce_ops_are_declared_for_every_sum_key():
    assert not (SUM_KEYS & MAX_KEYS) and not (SUM_KEYS & MIN_KEYS) and not (MAX_KEYS & MIN_KEYS)
    for key in SUM_KEYS:
        assert reduce_op(key) == "sum"
    for key in MAX_KEYS:
        assert reduce_op(key) == "max"
    for key in MIN_KEYS:
        assert reduce_op(key) == "min"
    for name in ALL:
        assert set(run(name).sums) <= SUM_KEYS | MAX_KEYS | MIN_KEYS
    train, rollout, mask, _ = batch()
    assert set(mismatch_sums(train, rollout, mask)) <= SUM_KEYS | MAX_KEYS


def test_merge_sums_rejects_mismatched_keys():
    with pytest.raises(ValueError, match="same keys"):
        merge_sums(run("tis").sums, run("mis").sums)
    with pytest.raises(ValueError, match="at least one"):
        merge_sums()


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)), r"\(2, 3\).*\(2, 4\)"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2)), r"mask \(3, 2\)"),
        ((torch.zeros(6), torch.zeros(6), torch.ones(6)), r"\[B, T\]"),
        ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3)), "floating-point"),
        (([[0.0]], torch.zeros(1, 1), torch.ones(1, 1)), "torch.Tensor"),
    ],
)
def test_bad_shapes_and_types_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        get_corrector("tis")(*args, None)


def test_bad_advantage_shape_names_the_shapes():
    with pytest.raises(ValueError, match=r"advantages.*\(3,\)"):
        get_corrector("ais")(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), torch.zeros(3))


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("tis", {"clip": 0.5}, "clip must be >= 1"),
        ("tis", {"clip": NAN}, "clip"),
        ("tis", {"level": "batch"}, "token.*sequence.*geometric"),
        ("mis", {"low": 2.0, "high": 3.0}, "low <= 1 <= high"),
        ("mis", {"low": -1.0}, "low must be >= 0"),
        ("ais", {"delta": 0.0}, "delta must be > 0"),
        ("ais", {"gamma": -1.0}, "gamma"),
        ("ais", {"beta": -0.1}, "beta"),
        ("ais", {"clip": True}, "number"),
        ("tis", {"clipp": 2.0}, r"unknown parameter.*'clipp'.*allowed.*clip"),
        ("none", {"level": "token"}, "unknown parameter"),
    ],
)
def test_bad_params_raise_value_error(name, params, match):
    with pytest.raises(ValueError, match=match):
        get_corrector(name, **params)


# ---------------------------------------------------------------- registry
def test_get_corrector_resolves_names_and_params():
    assert set(ALL) <= set(available_correctors())
    tis = get_corrector("TIS", clip=3.0, level="sequence")
    assert isinstance(tis, TISCorrector) and tis.clip == 3.0 and tis.level == "sequence"
    ais = get_corrector("ais", clip=2.0, delta=0.1, gamma=0.2, beta=0.5)
    assert (ais.clip, ais.delta, ais.gamma, ais.beta) == (2.0, 0.1, 0.2, 0.5)
    assert get_corrector(None).name == "none"
    assert (get_corrector("mis", low=0.5, high=2.0, level="geometric").level) == "geometric"


def test_unknown_name_lists_registered_names():
    with pytest.raises(ValueError, match=r"unknown corrector 'tiss'.*'ais'.*'tis'"):
        get_corrector("tiss")


def test_instances_pass_through_and_reject_params():
    inst = TISCorrector(clip=4.0)
    assert get_corrector(inst) is inst
    with pytest.raises(ValueError, match="only accepted with a corrector name"):
        get_corrector(inst, clip=2.0)
    with pytest.raises(ValueError, match="instance"):
        get_corrector(TISCorrector)
    with pytest.raises(ValueError, match="Corrector instance"):
        get_corrector(3)


class HalfCorrector(Corrector):
    name = "half"

    def compute_weights(self, batch):
        return torch.full_like(batch.log_ratio, 0.5), {}


@pytest.fixture
def scratch_registry(monkeypatch):
    from jetrl_trainer.correctors import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_register_custom_corrector(scratch_registry):
    register_corrector("half-test", HalfCorrector)
    out = get_corrector("half-test")(*batch())
    assert valid_weights(out) == [0.5] * 7 and out.weights[1, 3].item() == 1.0
    assert out.metrics["corrector/weight_mean"] == 0.5
    assert out.metrics["mismatch/kl_k1"] == pytest.approx(HAND_MISMATCH["mismatch/kl_k1"])
    with pytest.raises(ValueError, match="taken"):
        register_corrector("half-test", TISCorrector)
    register_corrector("half-test", TISCorrector, overwrite=True)
    assert isinstance(get_corrector("half-test"), TISCorrector)
    with pytest.raises(ValueError, match="Corrector subclass"):
        register_corrector("bad", dict)

    @register_corrector("half-deco")
    class Deco(HalfCorrector):
        pass

    assert isinstance(get_corrector("half-deco"), Deco)


# ---------------------------------------------------------------- GPU: no host sync
@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_weights_and_sums_make_no_host_sync_on_cuda(name, level):
    from jetrl_trainer.correctors import metric_tensors_from_sums

    train, rollout, mask, adv = (x.cuda() for x in batch())
    corr = get_corrector(name, **({} if name == "none" else {"level": level}))
    corr(train, rollout, mask, adv)  # warm-up outside the check (lazy CUDA init may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        weights, sums = corr.weights_and_sums(train, rollout, mask, adv)
        tensors = metric_tensors_from_sums(sums)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert weights.is_cuda and all(t.is_cuda for t in tensors.values())
    cpu = corr(*(x.cpu() for x in (train, rollout, mask, adv)))
    torch.testing.assert_close(weights.cpu(), cpu.weights, rtol=1e-6, atol=0)  # GPU exp/sum order differ
    assert {k: t.item() for k, t in tensors.items()} == pytest.approx(cpu.metrics, rel=1e-9, abs=1e-12)


def test_weights_and_sums_matches_call():
    corr = AISCorrector(gamma=0.5)
    weights, sums = corr.weights_and_sums(*batch())
    out = corr(*batch())
    assert torch.equal(weights, out.weights) and metrics_from_sums(sums) == out.metrics
