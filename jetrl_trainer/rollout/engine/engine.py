"""The decode engine: prefill each distinct prompt once, decode running sequences in slots.

```
prompts ─► distinct prompts, one batched prefill (the model's own forward, rollout phase)
        ─► per sequence: its prompt's KV copied into a free slot, first token sampled from the prefill logits
        ─► decode_step over the running slots: one token each; attention reads only live KV
        ─► a finished sequence (EOS or max_new_tokens) frees its slot; a waiting one takes it
```

GRPO samples ``num_generations`` completions per prompt, so prefill runs once per distinct prompt
and its KV is shared by copy. The cache holds one slot per sequence, or a call's ``max_batch_size``
(from the KV token budget) if smaller, in which case the rest wait for slots (`scheduler.py`).

How a step runs is fixed when the engine is built (`EngineSettings`, and the per-layer plan of
`plan.py`). On CUDA with Triton the step runs the engine's kernels (RoPE + KV append, the split-KV
attention over each row's live KV in place, grouped FP8 GEMMs, fused epilogues) and is captured in
a CUDA graph per batch-size bucket (`graphs.py`): the live batch runs in the smallest bucket that
holds it, padded with a scratch slot. Elsewhere the step runs the model's modules with SDPA over the
live KV. Graphs and cache live for one `generate` call (or, with ``keep_state``, until a call needs
other ones), and read the FP8 weights in place, so they decode with the weights the training
forward uses at that optimizer step.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache, GenerationConfig

from jetrl_trainer._choices import KV_CACHE_DTYPES, check_choice
from jetrl_trainer.exact import ExactOps

from ..hf_generate import left_pad, position_ids_from_mask
from .architecture import DecoderView
from .attention import DecodeRows, KernelAttention, TorchAttention, matched_arithmetic, training_attention_backend
from .graphs import DecodeGraphs, cuda_graphs_available
from .kv_cache import KVCache, kv_roundtrip
from .layers import decode_hidden_states
from .plan import plan_decode
from .sampling import TokenSampler, unsupported_generation_reason
from .scheduler import PrefilledPrompts, Seq, SlotScheduler
from .settings import EngineSettings

__all__ = ["DecodeEngine"]


@dataclass
class _DecodeState:
    """A call's KV cache, CUDA graphs and sampler; what ``keep_state`` carries to the next call."""

    cache: KVCache
    graphs: DecodeGraphs | None
    sampler: TokenSampler
    key: tuple  # (slots, sampling settings): a call with another key rebuilds
    read: tuple[int, ...] = ()  # data pointers of every tensor the graphs read in place (weights, FP8 caches)


def _module_ids(model: nn.Module) -> tuple[int, ...]:
    """Identity of a model's module tree: a swapped module (fused, merged, re-wrapped) changes it."""
    return tuple(id(m) for m in model.modules())


def _sampling_key(config: GenerationConfig) -> tuple:
    return (config.do_sample, config.temperature, config.top_k, config.top_p, config.min_p)


def _cache_argument(model: nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` from transformers 5.24 on (``past_key_values``
    warns there, and goes in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _decode_path(settings: EngineSettings, device: torch.device) -> str:
    available = cuda_graphs_available(device)
    if settings.exact:  # the model's modules under the exact ops; captured where CUDA graphs run
        if settings.decode_path == "torch_graphs" and not available:
            raise ValueError(f"decode_path='torch_graphs' captures CUDA graphs, which need CUDA and Triton (the model "
                             f"is on {device}); use decode_path='torch' or leave it None.")  # fmt: skip
        return settings.decode_path or ("torch_graphs" if available else "torch")
    if settings.decode_path is None:
        return "graphs" if available else "torch"
    if settings.decode_path != "torch" and not available:
        raise ValueError(f"decode_path={settings.decode_path!r} runs the engine's Triton kernels, which need CUDA and "
                         f"Triton (the model is on {device}); use decode_path='torch' or leave it None.")  # fmt: skip
    return settings.decode_path


class DecodeEngine:
    """Generates completions and their sampling log-probs with a model's own modules.

    ``settings`` fix how the engine decodes (`EngineSettings`; the unset ``decode_path`` resolved for
    the model's device); ``plan`` is the per-layer plan they give for this model, reported with every
    call's ``last_stats``.

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
        self, model: nn.Module, *, settings: EngineSettings = EngineSettings(), kv_cache_dtype: str = "auto",
        keep_state: bool = False,
    ) -> None:  # fmt: skip
        self.view = DecoderView.from_model(model)
        self.modules = _module_ids(model)  # the module tree the view was read from
        self.settings = dataclasses.replace(settings, decode_path=_decode_path(settings, self.view.device))
        self.on_kernels = self.settings.decode_path in ("graphs", "kernels")
        self.plan = plan_decode(self.view, self.on_kernels)
        self.kv_cache_dtype = check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        self.kv_fp8 = self.kv_cache_dtype == "fp8"
        self.keep_state = keep_state
        self._kept: _DecodeState | None = None
        # The SDPA backend of the training forward's attention, and the decode kernel's tile size and
        # order that reproduce it (attention.py), unless the settings name another backend's.
        self.training_attention = None
        if self.view.device.type == "cuda":
            v = self.view
            self.training_attention = training_attention_backend(v.num_heads, v.num_kv_heads, v.head_dim, v.dtype,
                                                                 v.device)  # fmt: skip
        self.attention_arithmetic = matched_arithmetic(self.settings.attention_order or self.training_attention)
        # The last generate call: wall seconds, the host's prefill seconds, the seconds spent capturing
        # CUDA graphs, how many were captured, how often the running batch changed, the KV cache's bytes,
        # the decode path and the layer plans (`DecodePlan.summary`).
        self.last_stats: dict = {}

    @torch.no_grad()
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], config: GenerationConfig, *, eos_token_ids: Sequence[int],
        seed: int, pad_token_id: int = 0, max_batch_size: int | None = None, row_budgets: Sequence[int] | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
        """One completion per prompt (stopped after its first EOS, kept) and per-token log-probs.

        At most ``max_batch_size`` sequences decode at once (None: all); the others wait for a slot.

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
        seqs = [Seq(i, distinct.setdefault(tuple(p), len(distinct))) for i, p in enumerate(prompt_ids)]
        # The prefill and every decode step; the prefill's attention reads keys and values as the cache will.
        with ExactOps.entered(self.settings.exact, kv_roundtrip(self.kv_cache_dtype)):
            keys, values, first_logits = self.prefill(list(distinct), pad_token_id, pad_to_multiple_of)
            prefilled_at = time.perf_counter()  # the host's side: the GPU may still be prefilling
            slots = min(len(seqs), max_batch_size or len(seqs))
            max_len = max(map(len, distinct)) + config.max_new_tokens
            # The prefill's keys and values, held without rounding: under autocast keys come out FP32 (RoPE
            # promotes them) and values BF16, and a later decode step writes the same dtypes.
            kv_dtype = torch.promote_types(keys[0].dtype, values[0].dtype)
            state, reused = self._decode_state((slots, _sampling_key(config), kv_dtype), max_len, config)
            captured_before = state.graphs.capture_seconds if state.graphs is not None else 0.0
            prompts = PrefilledPrompts(state.cache, state.sampler, [len(p) for p in distinct], keys, values,
                                       first_logits)  # fmt: skip
            del keys, values
            budgets = [min(config.max_new_tokens, b) for b in row_budgets or [config.max_new_tokens] * len(seqs)]
            scheduler = SlotScheduler(seqs, slots, eos=set(eos_token_ids), budgets=budgets, seed=seed,
                                      device=self.view.device)  # fmt: skip
            scheduler.run(lambda started: prompts.start(started, scheduler.step_inputs),
                          lambda *inputs: self._step(state, *inputs))  # fmt: skip
        if self.keep_state:
            self._kept = dataclasses.replace(state, read=self._read_in_place())
        graphs = state.graphs
        self.last_stats = dict(
            seconds=time.perf_counter() - started_at, prefill_host_seconds=prefilled_at - started_at,
            capture_seconds=(graphs.capture_seconds - captured_before) if graphs is not None else 0.0,
            graphs_captured=len(graphs.buckets) if graphs is not None else 0, batch_changes=scheduler.batch_changes,
            reused_state=reused, kv_cache_bytes=state.cache.nbytes, decode_path=self.settings.decode_path,
            layer_plans=self.plan.summary(),
        )  # fmt: skip
        return [s.tokens for s in seqs], [s.logprobs for s in seqs]

    def _step(self, state: _DecodeState, slots: Tensor, tokens: Tensor, seeds: Tensor,
              steps: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
        """One decode step and its sampling, queued on the device (the host does not wait for it)."""
        if state.graphs is not None:
            return state.graphs.step(slots, tokens, seeds, steps)
        if self.on_kernels:  # the kernels index slots and tokens as contiguous vectors (graphs copy them so)
            slots, tokens = slots.contiguous(), tokens.contiguous()
        return state.sampler.sample(self.decode_step(state.cache, slots, tokens), seeds, steps)

    def release_state(self) -> None:
        """Free what ``keep_state`` kept (the KV cache and the CUDA graphs)."""
        self._kept = None

    def _decode_state(self, key: tuple, max_len: int, config: GenerationConfig) -> tuple[_DecodeState, bool]:
        """The kept state if this call can run on it (called after the prefill, which refreshed the
        FP8 weight caches), else a new one, allocated after the old one is freed; and whether it was kept."""
        kept, self._kept = self._kept, None
        if kept is not None and self.keep_state and kept.key == key and kept.cache.max_len >= max_len \
                and kept.read == self._read_in_place():  # fmt: skip
            kept.cache.lengths.zero_()
            return kept, True
        del kept
        if self.keep_state:
            max_len = -(-max_len // self.KEEP_LENGTH_MULTIPLE) * self.KEEP_LENGTH_MULTIPLE
        v, slots, graphed = self.view, key[0], self.settings.decode_path in ("graphs", "torch_graphs")
        cache = KVCache(
            num_layers=len(v.layers), num_slots=slots + graphed,  # + the graphs' scratch slot
            max_len=max_len, num_kv_heads=v.num_kv_heads, head_dim=v.head_dim, dtype=key[2], device=v.device,
            fp8=self.kv_fp8,
        )  # fmt: skip
        sampler = TokenSampler(config)
        graphs = DecodeGraphs(self, cache, sampler, max_rows=slots) if graphed else None
        return _DecodeState(cache, graphs, sampler, key), False

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

        The model's own forward, as ``generate``'s prefill calls it (under ``exact``, in chunks of
        ``EngineSettings.prefill_chunk`` positions, with the same bits): transformers builds the mask and
        picks the attention kernel, so a prompt's KV and first-token logits are the bits the training
        forward computes for the same prompt (an engine-owned masked prefill measured further from
        the training forward on the first token; docs/history.md §7)."""
        v = self.view
        ids, mask = left_pad(prompts, pad_token_id, pad_to_multiple_of)
        ids, mask = ids.to(v.device), mask.to(v.device)
        positions = position_ids_from_mask(mask)  # as generate's prepare_inputs
        cache = DynamicCache()
        # Exact: a chunk of positions per forward over the cache of the earlier ones (the same bits).
        chunk = self.settings.prefill_chunk if self.settings.exact else ids.shape[1]
        cached = {_cache_argument(v.model): cache}
        for start in range(0, ids.shape[1], chunk):
            end = start + chunk
            out = v.model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                          use_cache=True, logits_to_keep=1, **cached)  # fmt: skip
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        return keys, values, out.logits[:, -1].float()

    def decode_step(self, cache: KVCache, slots: Tensor, tokens: Tensor) -> Tensor:
        """Feed each row ``tokens[b]`` at the end of slot ``slots[b]``; FP32 logits ``(B, V)`` for the next one.

        On the kernels (``decode_path`` ``"graphs"`` or ``"kernels"``), which read ``lengths`` on the
        device, each layer runs as its plan says (`plan.py`); otherwise the model's modules, the
        model's RoPE, an indexed append and SDPA over the live prefix."""
        v = self.view
        positions = cache.lengths[slots][:, None]
        lengths = cache.lengths[slots] + 1
        if self.on_kernels:
            rows = DecodeRows(cache, slots, positions, lengths, pads=cache.pads[slots])
            attention = KernelAttention(v, rows, self.attention_arithmetic, self.settings.attention)
        else:
            attention = TorchAttention(v, DecodeRows(cache, slots, positions, lengths), exact=self.settings.exact)
        hidden = decode_hidden_states(v, self.plan, tokens[:, None], positions, attention)
        cache.lengths[slots] = lengths
        return v.logits(hidden[:, -1])
