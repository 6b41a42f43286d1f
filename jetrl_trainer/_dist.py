"""Tiny cross-process reductions for the trainer's metrics and guard (no-ops on one process)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from jetrl_trainer.correctors import reduce_op

__all__ = ["all_reduce_sums", "any_across_processes", "exit_process"]

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


def exit_process(code: int = 0) -> NoReturn:
    """End a script: ``sys.exit(code)``, except in a gloo process group (CPU training), where every
    rank waits for the others, tears the group down, flushes and leaves without finalizing Python.

    Finalizing races gloo's worker threads: one still releasing a collective's tensors takes the GIL
    during finalization, Python 3.11 unwinds it out of a noexcept destructor, and the rank aborts
    with "terminate called without an active exception" after its work is done and saved
    (docs/distributed.md). ``destroy_process_group`` cannot join those threads while DDP or ZeRO
    still hold the group. NCCL runs finalize normally (atexit hooks, background uploads)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
