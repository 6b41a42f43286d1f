"""Tiny cross-process reductions for the trainer's metrics and guard (no-ops on one process)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from jetrl_trainer.correctors import reduce_op

__all__ = ["all_reduce_sums", "any_across_processes"]

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sums(sums: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Reduce corrector/mismatch sums over processes, each key by `reduce_op` (sum, max or min).

    Every process must pass the same keys (one corrector per run). One collective per reduction
    kind, on a stacked vector, rather than one per key.
    """
    out = {k: v.reshape(()) for k, v in sums.items()}
    if not _distributed():
        return out
    for kind, op_name in _OPS.items():
        keys = sorted(k for k in out if reduce_op(k) == kind)
        if keys:
            flat = torch.stack([out[k] for k in keys])
            dist.all_reduce(flat, op=getattr(dist.ReduceOp, op_name))
            out.update(zip(keys, flat.unbind()))
    return out


def any_across_processes(flag: bool, device: torch.device | str = "cpu") -> bool:
    """``flag`` OR-ed over all processes."""
    if not _distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)
