"""Mismatch metrics, built from additive sufficient statistics so they gather exactly.

Conventions (samples are drawn from the rollout policy μ; π is the training policy):

* ``log r = train_logps − rollout_logps`` per valid token, ``r = exp(log r)``.
* ``mismatch/logp_abs_diff_mean`` / ``_max`` — mean / max of ``|log r|``.
* ``mismatch/kl_k1 = mean(−log r)`` and ``mismatch/kl_k3 = mean(r − 1 − log r)``: Schulman's k1
  and k3 estimators of **KL(rollout ‖ train)** = E_μ[log μ/π]. k1 is unbiased but can be
  negative; k3 is unbiased (E_μ[r] = 1) and never negative. Both are token means, not sums
  per sequence.
* ``mismatch/ppl_ratio = PPL_train / PPL_rollout = exp(mean(rollout − train)) = exp(k1)`` with
  ``PPL_π = exp(−mean log π(sampled token))``. Above 1: the trainer finds the sampled text less
  likely than the sampler did.
* ``mismatch/ess_ratio = (Σ r)² / (n Σ r²)`` in (0, 1], the effective sample size of the
  token-level ratios over n tokens (independent of the corrector's level). r is capped as in
  :data:`~jetrl_trainer.correctors.ratios.MAX_LOG_RATIO`.
* ``mismatch/nonfinite_tokens`` — masked-in tokens with a NaN/Inf log-prob (excluded above).
* ``mismatch/logp_bits_equal_share`` — the share of valid tokens whose two log-probs are equal
  (``log r`` exactly 0): 1 under the exact on-policy contract (``exact_logprobs``).

Every figure is a function of the sums in :func:`mismatch_sums` (and the corrector's own sums),
so a trainer running on several processes reduces the sums — each key by :func:`reduce_op`:
keys ending in ``_max`` by max, ``_min`` by min, all others by sum — and calls
:func:`metrics_from_sums` to get exactly the figure over all ranks' tokens. With no valid token
every metric is 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from .inputs import PreparedBatch, prepare_batch
from .ratios import ratio_from_log

__all__ = [
    "SUM_KEYS",
    "MAX_KEYS",
    "MIN_KEYS",
    "MISMATCH_METRICS",
    "reduce_op",
    "merge_sums",
    "batch_mismatch_sums",
    "mismatch_sums",
    "mismatch_metrics",
    "metric_tensors_from_sums",
    "metrics_from_sums",
    "to_floats",
]

# Every sum key the built-in correctors emit, by the reduction it needs. ``reduce_op`` applies
# the same rule to any key (also a custom corrector's) from its suffix.
SUM_KEYS = frozenset({
    "n_tokens", "nonfinite_tokens", "equal_tokens", "abs_diff_sum", "log_ratio_sum", "k3_sum", "ratio_sum",
    "ratio_sq_sum", "weight_sum", "clipped_tokens", "masked_tokens",
    "n_batches", "alpha_sum", "alpha_ess_sum", "alpha_mis_sum", "alpha_var_sum",
})  # fmt: skip
MAX_KEYS = frozenset({"abs_diff_max", "weight_max"})
MIN_KEYS = frozenset({"weight_min"})

MISMATCH_METRICS = (
    "mismatch/logp_abs_diff_mean",
    "mismatch/logp_abs_diff_max",
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/ppl_ratio",
    "mismatch/ess_ratio",
    "mismatch/nonfinite_tokens",
    "mismatch/logp_bits_equal_share",
)

# The corrector's per-batch gates are averaged over batches (one batch per process per call).
_ALPHA_METRICS = {
    "corrector/alpha": "alpha_sum",
    "corrector/alpha_ess": "alpha_ess_sum",
    "corrector/alpha_mis": "alpha_mis_sum",
    "corrector/alpha_var": "alpha_var_sum",
}


def reduce_op(key: str) -> Literal["sum", "max", "min"]:
    """How ``key`` combines across batches/processes: ``*_max`` → max, ``*_min`` → min, else sum."""
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    return "sum"


def merge_sums(*sums: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Combine the sums of several batches (e.g. gradient-accumulation micro-batches)."""
    if not sums:
        raise ValueError("merge_sums needs at least one dict of sums")
    keys = set(sums[0])
    if any(set(s) != keys for s in sums):
        raise ValueError(f"all sums must have the same keys; got {[sorted(s) for s in sums]}")
    ops = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
    out = dict(sums[0])
    for s in sums[1:]:
        out = {k: ops[reduce_op(k)](out[k], s[k]) for k in keys}
    return out


def _masked_max(x: Tensor, valid: Tensor, empty: float) -> Tensor:
    """Max of ``x`` over ``valid`` (``empty`` when none) without a host sync."""
    fill = torch.full((), empty, dtype=x.dtype, device=x.device)
    if x.numel() == 0:  # amax of an empty tensor raises; the shape is known on the host
        return fill
    return torch.where(valid, x, fill).amax().maximum(fill)


def batch_mismatch_sums(batch: PreparedBatch) -> dict[str, Tensor]:
    """The mismatch sums of an already prepared batch (0-d tensors, stat dtype)."""
    lr, valid = batch.log_ratio, batch.valid  # lr is 0 at invalid tokens
    v = valid.to(lr.dtype)
    ratio = ratio_from_log(lr)
    abs_diff = lr.abs()
    return {
        "n_tokens": v.sum(),
        "nonfinite_tokens": batch.nonfinite.to(lr.dtype).sum(),
        "equal_tokens": (valid & (lr == 0)).to(lr.dtype).sum(),
        "abs_diff_sum": abs_diff.sum(),
        "abs_diff_max": _masked_max(abs_diff, valid, 0.0),
        "log_ratio_sum": lr.sum(),
        # expm1(x) − x = r − 1 − log r without cancellation near x = 0; 0 at invalid tokens.
        "k3_sum": (torch.expm1(lr) - lr).sum(),
        "ratio_sum": (ratio * v).sum(),
        "ratio_sq_sum": (ratio.square() * v).sum(),
    }


def mismatch_sums(train_logps: Tensor, rollout_logps: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Additive sufficient statistics of the mismatch block (0-d tensors, no host sync).

    Keys: ``n_tokens``, ``nonfinite_tokens``, ``equal_tokens``, ``abs_diff_sum``, ``abs_diff_max``,
    ``log_ratio_sum``, ``k3_sum``, ``ratio_sum``, ``ratio_sq_sum``. Reduce each across processes
    with :func:`reduce_op` (``abs_diff_max`` by max, the rest by sum), then call
    :func:`metrics_from_sums`.
    """
    return batch_mismatch_sums(prepare_batch(train_logps, rollout_logps, mask))


def _per_token(total: Tensor, n: Tensor) -> Tensor:
    return torch.where(n > 0, total / n.clamp_min(1), torch.zeros_like(total))


def _corrector_tensors(sums: Mapping[str, Tensor], n: Tensor) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    zero = torch.zeros_like(n)
    if "weight_sum" in sums:
        out["corrector/weight_mean"] = _per_token(sums["weight_sum"], n)
        out["corrector/weight_min"] = torch.where(n > 0, sums["weight_min"], zero)
        out["corrector/weight_max"] = torch.where(n > 0, sums["weight_max"], zero)
    for name, key in (("corrector/clipped_frac", "clipped_tokens"), ("corrector/masked_frac", "masked_tokens")):
        if key in sums:
            out[name] = _per_token(sums[key], n)
    if "n_batches" in sums:
        batches = sums["n_batches"]
        for name, key in _ALPHA_METRICS.items():
            out[name] = _per_token(sums[key], batches)
    return out


def metric_tensors_from_sums(sums: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Metrics as 0-d tensors on the sums' device (no host sync); see :func:`metrics_from_sums`."""
    n = sums["n_tokens"]
    has = n > 0
    zero = torch.zeros_like(n)
    k1 = _per_token(-sums["log_ratio_sum"], n)
    r_sum, r_sq = sums["ratio_sum"], sums["ratio_sq_sum"]
    out = {
        "mismatch/logp_abs_diff_mean": _per_token(sums["abs_diff_sum"], n),
        "mismatch/logp_abs_diff_max": torch.where(has, sums["abs_diff_max"], zero),
        "mismatch/kl_k1": k1,
        "mismatch/kl_k3": _per_token(sums["k3_sum"], n),
        "mismatch/ppl_ratio": torch.where(has, torch.exp(k1), zero),
        "mismatch/ess_ratio": torch.where(
            has & (r_sq > 0), r_sum.square() / (n * r_sq).clamp_min(torch.finfo(n.dtype).tiny), zero
        ),
        "mismatch/nonfinite_tokens": sums["nonfinite_tokens"].to(n.dtype),
        "mismatch/logp_bits_equal_share": _per_token(sums["equal_tokens"], n),
    }
    out.update(_corrector_tensors(sums, n))
    return out


def to_floats(tensors: Mapping[str, Tensor]) -> dict[str, float]:
    """0-d tensors → floats with a single host sync (one stacked ``tolist``)."""
    if not tensors:
        return {}
    values = torch.stack([t.detach().reshape(()) for t in tensors.values()]).tolist()
    return dict(zip(tensors, values))


def metrics_from_sums(sums: Mapping[str, Tensor]) -> dict[str, float]:
    """Metrics (floats) from sums, possibly reduced across processes with :func:`reduce_op`.

    Always returns the mismatch block; adds ``corrector/weight_*`` when ``weight_sum`` is present,
    ``corrector/clipped_frac`` / ``masked_frac`` from ``clipped_tokens`` / ``masked_tokens``, and
    the AIS gates (averaged over ``n_batches``) when ``n_batches`` is present.
    """
    return to_floats(metric_tensors_from_sums(sums))


def mismatch_metrics(train_logps: Tensor, rollout_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """The mismatch block (names in :data:`MISMATCH_METRICS`) of one batch, as floats."""
    return metrics_from_sums(mismatch_sums(train_logps, rollout_logps, mask))
