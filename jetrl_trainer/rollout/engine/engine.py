"""The decode engine: prefill each distinct prompt once, decode running sequences in slots.

```
prompts ─► distinct prompts, one batched prefill (the model's own forward, rollout phase)
        ─► per sequence: its prompt's KV copied into a free slot, first token sampled from the prefill logits
        ─► decode_step over the running slots: one token each; attention reads only live KV
        ─► a finished sequence (EOS or max_new_tokens) frees its slot; a waiting one takes it
```

GRPO samples ``num_generations`` completions per prompt, so prefill runs once per distinct prompt
and its KV is shared by copy. The cache holds ``num_slots`` sequences: all of them unless
``max_batch_size`` (from the KV token budget) is smaller, in which case the rest wait for slots.

On CUDA with Triton, decode attention is the split-KV kernel (`kernels/triton_decode_attention.py`,
reading each row's live KV in place) and the decode step (the layers, the LM head and sampling) is
captured in a CUDA graph per batch-size bucket: the live batch runs in the smallest bucket that
holds it, padded with a scratch slot. Elsewhere the step runs eagerly with SDPA over the live KV.
Graphs and cache live for one `generate` call (or, with ``keep_state``, until a call needs other
ones), and read the FP8 weights in place, so they decode with the weights the training forward uses
at that optimizer step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import DynamicCache, GenerationConfig

from jetrl_trainer._choices import KV_CACHE_DTYPES, check_choice
from jetrl_trainer._hashing import M32, mix32
from jetrl_trainer.quant._handoff import offer_prequantized

from ..hf_generate import left_pad, position_ids_from_mask
from .architecture import DecoderView
from .attention import decode_attention, matched_arithmetic, training_attention_backend
from .graphs import DecodeGraphs, cuda_graphs_available
from .kv_cache import KVCache
from .projections import GroupedSplitSums
from .sampling import TokenSampler, unsupported_generation_reason

__all__ = ["DecodeEngine"]


@dataclass
class _Sequence:
    index: int  # place in the request: its RNG stream
    prompt: int  # distinct-prompt id
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


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


@dataclass
class _KeptState:
    """What ``keep_state`` carries from one ``generate`` call to the next."""

    cache: KVCache
    graphs: DecodeGraphs | None
    sampler: TokenSampler
    key: tuple  # (slots, sampling settings): a call with another key rebuilds
    read: tuple[int, ...]  # data pointers of every tensor the graphs read in place (weights, FP8 caches)


def _module_ids(model: nn.Module) -> tuple[int, ...]:
    """Identity of a model's module tree: a swapped module (fused, merged, re-wrapped) changes it."""
    return tuple(id(m) for m in model.modules())


def _sampling_key(config: GenerationConfig) -> tuple:
    return (config.do_sample, config.temperature, config.top_k, config.top_p, config.min_p)


class DecodeEngine:
    """Generates completions and their sampling log-probs with a model's own modules.

    ``keep_state=True`` keeps the KV cache and the captured CUDA graphs after a call, so the next
    call with the same number of slots and sampling settings reuses them instead of capturing again
    (the cache is sized up to a multiple of ``KEEP_LENGTH_MULTIPLE`` so that small changes in the
    longest prompt fit). The graphs read the weights in place, and the FP8 weight caches refresh in
    place after an optimizer step (the prefill refreshes them before any replay), so a reused graph
    decodes with the current weights; if any tensor they read was reallocated instead (a recipe
    changed, a module swapped), the state is rebuilt. The price is that memory (cache and graph
    pool) held between rollouts: :meth:`release_state` frees it.
    """

    KEEP_LENGTH_MULTIPLE = 128

    def __init__(
        self, model: nn.Module, *, max_batch_size: int | None = None, cuda_graphs: bool | None = None,
        kv_cache_dtype: str = "auto", keep_state: bool = False,
    ) -> None:  # fmt: skip
        self.view = DecoderView.from_model(model)
        self.modules = _module_ids(model)  # the module tree the view was read from
        self.keep_state = keep_state
        self._kept: _KeptState | None = None
        self.max_batch_size = max_batch_size
        self.kv_fp8 = check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES) == "fp8"
        self.cuda_graphs = cuda_graphs_available(self.view.device) if cuda_graphs is None else cuda_graphs
        # Keyword arguments of the Triton decode attention (splits, block_n, flash_order): the tile size
        # and order that reproduce the training forward's SDPA kernel (attention.py); benchmarks change them.
        self.training_attention = None
        self.attention_options: dict = {}
        if self.view.device.type == "cuda":
            v = self.view
            self.training_attention = training_attention_backend(v.num_heads, v.num_kv_heads, v.head_dim, v.dtype,
                                                                 v.device)  # fmt: skip
            self.attention_options = matched_arithmetic(self.training_attention)
        # Queue step t + 1 before waiting for step t (see generate); False waits after every step (benchmarks).
        self.look_ahead = True
        # q/k/v and gate/up as one FP8 decode launch each in the kernel path (projections.py); False
        # calls the modules one by one (benchmarks).
        self.grouped_projections = True
        # In the kernel path, each residual add and the o / down projections' split-K reductions run
        # inside the next fused RMSNorm, and the attention kernel writes the o projection's FP8
        # activation (residual.py; the same bits); False runs them as separate launches (benchmarks, tests).
        self.fused_epilogues = True
        # In the kernel path, the grouped q/k/v launch leaves its split-K sums to the RoPE + KV-append
        # launch, which reduces them (kernels/triton_rope_append.rope_append_from_partials; the same
        # bits): one launch fewer per layer wherever K is split. H200, 8B shape, batch 64 (run 46): the
        # step replays in 5.044 against 5.106 ms; False runs the GEMM's own reduction (benchmarks, tests).
        self.fused_qkv_reduce = True
        # The last generate call: wall seconds, the host's prefill seconds, the seconds spent capturing
        # CUDA graphs, how many were captured, how often the running batch changed, and the KV cache's bytes.
        self.last_stats: dict = {}

    @torch.no_grad()
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], config: GenerationConfig, *, eos_token_ids: Sequence[int],
        seed: int, pad_token_id: int = 0, row_budgets: Sequence[int] | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
        """One completion per prompt (stopped after its first EOS, kept) and per-token log-probs.

        The prompts are left-padded as the trainer pads them for its training forward (TRL: to the
        longest prompt, rounded up to ``pad_to_multiple_of``): the prefill runs on that batch, and the
        decode attention lines its tiles up with the training forward's over those padded rows.

        ``row_budgets`` (benchmarks, tests) stops sequence ``i`` after ``row_budgets[i]`` tokens, as
        an EOS there would: variable-length rollouts on a random model that never emits EOS.
        """
        reason = unsupported_generation_reason(config)
        if reason is not None:
            raise ValueError(f"the decode engine cannot honour this GenerationConfig: {reason}.")
        started_at = time.perf_counter()
        distinct: dict[tuple[int, ...], int] = {}
        seqs = [_Sequence(i, distinct.setdefault(tuple(p), len(distinct))) for i, p in enumerate(prompt_ids)]
        prompts = list(distinct)
        store_k, store_v, first_logits = self.prefill(prompts, pad_token_id, pad_to_multiple_of)
        width = store_k[0].shape[2]  # the padded prompt length, as the training forward's batch has it
        prefilled_at = time.perf_counter()  # the host's side: the GPU may still be prefilling
        slots = min(len(seqs), self.max_batch_size or len(seqs))
        v = self.view
        max_len = max(map(len, prompts)) + config.max_new_tokens
        key = (slots, _sampling_key(config))
        kept = self._reusable(key, max_len)
        if kept is not None:
            cache, graphs, sampler = kept.cache, kept.graphs, kept.sampler
            cache.lengths.zero_()
        else:
            if self.keep_state:
                max_len = -(-max_len // self.KEEP_LENGTH_MULTIPLE) * self.KEEP_LENGTH_MULTIPLE
            cache = KVCache(
                num_layers=len(v.layers), num_slots=slots + self.cuda_graphs,  # + the graphs' scratch slot
                max_len=max_len, num_kv_heads=v.num_kv_heads,
                head_dim=v.head_dim, dtype=v.dtype, device=v.device, fp8=self.kv_fp8,
            )  # fmt: skip
            sampler = TokenSampler(config)
            graphs = DecodeGraphs(self, cache, sampler, max_rows=slots) if self.cuda_graphs else None
        captured_before = graphs.capture_seconds if graphs is not None else 0.0
        # Encode (FP8: quantize) each distinct prompt's KV once, not once per generation; all layers
        # stacked, so a sequence's start is one copy per tensor (KVCache.store_encoded).
        encoded_k, encoded_v = cache.encode(torch.stack(store_k)), cache.encode(torch.stack(store_v))
        del store_k, store_v
        eos = set(eos_token_ids)
        seed_hash = mix32(torch.tensor(seed & M32, dtype=torch.int64))
        row_seed = {s.index: int(mix32(seed_hash ^ s.index)) for s in seqs}
        pending, running, free = deque(seqs), {}, list(range(slots - 1, -1, -1))
        budget = [min(config.max_new_tokens, b) for b in row_budgets] if row_budgets else [config.max_new_tokens] * len(seqs)

        def step_inputs(batch: list[tuple[int, _Sequence]]) -> Tensor:
            """(4, B) slots, last tokens, row seeds, steps: one host-to-device copy per batch."""
            rows = [(slot, s.tokens[-1] if s.tokens else 0, row_seed[s.index], len(s.tokens)) for slot, s in batch]
            return torch.tensor(rows, dtype=torch.long).t().to(v.device, non_blocking=True)

        def launch(slots_t: Tensor, last: Tensor, seeds: Tensor, steps: Tensor) -> tuple[Tensor, Tensor]:
            """One decode step, queued on the device (the host does not wait for it)."""
            if graphs is not None:
                return graphs.step(slots_t, last, seeds, steps)
            return sampler.sample(self.decode_step(cache, slots_t, last), seeds, steps)

        def record(batch: list[tuple[int, _Sequence]], both: Tensor) -> bool:
            """Append each row's token and log-prob (rows no longer running are skipped: a
            look-ahead step computed them after they finished); True if a row finished."""
            finished = False
            for (slot, s), t, lp in zip(batch, both[0].long().tolist(), both[1].tolist()):
                if running.get(slot) is not s:
                    continue
                s.tokens.append(t)
                s.logprobs.append(lp)
                if t in eos or len(s.tokens) == budget[s.index]:
                    running.pop(slot)
                    free.append(slot)
                    finished = True
            return finished

        to_host = _HostCopies(slots, v.device)
        batch_changes = -1  # the first batch is not a change
        while pending or running:
            started = []
            while free and pending:
                slot, s = free.pop(), pending.popleft()
                running[slot] = s
                started.append((slot, s))
            by_prompt: dict[int, list[int]] = {}
            for slot, s in started:
                by_prompt.setdefault(s.prompt, []).append(slot)
            for prompt, prompt_slots in by_prompt.items():
                slot_index = torch.tensor(prompt_slots, device=v.device)
                length = len(prompts[prompt])
                cache.store_encoded(slot_index, encoded_k, encoded_v, row=prompt, length=length, pad=width - length)
            if started:  # first token from the prefill logits of each one's prompt
                logits = first_logits[torch.tensor([s.prompt for _, s in started], device=v.device)]
                record(started, to_host.wait(to_host.start(*sampler.sample(logits, *step_inputs(started)[2:]))))
            if not running:
                continue
            # While the batch stays the same, step t + 1 is queued from step t's tokens on the device
            # before the host waits for step t, so the host's bookkeeping hides behind GPU work. When
            # a row finishes, the step already queued is drained (its other rows' tokens count) and
            # the batch is rebuilt with the freed slots refilled.
            batch = sorted(running.items())
            batch_changes += 1
            slots_t, last, seeds, steps = step_inputs(batch)
            out = launch(slots_t, last, seeds, steps)
            while True:
                ticket = to_host.start(*out)
                if not self.look_ahead:
                    record(batch, to_host.wait(ticket))
                    break
                steps = steps + 1
                ahead = launch(slots_t, out[0], seeds, steps)
                if record(batch, to_host.wait(ticket)) or not running:
                    record(batch, to_host.wait(to_host.start(*ahead)))
                    break
                out = ahead
        if self.keep_state:
            self._kept = _KeptState(cache, graphs, sampler, key, self._read_in_place())
        self.last_stats = dict(
            seconds=time.perf_counter() - started_at, prefill_host_seconds=prefilled_at - started_at,
            capture_seconds=(graphs.capture_seconds - captured_before) if graphs is not None else 0.0,
            graphs_captured=len(graphs.buckets) if graphs is not None else 0, batch_changes=batch_changes,
            reused_state=kept is not None, kv_cache_bytes=cache.nbytes,
        )  # fmt: skip
        return [s.tokens for s in seqs], [s.logprobs for s in seqs]

    def release_state(self) -> None:
        """Free what ``keep_state`` kept (the KV cache and the CUDA graphs)."""
        self._kept = None

    def _reusable(self, key: tuple, max_len: int) -> _KeptState | None:
        """The kept state if this call can run on it (called after the prefill, which refreshed the
        FP8 weight caches), else None, with the old state freed before a new one is allocated."""
        kept, self._kept = self._kept, None
        if kept is None or not self.keep_state:
            return None
        if kept.key != key or kept.cache.max_len < max_len or kept.read != self._read_in_place():
            return None
        return kept

    def _read_in_place(self) -> tuple[int, ...]:
        from jetrl_trainer.quant.linear import QuantLinear

        pointers = [p.data_ptr() for p in self.view.model.parameters()]
        for module in self.view.model.modules():
            if isinstance(module, QuantLinear):
                pointers += [t.data_ptr() for t in module.cached_weight_tensors()]
        return tuple(pointers)

    def prefill(
        self, prompts: list[tuple[int, ...]], pad_token_id: int, pad_to_multiple_of: int | None = None
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Keys/values per layer ``(N, H_kv, P, D)`` of the left-padded distinct prompts, and the
        FP32 logits ``(N, V)`` at each prompt's last token.

        The model's own forward, as ``generate``'s prefill calls it: transformers builds the mask and
        picks the attention kernel, so a prompt's KV and first-token logits are the bits the training
        forward computes for the same prompt (on the H200 an engine-owned masked prefill measured
        0.19 mean |Δlogp| on the first token of the 8B-shaped model, against 0.0 for this call)."""
        v = self.view
        ids, mask = left_pad(prompts, pad_token_id, pad_to_multiple_of)
        ids, mask = ids.to(v.device), mask.to(v.device)
        positions = position_ids_from_mask(mask)  # as generate's prepare_inputs
        cache = DynamicCache()
        out = v.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                      use_cache=True, logits_to_keep=1)  # fmt: skip
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        return keys, values, out.logits[:, -1].float()

    def decode_step(self, cache: KVCache, slots: Tensor, tokens: Tensor, *, kernel: bool = False) -> Tensor:
        """Feed each row ``tokens[b]`` at the end of slot ``slots[b]``; FP32 logits ``(B, V)`` for the next one.

        ``kernel=True`` (CUDA graphs) runs the Triton kernels, which read ``lengths`` on the device:
        RoPE with the KV append in one launch (the same bits as the model's eager RoPE; with the
        FP8 recipe's fused Qwen3 q/k norms, those norms too), then the split-KV attention. Otherwise the model's RoPE, an indexed append and SDPA over the live prefix.
        """
        v = self.view
        positions = cache.lengths[slots][:, None]
        lengths = cache.lengths[slots] + 1
        pads = cache.pads[slots] if kernel else None

        def attend(layer: int, q: Tensor, k: Tensor, val: Tensor) -> Tensor:
            cache.append(layer, slots, k[:, :, 0], val[:, :, 0])
            out = decode_attention(q[:, :, 0], *cache.read(layer, slots), lengths, v.scaling)
            return out[:, :, None]

        def attend_kernels(layer: int, q: Tensor, k: Tensor, val: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            from jetrl_trainer.kernels.triton_decode_attention import decode_attention as attention_kernel
            from jetrl_trainer.kernels.triton_rope_append import rope_append, rope_append_from_partials

            k_cache, v_cache = cache.k[layer], cache.v[layer]
            scales = dict(k_scale=cache.k_scale[layer], v_scale=cache.v_scale[layer]) if cache.fp8 else {}
            norms = v.qk_norms[layer] if v.qk_norms else None
            if isinstance(q, GroupedSplitSums):  # q/k/v unreduced: the reduction runs in the RoPE launch
                q = rope_append_from_partials(q.parts, v.num_heads, cos[:, 0], sin[:, 0], k_cache, v_cache, slots,
                                              positions[:, 0], biases=q.biases, qk_norms=norms, **scales)  # fmt: skip
            else:
                q = rope_append(q[:, 0], k[:, 0], val[:, 0], cos[:, 0], sin[:, 0], k_cache, v_cache, slots,
                                positions[:, 0], qk_norms=norms, **scales)  # fmt: skip
            o_proj = v.o_groups[layer] if self.fused_epilogues and v.o_groups else None
            fmt = o_proj.input_scale_format() if o_proj is not None and q.shape[-1] == 128 else None
            # pads: tiles on the training forward's boundaries over the padded rows
            options = dict(scales, pads=pads, **self.attention_options)
            if fmt is None:
                out = attention_kernel(q, k_cache, v_cache, slots, lengths, v.scaling, **options)
                return out[:, :, None]
            # The o projection's 1x128 activation quant, written by the attention kernel (one group per head).
            out, out_q, out_s = attention_kernel(q, k_cache, v_cache, slots, lengths, v.scaling, quantize_output=fmt,
                                                 **options)  # fmt: skip
            flat = out.view(out.shape[0], 1, -1)  # (B, 1, H * D), the tensor o_proj receives
            offer_prequantized(flat, out_q, out_s, fmt)
            return flat

        if kernel:
            hidden = v.hidden_states(tokens[:, None], positions, attend_kernels, rope_in_attend=True,
                                     grouped=self.grouped_projections, fused_residual=self.fused_epilogues,
                                     fused_qkv=self.fused_qkv_reduce)  # fmt: skip
        else:
            hidden = v.hidden_states(tokens[:, None], positions, attend)
        cache.lengths[slots] = lengths
        return v.logits(hidden[:, -1])
