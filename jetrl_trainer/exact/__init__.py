"""Exact on-policy log-probs: the rollout's recorded log-probs are the training forward's, bit for bit.

`ExactOps` (a torch function mode) runs the policy's linears, matmuls and attention through the
batch-invariant ops of `ops.py`; the engine and the trainer open it around both phases.
docs/architecture.md#exact-on-policy states the contract and what breaks it.
"""

from .forward import training_logprobs
from .mode import ExactOps, exact_sdpa
from .ops import (
    KV_TILE,
    ROWS,
    exact_attention,
    exact_linear,
    log_probs,
    row_invariant_matmul,
    row_mean,
    straight_through,
    token_logprobs,
)

__all__ = [
    "KV_TILE",
    "ROWS",
    "ExactOps",
    "exact_attention",
    "exact_linear",
    "exact_sdpa",
    "log_probs",
    "row_invariant_matmul",
    "row_mean",
    "straight_through",
    "token_logprobs",
    "training_logprobs",
]
