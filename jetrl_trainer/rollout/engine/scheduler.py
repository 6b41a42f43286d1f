"""The generate loop's scheduling: sequences through a fixed number of KV-cache slots.

```
while sequences wait or run:
    start waiting sequences in free slots (their prompt's KV copied in, first token from the prefill logits)
    decode the running slots, one token each; look-ahead queues step t + 1 before step t is read
    a sequence that finished (EOS, or its token budget) frees its slot for a waiting one
```

The scheduler owns the host's bookkeeping; the engine hands it two callables that queue device
work: ``start(started)`` (the new sequences' prompt KV and first tokens, `PrefilledPrompts`) and
``step(slots, tokens, seeds, steps)`` (one decode step). Each row's randomness is a function of its
seed and its step count (`sampling.py`), so which slot a sequence runs in, and next to whom, never
changes its tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from jetrl_trainer._hashing import M32, mix32

if TYPE_CHECKING:
    from .kv_cache import KVCache
    from .sampling import TokenSampler

__all__ = ["PrefilledPrompts", "Seq", "SlotScheduler"]

Batch = list[tuple[int, "Seq"]]  # (slot, sequence) pairs
StepOutput = tuple[Tensor, Tensor]  # (tokens (B,), log-probs (B,)) on the device


@dataclass
class Seq:
    index: int  # place in the request: its RNG stream
    prompt: int  # distinct-prompt id
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class PrefilledPrompts:
    """A call's distinct prompts, prefilled: their KV encoded (FP8: quantized) once for the cache, not
    once per generation, with every layer stacked so that starting a sequence is one copy per tensor
    (`KVCache.store_encoded`); and the logits their first tokens are sampled from."""

    def __init__(self, cache: KVCache, sampler: TokenSampler, lengths: list[int], keys: list[Tensor],
                 values: list[Tensor], first_logits: Tensor) -> None:  # fmt: skip
        self.cache, self.sampler, self.lengths, self.first_logits = cache, sampler, lengths, first_logits
        self.width = keys[0].shape[2]  # the padded prompt length, as the training forward's batch has it
        self.keys, self.values = cache.encode(torch.stack(keys)), cache.encode(torch.stack(values))

    def start(self, started: Batch, step_inputs: Callable[[Batch], Tensor]) -> StepOutput:
        """The started sequences' prompt KV into their slots; their first tokens from the prefill logits."""
        by_prompt: dict[int, list[int]] = {}
        for slot, s in started:
            by_prompt.setdefault(s.prompt, []).append(slot)
        device = self.first_logits.device
        for prompt, slots in by_prompt.items():
            length = self.lengths[prompt]
            self.cache.store_encoded(torch.tensor(slots, device=device), self.keys, self.values, row=prompt,
                                     length=length, pad=self.width - length)  # fmt: skip
        logits = self.first_logits[torch.tensor([s.prompt for _, s in started], device=device)]
        return self.sampler.sample(logits, *step_inputs(started)[2:])


class _HostCopies:
    """Tokens and log-probs of a step copied to the host without waiting for later queued steps:
    a non-blocking copy into one of two pinned buffers, and an event to wait on (CPU: a copy)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        pin = self.cuda and torch.cuda.is_available()
        self.buffers = [torch.empty(2, rows, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self.turn = 0

    def start(self, tokens: Tensor, logps: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        both = torch.stack([tokens.to(torch.float64), logps.to(torch.float64)])
        if not self.cuda:
            return both, None
        host = self.buffers[self.turn][:, : both.shape[1]]
        self.turn ^= 1
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def wait(ticket: tuple[Tensor, torch.cuda.Event | None]) -> Tensor:
        host, event = ticket
        if event is not None:
            event.synchronize()
        return host


class SlotScheduler:
    """``sequences`` through ``num_slots`` slots; ``budgets[i]``: the most tokens sequence ``i`` gets."""

    def __init__(self, sequences: Sequence[Seq], num_slots: int, *, eos: set[int], budgets: Sequence[int],
                 seed: int, device: torch.device) -> None:  # fmt: skip
        self.pending: deque[Seq] = deque(sequences)
        self.running: dict[int, Seq] = {}
        self.free = list(range(num_slots - 1, -1, -1))
        self.eos, self.budgets, self.device = eos, budgets, device
        seed_hash = mix32(torch.tensor(seed & M32, dtype=torch.int64))
        self.row_seed = {s.index: int(mix32(seed_hash ^ s.index)) for s in sequences}
        self.to_host = _HostCopies(num_slots, device)
        self.batch_changes = -1  # the first batch is not a change

    def step_inputs(self, batch: Batch) -> Tensor:
        """(4, B) slots, last tokens, row seeds, steps: one host-to-device copy per batch."""
        rows = [(slot, s.tokens[-1] if s.tokens else 0, self.row_seed[s.index], len(s.tokens)) for slot, s in batch]
        return torch.tensor(rows, dtype=torch.long).t().to(self.device, non_blocking=True)

    def run(self, start: Callable[[Batch], StepOutput], step: Callable[..., StepOutput]) -> None:
        """Until every sequence finished: start waiting ones in free slots, decode the running ones."""
        while self.pending or self.running:
            started = self._fill_free_slots()
            if started:
                self._record(started, self._read(start(started)))
            if self.running:
                self._decode_batch(step)

    def _fill_free_slots(self) -> Batch:
        started = []
        while self.free and self.pending:
            slot, s = self.free.pop(), self.pending.popleft()
            self.running[slot] = s
            started.append((slot, s))
        return started

    def _decode_batch(self, step: Callable[..., StepOutput]) -> None:
        """Decode the running batch until one of its rows finishes. While the batch stays the same, step
        t + 1 is queued from step t's tokens on the device before the host waits for step t, so the
        host's bookkeeping hides behind GPU work; when a row finishes, the step already queued is
        drained (its other rows' tokens count) and the caller rebuilds the batch."""
        batch = sorted(self.running.items())
        self.batch_changes += 1
        slots, last, seeds, steps = self.step_inputs(batch)
        out = step(slots, last, seeds, steps)
        while True:
            ticket = self.to_host.start(*out)
            steps = steps + 1
            ahead = step(slots, out[0], seeds, steps)
            if self._record(batch, self.to_host.wait(ticket)) or not self.running:
                self._record(batch, self._read(ahead))
                return
            out = ahead

    def _read(self, out: StepOutput) -> Tensor:
        return self.to_host.wait(self.to_host.start(*out))

    def _record(self, batch: Batch, both: Tensor) -> bool:
        """Append each row's token and log-prob (rows no longer running are skipped: a look-ahead step
        computed them after they finished); True if a row finished."""
        finished = False
        for (slot, s), t, lp in zip(batch, both[0].long().tolist(), both[1].tolist()):
            if self.running.get(slot) is not s:
                continue
            s.tokens.append(t)
            s.logprobs.append(lp)
            if t in self.eos or len(s.tokens) == self.budgets[s.index]:
                self.running.pop(slot)
                self.free.append(slot)
                finished = True
        return finished
