"""The hand-off of an activation's FP8 quantization from the op that produced it to its consumers.

A fused kernel (RMSNorm + quant, SwiGLU + quant) writes an activation *and* its 1×128 FP8
quantization in one pass. It offers the pair here; ``quant/_dispatch.act_quant_fp8`` takes it
instead of quantizing again. Entries are keyed by the activation's storage and version and live
only as long as the activation, so a stale or mutated tensor is never served.

Under ``torch.compile`` both ends are no-ops: the table is a side effect keyed by data pointers,
which dynamo cannot trace, so a traced consumer quantizes again (the same bits, and inside the
graph the compiler may fuse the two).
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

__all__ = ["offer_prequantized", "take_prequantized"]

Pair = tuple[torch.Tensor, torch.Tensor]
_local = threading.local()


def _table() -> dict:
    if not hasattr(_local, "table"):
        _local.table = {}
    return _local.table


def offer_prequantized(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor, scale_format: str) -> None:
    """Record that ``(q, s)`` is the 1×128 FP8 quantization of ``y`` (as ``[-1, K]`` rows)."""
    if torch.compiler.is_compiling():
        return
    table, key = _table(), y.data_ptr()
    # The entry dies with y: its storage can be reused only after y is gone.
    ref = weakref.ref(y, lambda _r, key=key, table=table: table.pop(key, None))
    table[key] = (ref, y._version, y.shape[-1], y.numel(), scale_format, (q, s))


def take_prequantized(x2d: torch.Tensor, scale_format: str) -> Optional[Pair]:
    """The pair offered for the activation ``x2d`` views, or None (then quantize as usual)."""
    if torch.compiler.is_compiling():
        return None
    entry = _table().get(x2d.data_ptr()) if x2d.dim() == 2 and x2d.is_contiguous() else None
    if entry is None:
        return None
    ref, version, k, numel, fmt, pair = entry
    y = ref()
    if y is None or y._version != version or fmt != scale_format or x2d.shape[1] != k or x2d.numel() != numel:
        return None
    return pair
