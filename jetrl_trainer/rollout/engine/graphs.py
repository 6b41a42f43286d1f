"""CUDA graphs of the engine's decode step, one per batch-size bucket.

A replay launches a whole step (every layer's kernels, the LM head, the warpers and the sampler)
with no Python in between, which is what makes small-batch FP8 decode cheaper than BF16: eager,
the host time of a `QuantLinear` call exceeds its GEMM at these shapes (docs/performance.md).

Buckets are 1, 2, 4, ... up to the number of slots (and that number itself). A step with ``n``
running rows runs in the smallest bucket ``>= n``; the extra rows point at a scratch slot (the
cache's last), whose length is reset before every replay, so they never touch a real sequence.
Inputs are copied into the bucket's static tensors, outputs read from its static outputs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from jetrl_trainer.kernels import triton_available

from .kv_cache import KVCache
from .sampling import TokenSampler

if TYPE_CHECKING:
    from .engine import DecodeEngine

__all__ = ["DecodeGraphs", "cuda_graphs_available"]


def cuda_graphs_available(device: torch.device) -> bool:
    """Graphs need CUDA and the Triton attention kernel (SDPA over the live prefix syncs the host)."""
    return device.type == "cuda" and triton_available()


def _buckets(max_rows: int) -> list[int]:
    sizes = [1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows]
    return [*sizes, max_rows]


class _Bucket:
    def __init__(self, rows: int, device: torch.device) -> None:
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.long, device=device)
        self.steps = torch.zeros(rows, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[Tensor, Tensor] | None = None


class DecodeGraphs:
    """``step(slots, tokens, seeds, steps) -> (next tokens, log-probs)``, replayed from a captured graph."""

    def __init__(self, engine: DecodeEngine, cache: KVCache, sampler: TokenSampler, *, max_rows: int) -> None:
        self.engine, self.cache, self.sampler = engine, cache, sampler
        self.scratch = cache.k.shape[1] - 1
        self.sizes = _buckets(max_rows)
        self.buckets: dict[int, _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_seconds = 0.0  # host time in _capture (warm-up step, capture, instantiation)

    def _run(self, b: _Bucket) -> tuple[Tensor, Tensor]:
        self.cache.lengths[self.scratch :].zero_()  # a device fill: no host copy inside the capture
        logits = self.engine.decode_step(self.cache, b.slots, b.tokens)
        return self.sampler.sample(logits, b.seeds, b.steps)

    def _capture(self, rows: int) -> _Bucket:
        b = _Bucket(rows, self.cache.k.device)
        b.slots.fill_(self.scratch)
        saved = self.cache.lengths.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (Triton compiles, allocators settle) off the capture
            self._run(b)
        torch.cuda.current_stream().wait_stream(stream)
        b.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.graph, pool=self.pool):
            b.out = self._run(b)
        self.cache.lengths.copy_(saved)  # capture ran the step on the scratch slot only; undo its length
        return b

    def step(self, slots: Tensor, tokens: Tensor, seeds: Tensor, steps: Tensor) -> tuple[Tensor, Tensor]:
        n = slots.shape[0]
        rows = next(size for size in self.sizes if size >= n)
        b = self.buckets.get(rows)
        if b is None:
            began = time.perf_counter()
            b = self.buckets[rows] = self._capture(rows)
            self.capture_seconds += time.perf_counter() - began
        b.slots.fill_(self.scratch)
        b.slots[:n], b.tokens[:n], b.seeds[:n], b.steps[:n] = slots, tokens, seeds, steps
        b.graph.replay()
        return b.out[0][:n], b.out[1][:n]
