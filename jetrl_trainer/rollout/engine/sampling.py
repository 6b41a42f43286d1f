"""Sampling inside the engine: HF's warpers, counter-based noise per row, the sampled token's log-prob.

* **Distribution.** The scores go through the same warpers, in the same order, as
  `SampledLogprobRecorder` sees them under ``generate`` (temperature, top-k, top-p, min-p:
  `sampling_warpers`), so a recorded log-prob means the same in both backends: ``log p`` of the
  sampled token under ``softmax(warped scores)``, the distribution it was drawn from.
* **Noise.** Inverse-CDF sampling: one uniform per row and step, from a counter-based hash of
  (row seed, step) (`jetrl_trainer._hashing`), not a stateful generator, so a row's tokens depend
  on its seed alone, whatever else is in the batch and in whichever slot it runs. The token is the
  first whose FP64 cumulative probability exceeds ``u × total``; tokens the warpers removed have
  probability 0, a zero-width step that is never drawn. One uniform per row (not one per vocabulary
  entry, as Gumbel-max needs) keeps the sampler's cost at a few passes over the ``(B, V)`` scores.
* **Two-level cumulative** (`inverse_cdf_sample`): FP64 sums of blocks of ``CDF_BLOCK`` entries
  and their running total find the block that holds ``u × total``; only that block's entries are
  then accumulated one by one (on CUDA the block sums are a Triton kernel, `kernels/triton_sampling`).
  A full ``(B, V)`` FP64 cumulative sum over a 152k vocabulary measured as costly as the LM head
  (docs/history.md §7). The two levels add in a different order, so a token
  can differ from the one-level sum only where ``u × total`` falls within FP64 rounding of a step edge.
* **Greedy** (``do_sample=False``): the argmax of the raw scores, as ``generate``; its recorded
  log-prob is that of the token under the (unwarped) softmax.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import Tensor
from transformers import GenerationConfig

from jetrl_trainer import kernels
from jetrl_trainer._hashing import M32, mix32
from jetrl_trainer.exact import log_probs, token_logprobs
from jetrl_trainer.rollout.sampling import sampling_warpers

__all__ = ["CDF_BLOCK", "TokenSampler", "inverse_cdf_sample", "unsupported_generation_reason"]

# GenerationConfig fields the engine does not implement, with their neutral values.
_NEUTRAL = MappingProxyType({
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
})


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
            return tokens, token_logprobs(logits, tokens)
        scores = self.warpers(tokens_placeholder(logits), logits)  # these warpers ignore input_ids
        logp = log_probs(scores)  # the training forward's own log-softmax (jetrl_trainer.exact)
        tokens = inverse_cdf_sample(logp.exp(), _uniform(row_seeds, steps))
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


CDF_BLOCK = 1024  # entries per first-level block: (B, V / 1024) block sums, then one (B, 1024) cumulative


def inverse_cdf_sample(probs: Tensor, u: Tensor, block: int = CDF_BLOCK) -> Tensor:
    """``(B,)`` ids: per row, the first entry of ``probs`` ``(B, V)`` whose FP64 cumulative sum
    exceeds ``u × total`` (``u`` ``(B,)`` in (0, 1)), an entry of nonzero probability."""
    rows, vocab = probs.shape
    block_cdf = block_sums(probs, block).cumsum(dim=-1)  # (B, n_blocks)
    target = (u.to(torch.float64) * block_cdf[:, -1])[:, None]  # (B, 1)
    b = torch.searchsorted(block_cdf, target, right=True).clamp(max=block_cdf.shape[1] - 1)  # first block past it
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0.0)  # its start, <= target
    index = b * block + torch.arange(block, device=probs.device)  # (B, block); past V in a ragged last block
    inner = probs.gather(1, index.clamp(max=vocab - 1)).masked_fill(index >= vocab, 0.0)
    return (b * block + pick_in_block(inner, before, target)).squeeze(-1).clamp(max=vocab - 1)


def block_sums(probs: Tensor, block: int) -> Tensor:
    """``(B, ceil(V / block))`` FP64 sums of ``block`` consecutive entries: the Triton kernel on CUDA
    (one read of the FP32 table), else torch over a zero-padded FP64 copy."""
    module = kernels.optional_module("triton_sampling") if probs.is_cuda and kernels.triton_enabled() else None
    if module is not None and probs.dtype == torch.float32 and block & (block - 1) == 0:
        return module.block_sums_fp64(probs, block)
    rows, vocab = probs.shape
    n_blocks = -(-vocab // block)
    padded = torch.nn.functional.pad(probs, (0, n_blocks * block - vocab))  # zeros: never drawn
    return padded.view(rows, n_blocks, block).sum(dim=-1, dtype=torch.float64)


def pick_in_block(inner: Tensor, before: Tensor, target: Tensor) -> Tensor:
    """``(B, 1)`` offsets into ``inner`` ``(B, block)``: the first entry at which ``before`` plus the
    FP64 running sum exceeds ``target``. Where none does (the block's sum, added in another order,
    exceeded ``target`` by a rounding error), the block's last entry of nonzero probability."""
    size = inner.shape[-1]
    offset = torch.searchsorted(before + inner.to(torch.float64).cumsum(dim=-1), target, right=True)
    last_nonzero = size - 1 - (inner > 0).flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)
    return torch.where(offset < size, offset, last_nonzero)


def tokens_placeholder(logits: Tensor) -> Tensor:
    return torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)
