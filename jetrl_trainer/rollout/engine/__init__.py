"""The decode engine (``rollout_backend="engine"``): fast rollouts on the policy's own modules.

* `DecodeEngine` — prefill once per distinct prompt, slot-based decode, sampling with per-row
  counter-based noise, log-probs under the distribution sampled from; built with `EngineSettings`,
  which fix how it decodes, and reporting its per-layer plan (`DecodePlan`, `LayerPlan`).
* `EngineBackend` — the rollout backend around it; falls back to ``hf`` (logged once) for a model
  or a generation option the engine does not support.
"""

from .architecture import SUPPORTED_MODEL_TYPES, DecoderView, unsupported_model_reason
from .backend import EngineBackend
from .engine import DecodeEngine
from .kv_cache import fp8_kv_roundtrip, kv_roundtrip
from .plan import DecodePlan, LayerPlan
from .sampling import TokenSampler, unsupported_generation_reason
from .settings import EngineSettings

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DecodeEngine",
    "DecodePlan",
    "DecoderView",
    "EngineBackend",
    "EngineSettings",
    "LayerPlan",
    "TokenSampler",
    "fp8_kv_roundtrip",
    "kv_roundtrip",
    "unsupported_generation_reason",
    "unsupported_model_reason",
]
