"""Sampling inside the engine: HF's warpers, counter-based noise per row, the sampled token's log-prob.

* **Distribution.** The scores go through the same warpers, in the same order, as
  `SampledLogprobRecorder` sees them under ``generate`` (temperature, top-k, top-p, min-p:
  `sampling_warpers`), so a recorded log-prob means the same in both backends: ``log p`` of the
  sampled token under ``softmax(warped scores)``, the distribution it was drawn from.
* **Noise.** Inverse-CDF sampling: one uniform per row and step, from a counter-based hash of
  (row seed, step) (`jetrl_trainer._hashing`), not a stateful generator, so a row's tokens depend
  on its seed alone, whatever else is in the batch and in whichever slot it runs. The token is the
  first whose FP64 cumulative probability exceeds it; tokens the warpers removed have probability
  0, a zero-width step that is never drawn. One uniform per row (not one per vocabulary entry, as
  Gumbel-max needs) keeps the sampler's cost at a few passes over the ``(B, V)`` scores.
* **Greedy** (``do_sample=False``): the argmax of the raw scores, as ``generate``; its recorded
  log-prob is that of the token under the (unwarped) softmax.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import GenerationConfig

from jetrl_trainer._hashing import M32, mix32
from jetrl_trainer.rollout.sampling import sampling_warpers

__all__ = ["TokenSampler", "unsupported_generation_reason"]

# GenerationConfig fields the engine does not implement, with their neutral values.
_NEUTRAL = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "min_new_tokens": None,
    "min_length": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "watermarking_config": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
}


def unsupported_generation_reason(config: GenerationConfig) -> str | None:
    """Why the engine cannot honour ``config`` exactly (then the backend falls back), or None."""
    for name, neutral in _NEUTRAL.items():
        value = getattr(config, name, neutral)
        if value not in (neutral, None) and not (name == "min_length" and value == 0):
            return f"generation option {name}={value!r} is not implemented by the engine"
    if config.max_new_tokens is None:
        return "the engine needs max_new_tokens (max_length alone counts the prompt)"
    return None


def _uniform(row_seeds: Tensor, steps: Tensor) -> Tensor:
    """One uniform in (0, 1) per row ``(B,)``, float64, from hashed row seeds and per-row step counters."""
    bits = mix32(mix32(row_seeds ^ (steps & M32)) ^ 0x9E3779B9)
    return (bits.to(torch.float64) + 0.5) * (1.0 / (1 << 32))


class TokenSampler:
    """``sample(logits, row_seeds, steps) -> (tokens, logprobs)`` for one ``GenerationConfig``."""

    def __init__(self, config: GenerationConfig) -> None:
        self.greedy = not config.do_sample
        self.warpers = None if self.greedy else sampling_warpers(
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, min_p=config.min_p
        )  # fmt: skip

    def sample(self, logits: Tensor, row_seeds: Tensor, steps: Tensor) -> tuple[Tensor, Tensor]:
        """``logits`` ``(B, V)`` FP32; ``row_seeds`` / ``steps`` ``(B,)`` int64. Returns ``(B,)`` ids and log-probs."""
        if self.greedy:
            tokens = logits.argmax(dim=-1)
            return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        scores = self.warpers(tokens_placeholder(logits), logits)  # these warpers ignore input_ids
        logp = torch.log_softmax(scores, dim=-1)
        cdf = logp.exp().to(torch.float64).cumsum(dim=-1)  # (B, V); removed tokens add zero-width steps
        u = _uniform(row_seeds, steps) * cdf[:, -1]
        tokens = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def tokens_placeholder(logits: Tensor) -> Tensor:
    return torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)
