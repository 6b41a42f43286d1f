"""Sampling inside the engine: HF's warpers, counter-based noise per row, the sampled token's log-prob.

* **Distribution.** The scores go through the same warpers, in the same order, as
  `SampledLogprobRecorder` sees them under ``generate`` (temperature, top-k, top-p, min-p:
  `sampling_warpers`), so a recorded log-prob means the same in both backends: ``log p`` of the
  sampled token under ``softmax(warped scores)``, the distribution it was drawn from.
* **Noise.** Gumbel-max over that distribution, ``argmax(log p + g)``, with ``g`` computed from a
  counter-based hash of (row seed, step, vocabulary index) (`jetrl_trainer._hashing`), not a
  stateful generator: a row's tokens depend on its seed alone, whatever else is in the batch and
  in whichever slot it runs. Tokens the warpers removed have ``log p = -inf`` and are never drawn.
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


def _uniform(row_seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """``(B, V)`` uniforms in (0, 1) from hashed row seeds ``(B,)`` and per-row step counters ``(B,)``."""
    index = torch.arange(vocab_size, device=row_seeds.device, dtype=torch.int64)
    bits = mix32(mix32(row_seeds[:, None] ^ (steps[:, None] & M32)) ^ index[None, :])
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in FP32, never 0 or 1


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
        gumbel = -torch.log(-torch.log(_uniform(row_seeds, steps, logits.shape[-1])))
        tokens = (logp + gumbel).argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def tokens_placeholder(logits: Tensor) -> Tensor:
    return torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)
