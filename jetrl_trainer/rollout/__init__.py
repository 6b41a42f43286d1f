"""Producing completions and their sampling log-probs (the rollout half of a GRPO step).

* `generate_with_logprobs` — transformers ``generate`` (TRL's default path), log-probs recorded by
  `SampledLogprobRecorder` under the distribution actually sampled from.
* `generate_batch_with_logprobs` — transformers continuous batching
  (``use_transformers_continuous_batching=True``), log-probs from the engine.
* `processed_logprobs` — the teacher-forced counterpart, for checks.

Both run in the active precision phase; the trainer wraps them in ``precision_phase("rollout")``.
vLLM is not covered: it would not run our quantized modules.
"""

from .continuous import generate_batch_with_logprobs, phase_around_forward
from .hf_generate import generate_with_logprobs, left_pad, truncate_after_eos
from .sampling import SampledLogprobRecorder, processed_logprobs, sampling_warpers, split_sampling_config

__all__ = [
    "SampledLogprobRecorder",
    "generate_batch_with_logprobs",
    "generate_with_logprobs",
    "left_pad",
    "phase_around_forward",
    "processed_logprobs",
    "sampling_warpers",
    "split_sampling_config",
    "truncate_after_eos",
]
