"""Rollout backends: completions and their sampling log-probs (the rollout half of a GRPO step).

A backend is ``generate(model, prompt_ids, sampling) -> Rollout`` (`RolloutBackend`), chosen with
``JetGRPOConfig.rollout_backend``:

* `HFGenerateBackend` (``"hf"``) — transformers ``generate``; log-probs recorded by
  `SampledLogprobRecorder` under the distribution actually sampled from.
* `ContinuousBatchingBackend` (``"continuous"``) — transformers continuous batching; log-probs from
  its engine.
* `VLLMBackend` (``"vllm"``) — TRL's vLLM generation and weight sync (colocate or server); the
  processed log-probs come from vLLM (`jetrl_trainer.rollout.vllm_backend`, docs/vllm.md).
* ``"diffusion"`` — the LLaDA sampler, `jetrl_trainer.diffusion.rollout.DiffusionBackend`.

Each runs the model in its own precision phase; the trainer calls it inside its
``precision_phases.rollout()`` block (`jetrl_trainer.quant.PrecisionPhases`).
`processed_logprobs` is the teacher-forced counterpart of the recorder (the trainer's fallback when
a backend records nothing, and the tests' check).
"""

from .base import ROLLOUT_BACKENDS, Rollout, RolloutBackend
from .continuous import ContinuousBatchingBackend, generate_batch_with_logprobs
from .hf_generate import HFGenerateBackend, left_pad, position_ids_from_mask, truncate_after_eos
from .sampling import SampledLogprobRecorder, processed_logprobs, sampling_warpers, split_sampling_config
from .vllm_backend import VLLMBackend, VLLMSampling

__all__ = [
    "ROLLOUT_BACKENDS",
    "ContinuousBatchingBackend",
    "HFGenerateBackend",
    "Rollout",
    "RolloutBackend",
    "SampledLogprobRecorder",
    "generate_batch_with_logprobs",
    "left_pad",
    "position_ids_from_mask",
    "processed_logprobs",
    "sampling_warpers",
    "split_sampling_config",
    "truncate_after_eos",
    "VLLMBackend",
    "VLLMSampling",
]
