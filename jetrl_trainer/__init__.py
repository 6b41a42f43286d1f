"""jetrl-trainer: GRPO for LLMs in low precision, built on TRL.

Heavy imports (trl, transformers) are deferred so that ``import jetrl_trainer.quant`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "PrecisionPhases": "jetrl_trainer.quant.phase",
    "WeightCacheRefresh": "jetrl_trainer.quant.refresh",
    "quantize_model": "jetrl_trainer.quant.convert",
    "dequantize_model": "jetrl_trainer.quant.convert",
    "JetGRPOConfig": "jetrl_trainer.config",
    "JetGRPOTrainer": "jetrl_trainer.trainer",
    "exit_process": "jetrl_trainer._dist",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jetrl_trainer' has no attribute {name!r}")
