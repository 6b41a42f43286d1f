"""An activation that carries its own FP8 quantization, from the op that produced it to its consumers.

A fused kernel (RMSNorm + quant, SwiGLU + quant, the decode attention's output quant) writes an
activation *and* its 1×128 FP8 quantization in one pass. :func:`offer_prequantized` stores the pair
on the activation itself; ``quant/_dispatch.act_quant_fp8`` asks :func:`take_prequantized` before
quantizing, and serves the pair instead. Nothing is global: the pair lives exactly as long as the
activation, and no other tensor can see it.

The pair is stored on the tensor that owns the activation's memory (the producer's output, or the
base it is a view of), so the 2-D view a consumer flattens it to (``x.reshape(-1, K)``) finds it
through ``._base``. It is served only to a view of that whole activation (same first element, same
size, same row length, contiguous), while the activation's version counter is unchanged (an in-place
write drops it) and for the scale format it was made with. Two cases carry nothing, and the consumer
quantizes again: inference tensors (``torch.inference_mode``), which have no version counter to
notice an in-place write by, and tracing under ``torch.compile`` (an attribute set on a tensor is a
side effect; inside the graph the compiler may fuse the two ops itself). Either way the bits are
those of the hand-off: the kernels' ``(q, s)`` equal ``quantize_fp8_groups`` of their output
(kernel tests check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["offer_prequantized", "take_prequantized"]

Pair = tuple[torch.Tensor, torch.Tensor]
_ATTRIBUTE = "_jetrl_fp8_quantization"


@dataclass(frozen=True)
class _Carried:
    data_ptr: int
    numel: int
    row: int  # K: the length of the quantized rows
    version: int
    scale_format: str
    pair: Pair


def _owner(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def offer_prequantized(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor, scale_format: str) -> None:
    """Store on ``y`` that ``(q, s)`` is its 1×128 FP8 quantization (``y`` as ``[-1, K]`` rows)."""
    if torch.compiler.is_compiling() or y.is_inference():
        return
    carried = _Carried(y.data_ptr(), y.numel(), y.shape[-1], y._version, scale_format, (q, s))
    setattr(_owner(y), _ATTRIBUTE, carried)


def take_prequantized(x2d: torch.Tensor, scale_format: str) -> Optional[Pair]:
    """The pair offered for the activation ``x2d [M, K]`` is (a view of), or None: quantize as usual."""
    if torch.compiler.is_compiling() or x2d.is_inference() or x2d.dim() != 2 or not x2d.is_contiguous():
        return None
    carried: Optional[_Carried] = getattr(_owner(x2d), _ATTRIBUTE, None)
    if carried is None or carried.scale_format != scale_format or carried.version != x2d._version:
        return None
    if (carried.data_ptr, carried.numel, carried.row) != (x2d.data_ptr(), x2d.numel(), x2d.shape[1]):
        return None
    return carried.pair
