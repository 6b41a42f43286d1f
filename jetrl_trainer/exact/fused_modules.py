"""The Llama / Qwen2 / Qwen3 RMSNorm modules and RoPE under `ExactOps`: one fused launch each.

A torch function mode sees a module's ops one at a time, never the module, so under the mode the
RMSNorm's cast, squares, mean, ``rsqrt`` and products each launch a kernel (nine per norm on CUDA, four
norms per Qwen3 layer), and ``apply_rotary_pos_emb``'s products, ``rotate_half`` and sum about five per
rotated tensor, in every decode step. `ExactOps.entered` therefore installs, once per process, a
wrapper on those three RMSNorm classes' ``forward`` and on the three modeling modules'
``apply_rotary_pos_emb``: inside the mode, where the fused kernel runs (`ops.rms_norm`, `ops.rotary`),
it computes the output in one launch; otherwise, and outside the mode, the original runs. Both phases
of the contract enter the mode, so both take the same path and a row gets the same bits in each.

The attention modules call ``apply_rotary_pos_emb`` as a global of their modeling module, so the
wrapper replaces that module attribute; whoever else calls it (the decode engine) must look it up at
call time too, or it keeps the function it found first (`rollout/engine/architecture.py`). Other norm
classes keep their own forward (their means still run `row_mean`).
"""

from __future__ import annotations

import functools
import importlib

from .ops import rms_norm, rotary

__all__ = ["install_fused_modules"]

_MODELING = ("transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
             "transformers.models.qwen3.modeling_qwen3")  # fmt: skip
_NORMS = tuple(zip(_MODELING, ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")))
_installed = False


def install_fused_modules() -> None:
    """Wrap the three norm classes' ``forward`` and the three modules' ``apply_rotary_pos_emb``
    (idempotent; each wrapper is a no-op outside `ExactOps`)."""
    global _installed
    if _installed:
        return
    for module_name, class_name in _NORMS:
        cls = getattr(_modeling(module_name), class_name, None)
        if cls is not None and not getattr(cls.forward, "_jetrl_fused_norm", False):
            cls.forward = _fused_forward(cls.forward)
    for module_name in _MODELING:
        module = _modeling(module_name)
        rope = getattr(module, "apply_rotary_pos_emb", None)
        if rope is not None and not getattr(rope, "_jetrl_fused_rope", False):
            module.apply_rotary_pos_emb = _fused_rope(rope)
    _installed = True


def _modeling(module_name: str):
    """The modeling module, or None in an older transformers without that model (nothing to wrap)."""
    try:
        return importlib.import_module(module_name)
    except ImportError:
        return None


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


def _fused_rope(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        from .mode import ExactOps

        if ExactOps.active():
            out = rotary(q, k, cos, sin, unsqueeze_dim)
            if out is not None:
                return out
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._jetrl_fused_rope = True
    return apply_rotary_pos_emb
