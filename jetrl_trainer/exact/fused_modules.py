"""The Llama / Qwen2 / Qwen3 RMSNorm modules under `ExactOps`: one fused launch instead of nine.

A torch function mode sees a module's ops one at a time, never the module, so under the mode the
RMSNorm's cast, squares, mean, ``rsqrt`` and products each launch a kernel (nine per norm on CUDA, four
norms per Qwen3 layer, in every decode step). `ExactOps.entered` therefore installs this forward on those
three classes, once per process: inside the mode, where the fused kernel runs (`ops.rms_norm`), it
computes the module's output in one launch; otherwise, and outside the mode, the class's own forward
runs. Both phases of the contract enter the mode, so both take the same path and a row gets the same
bits in each. Other norm classes keep their own forward (their means still run `row_mean`).
"""

from __future__ import annotations

import functools
import importlib

from .ops import rms_norm

__all__ = ["install_fused_norms"]

_CLASSES = (
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
)
_installed = False


def install_fused_norms() -> None:
    """Wrap the three classes' ``forward`` (idempotent; a no-op outside `ExactOps`)."""
    global _installed
    if _installed:
        return
    for module_name, class_name in _CLASSES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # an older transformers without that model: nothing to wrap
            continue
        if not getattr(cls.forward, "_jetrl_fused_norm", False):
            cls.forward = _fused_forward(cls.forward)
    _installed = True


def _fused_forward(original):
    @functools.wraps(original)
    def forward(self, hidden_states):
        from .mode import ExactOps  # the mode installs these wrappers: imported here, not at module load

        if ExactOps.active():
            out = rms_norm(hidden_states, self.weight, self.variance_epsilon)
            if out is not None:
                return out
        return original(self, hidden_states)

    forward._jetrl_fused_norm = True
    return forward
