"""The training forward's per-token log-probs under the exact contract.

TRL computes them inside the model (``fused_lm_head``: the LM head and the log-softmax fused, in the
model's dtype), which is not what the sampler computes. Here the model returns its logits, as the
engine's prefill and decode steps do, and the log-probs come from `ops.token_logprobs` on the FP32
logits: the function the engine's sampler calls. The forward runs under `ExactOps`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .mode import ExactOps, KVRoundtrip
from .ops import token_logprobs

__all__ = ["training_logprobs"]


def training_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, *, temperature: float,
    batch_size: int | None = None, compute_entropy: bool = False,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    kv_roundtrip: KVRoundtrip | None = None,
) -> tuple[Tensor, Tensor | None, None]:  # fmt: skip
    """TRL's ``_get_per_token_logps_and_entropies`` contract, ``(logps, entropies, None)`` ``(B, T)``:
    the log-probs of the last ``logits_to_keep`` tokens, ``batch_size`` rows per forward; the attention
    reads keys and values through ``kv_roundtrip`` (the rollout cache's, `ExactOps`)."""
    from trl.trainer.utils import entropy_from_logits  # TRL's, as its own log-prob path computes it

    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    with ExactOps.entered(True, kv_roundtrip):
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with autocast():
                # Position p predicts token p + 1: keep the logits that predict the completion.
                logits = model(input_ids=input_ids[rows], attention_mask=attention_mask[rows],
                               logits_to_keep=logits_to_keep + 1).logits[:, :-1]  # fmt: skip
            logits = logits.float()
            logps.append(token_logprobs(logits, input_ids[rows, -logits_to_keep:], temperature))
            if compute_entropy:  # with grad: TRL's entropy bonus differentiates it
                entropies.append(entropy_from_logits(logits / temperature))
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None
