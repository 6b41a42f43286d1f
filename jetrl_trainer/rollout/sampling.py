"""Log-probs of sampled tokens under the distribution they were actually sampled from.

`transformers.generate` samples from ``softmax(processors(logits))``, where the processors include
the sampling warpers (temperature, top-k, top-p, min-p). A custom ``logits_processor`` passed to
``generate`` is merged *before* those warpers, so it would see the distribution before temperature
and truncation. We therefore move the four warpers out of the `GenerationConfig` into an explicit
processor list, in the order transformers uses, and end the list with `SampledLogprobRecorder`.
The recorder sees exactly the scores the sampler draws from; no processor runs after it in a
sampling setup (watermarking and ``renormalize_logits`` excepted, which we refuse / which do not
change the distribution).

The recorder works one step late: at step t it learns the token sampled at step t-1 (the last
column of ``input_ids``) and picks its log-prob from the log-softmax it kept. Only one ``[B, V]``
row of log-probs is held at a time, never the whole ``[B, T, V]`` score history that
``output_scores=True`` would keep.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__all__ = ["SampledLogprobRecorder", "processed_logprobs", "sampling_warpers", "split_sampling_config"]

# Warpers transformers would add that the split below does not reproduce: refuse rather than record
# log-probs of a distribution other than the one sampled from.
_UNSUPPORTED = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


class SampledLogprobRecorder(LogitsProcessor):
    """Last processor of the list: records ``log p(sampled token)`` under the processed scores.

    Call :meth:`finish` with the generated sequences after ``generate`` returns; it returns a
    ``[B, T_new]`` float32 tensor and resets the recorder for the next call.
    """

    def __init__(self) -> None:
        self._prev: Tensor | None = None  # (B, V) log-softmax of the last processed scores
        self._steps: list[Tensor] = []  # one (B,) tensor per decided step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._prev is not None:  # the previous step's token is now the last column
            self._steps.append(self._prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def covers(self, num_new_tokens: int) -> bool:
        """Whether every one of ``num_new_tokens`` sampled tokens passed through this recorder.

        False when something called ``generate`` without running the processors it was handed
        (a stub or wrapper of ``generate``); the caller then scores the tokens another way.
        """
        return len(self._steps) + (self._prev is not None) >= num_new_tokens

    def reset(self) -> None:
        self._prev, self._steps = None, []

    def finish(self, sequences: Tensor, num_new_tokens: int) -> Tensor:
        """Log-probs ``[B, num_new_tokens]`` of the last ``num_new_tokens`` columns of ``sequences``."""
        steps = self._steps
        if self._prev is not None and len(steps) < num_new_tokens:
            steps = [*steps, self._prev.gather(-1, sequences[:, -1:]).squeeze(-1)]
        self.reset()
        if len(steps) < num_new_tokens:
            raise RuntimeError(
                f"recorded {len(steps)} sampling steps but generate returned {num_new_tokens} new tokens; was the "
                "recorder the last logits processor of this generate call?"
            )
        if not steps:
            return torch.zeros(sequences.shape[0], 0, dtype=torch.float32, device=sequences.device)
        # Deferred stop checks may run one step more than they keep: drop the extra.
        return torch.stack(steps[:num_new_tokens], dim=1)


def sampling_warpers(
    *, temperature: float | None = 1.0, top_k: int | None = 0, top_p: float | None = 1.0, min_p: float | None = None
) -> LogitsProcessorList:
    """The warpers transformers applies for these settings, in its order (temperature, top-k, top-p, min-p)."""
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    return warpers


def split_sampling_config(generation_config: GenerationConfig) -> tuple[GenerationConfig, LogitsProcessorList]:
    """A copy of ``generation_config`` with neutral warpers, and the warpers as an explicit list.

    Neutral values are set explicitly (``top_k=0``, not ``None``): ``generate`` fills ``None`` from the
    model's generation config and then from global defaults (``top_k=50``).
    """
    if not generation_config.do_sample:
        raise ValueError("sampling log-probs need do_sample=True in the generation config")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("sampling log-probs are only defined for num_beams=1 (no beam search)")
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(generation_config, name, None)
        if value is not None and value != neutral:
            raise ValueError(
                f"generation_config.{name}={value!r} is not supported with recorded sampling log-probs; only "
                "temperature, top_k, top_p and min_p are. Unset it (generation_kwargs)."
            )
    if getattr(generation_config, "watermarking_config", None) is not None:
        raise ValueError("watermarking changes the sampled distribution after all processors; unset it")
    warpers = sampling_warpers(
        temperature=generation_config.temperature,
        top_k=generation_config.top_k,
        top_p=generation_config.top_p,
        min_p=generation_config.min_p,
    )
    stripped = copy.deepcopy(generation_config)
    stripped.temperature, stripped.top_k, stripped.top_p, stripped.min_p = 1.0, 0, 1.0, None
    return stripped, warpers


def processed_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = 0,
    top_p: float | None = 1.0,
    min_p: float | None = None,
) -> Tensor:
    """Teacher-forced counterpart of the recorder: ``log p(tokens)`` under the warped distribution.

    ``logits`` ``(B, T, V)`` predict ``tokens`` ``(B, T)``. Warpers act per row, so rows are
    flattened and warped as ``generate`` warps one decoding step (repetition penalty and other
    context-dependent processors are not reproduced).
    """
    b, t, v = logits.shape
    warpers = sampling_warpers(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    scores = logits.reshape(b * t, v).float()
    dummy_ids = tokens.reshape(b * t, 1)  # warpers above ignore input_ids
    scores = warpers(dummy_ids, scores)
    return torch.log_softmax(scores, dim=-1).gather(-1, dummy_ids).reshape(b, t)
