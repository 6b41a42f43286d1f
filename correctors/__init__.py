"""Off-policy correctors (IS, TIS, MIS, AIS) and mismatch metrics. Pure tensor math; torch only.

    corrector = get_corrector("tis", clip=2.0, level="token")
    out = corrector(train_logps, rollout_logps, mask, advantages)   # -> Correction
    per_token_loss = per_token_loss * out.weights                    # weights: (B, T) float32

Sync-free: ``weights, sums = corrector.weights_and_sums(...)``.
Across processes: reduce ``out.sums`` key by key with :func:`reduce_op` (``*_max`` → max, ``*_min``
→ min, the rest → sum) and call :func:`metrics_from_sums` for exact global metrics.
See docs/correctors.md for formulas, defaults and metric names.
"""

from .ais import AISCorrector
from .base import Correction, Corrector
from .inputs import PreparedBatch
from .is_family import ISCorrector, MISCorrector, NoCorrector, TISCorrector
from .metrics import (
    MAX_KEYS,
    MIN_KEYS,
    MISMATCH_METRICS,
    SUM_KEYS,
    merge_sums,
    metric_tensors_from_sums,
    metrics_from_sums,
    mismatch_metrics,
    mismatch_sums,
    reduce_op,
)
from .ratios import LEVELS, MAX_LOG_RATIO
from .registry import available_correctors, get_corrector, register_corrector

__all__ = [
    "Correction",
    "Corrector",
    "PreparedBatch",
    "NoCorrector",
    "ISCorrector",
    "TISCorrector",
    "MISCorrector",
    "AISCorrector",
    "get_corrector",
    "register_corrector",
    "available_correctors",
    "mismatch_metrics",
    "mismatch_sums",
    "metrics_from_sums",
    "metric_tensors_from_sums",
    "merge_sums",
    "reduce_op",
    "SUM_KEYS",
    "MAX_KEYS",
    "MIN_KEYS",
    "MISMATCH_METRICS",
    "LEVELS",
    "MAX_LOG_RATIO",
]
