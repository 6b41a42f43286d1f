"""LLaDA's inline SwiGLU fused with the FP8 quantization of ``ff_out``'s input (CUDA only).

The Qwen3/Llama swap in ``quant/fused.py`` replaces a whole ``mlp`` module; LLaDA has none (its
three projections hang off the block, under their published names), so the block calls a
parameter-free ``LLaDAGatedActivation`` instead, and that calls :func:`fused_swiglu` here. The
kernel, its autograd function and the hand-off to the consuming ``QuantLinear`` are the ones
``quant/fused.py`` uses for Qwen3/Llama, so both layouts run the same bits.

It is used exactly when ``quantize_model`` fused the block's norms (its ``fuse_norms`` default on
CUDA with Triton, ``fuse_norm_quant`` in the trainer config): one switch for both fusions.
"""

from __future__ import annotations

import torch
from torch import nn

from jetrl_trainer.quant._handoff import offer_prequantized
from jetrl_trainer.quant.fused import (  # shared with the Qwen3/Llama swap, not re-implemented
    FusedRMSNorm,
    _fp8_format,
    _SwiGLUQuantFunction,
    _use_kernels,
)

__all__ = ["fused_swiglu"]


def fused_swiglu(gate: torch.Tensor, up: torch.Tensor, block: nn.Module | None) -> torch.Tensor | None:
    """``silu(gate) * up``, carrying its FP8 pair to ``block.ff_out``; ``None`` when it does not apply.

    Applies on CUDA with the Triton kernel, when ``block.ff_norm`` is a ``FusedRMSNorm`` and
    ``block.ff_out`` quantizes to FP8 in its phase. ``gate``/``up``: ``(..., hidden)``.
    """
    if block is None or not isinstance(getattr(block, "ff_norm", None), FusedRMSNorm):
        return None
    fmt = _fp8_format(getattr(block, "ff_out", None))
    if fmt is None or gate.dtype != up.dtype or not _use_kernels(gate, "triton_swiglu"):
        return None
    g2d, u2d = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    h, q, s = _SwiGLUQuantFunction.apply(g2d, u2d, fmt)
    h = h.view(*gate.shape)
    offer_prequantized(h, q, s, fmt)  # ff_out's act quant takes (q, s) instead of quantizing h again
    return h
