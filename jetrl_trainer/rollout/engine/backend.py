"""``rollout_backend="engine"``: the decode engine as a rollout backend, with a logged fallback."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from jetrl_trainer._choices import KV_CACHE_DTYPES, check_choice

from ..base import Rollout, RolloutBackend
from ..hf_generate import HFGenerateBackend
from .architecture import unsupported_model_reason
from .attention import arithmetic_note
from .engine import DecodeEngine, _module_ids
from .kv_cache import KVCache
from .settings import EngineSettings
from .sampling import unsupported_generation_reason

__all__ = ["EngineBackend"]

logger = logging.getLogger("jetrl_trainer")

# Share of a rollout's time spent capturing graphs above which the backend suggests keeping them
# (capture measured about half of a short rollout's time on a 1.2B model: docs/performance.md).
CAPTURE_HINT_SHARE = 0.25


class EngineBackend(RolloutBackend):
    """The engine where it applies; ``fallback`` (the ``hf`` backend) elsewhere, said once per reason
    (a warning when the engine was asked for, ``requested="engine"``; INFO when ``auto`` chose it).

    ``kv_cache_tokens`` bounds the KV cache: at most ``kv_cache_tokens // (longest prompt +
    max_new_tokens)`` sequences decode at once (the rest wait for a slot); ``None`` = all of them.
    ``kv_cache_bytes`` bounds it in memory instead (`KVCache.bytes_per_token` of the model and cache
    format), so the FP8 cache holds about twice the sequences of a BF16 one; with both, the tighter.
    ``kv_cache_dtype="fp8"`` stores the cache in FP8 (see :class:`~.kv_cache.KVCache`).
    ``keep_state=True`` keeps one engine with its KV cache and CUDA graphs between calls
    (:class:`~.engine.DecodeEngine`), so rollouts after the first skip the graph captures; the memory
    stays held through training. Each call draws its sampling seed from torch's global RNG, so
    ``set_seed`` reproduces rollouts. ``pad_to_multiple_of``: the trainer's (TRL's) prompt padding,
    so that the engine pads its prefill as the training forward's batch is padded. ``exact``: the
    exact on-policy contract (`EngineSettings.exact`); the engine must then run, with no fallback.
    ``autocast``: the trainer's autocast context, entered around a plain-torch decode.
    """

    name = "engine"

    def __init__(
        self, *, eos_token_ids: Sequence[int], pad_token_id: int, fallback: HFGenerateBackend,
        kv_cache_tokens: int | None = None, kv_cache_bytes: int | None = None, kv_cache_dtype: str = "auto",
        requested: str = "engine",
        keep_state: bool = False, pad_to_multiple_of: int | None = None, exact: bool = False,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:  # fmt: skip
        self.requested = requested  # "auto": a fallback is the expected path for other models, said at INFO
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.fallback = fallback
        self.kv_cache_tokens = kv_cache_tokens
        self.kv_cache_bytes = kv_cache_bytes
        self.kv_cache_dtype = check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        self._said: set[str] = set()  # notes already logged (fallback reasons, the attention match)
        self.keep_state = keep_state
        self.pad_to_multiple_of = pad_to_multiple_of  # the trainer's prompt padding (see DecodeEngine.generate)
        self._engine: DecodeEngine | None = None  # kept between calls with keep_state
        self.last_stats: dict = {}  # DecodeEngine.last_stats of the last engine call
        self.settings = EngineSettings(exact=exact)
        # The trainer's autocast (accelerate's), entered around a plain-torch decode so that its steps
        # compute as the prefill and the training forward do (the kernel path runs in the model dtype).
        self.autocast = autocast

    def generate(self, model: nn.Module, prompt_ids: Sequence[Sequence[int]], sampling: GenerationConfig) -> Rollout:
        reason = unsupported_model_reason(model) or unsupported_generation_reason(sampling)
        if reason is not None and self.settings.exact:
            raise ValueError(f"exact log-probs need the decode engine, which cannot run here: {reason}. "
                             "Set exact_logprobs=False to roll out with 'hf' instead.")  # fmt: skip
        if reason is not None:
            level = logging.WARNING if self.requested == "engine" else logging.INFO
            self._say_once((level, f"jetrl: rollout_backend={self.requested!r} falls back to 'hf': {reason}"))
            self.last_stats = {}  # this rollout did not run the engine
            return self.fallback.generate(model, prompt_ids, sampling)
        engine = self._engine_for(model)
        max_batch_size = self._max_batch_size(engine, prompt_ids, sampling)
        if not engine.settings.exact:  # the exact attention is the training forward's own
            self._say_once(arithmetic_note(engine.training_attention))
        seed = int(torch.randint(0, 2**62, ()).item())
        modules = engine.settings.decode_path in ("torch", "torch_graphs")  # the model's modules: the trainer's autocast
        with self.autocast() if modules else contextlib.nullcontext():
            ids, logprobs = engine.generate(
                prompt_ids, sampling, eos_token_ids=self.eos_token_ids, seed=seed, pad_token_id=self.pad_token_id,
                max_batch_size=max_batch_size, pad_to_multiple_of=self.pad_to_multiple_of,
            )
        self.last_stats = engine.last_stats
        self._say_once(self._keep_state_hint(engine.last_stats), key="keep_state_hint")
        return Rollout(ids, logprobs)

    def _keep_state_hint(self, stats: dict) -> tuple[int, str] | None:
        """Where capturing CUDA graphs took a large share of a rollout, say (once) what keeping them costs."""
        captured = stats.get("capture_seconds", 0.0)
        if self.keep_state or not captured or captured < CAPTURE_HINT_SHARE * stats["seconds"]:
            return None
        return logging.INFO, (
            f"jetrl: capturing the engine's CUDA graphs took {captured:.2f} s of a "
            f"{stats['seconds']:.2f} s rollout; rollout_keep_engine_state=True keeps them (and the KV cache, "
            f"{stats['kv_cache_bytes'] / 2**30:.2f} GiB here) between rollouts, so later rollouts replay them."
        )

    def _say_once(self, note: tuple[int, str] | None, key: str | None = None) -> None:
        """Log ``(level, message)`` unless this message (or another under the same ``key``) was logged."""
        if note is not None and (key or note[1]) not in self._said:
            self._said.add(key or note[1])
            logger.log(*note)

    def _engine_for(self, model: nn.Module) -> DecodeEngine:
        kept = self._engine
        if kept is not None and kept.modules == _module_ids(model):  # the same module tree, wrapper included
            return kept  # another slot count rebuilds the kept state itself
        engine = DecodeEngine(model, settings=self.settings, kv_cache_dtype=self.kv_cache_dtype,
                              keep_state=self.keep_state)  # fmt: skip
        self._engine = engine if self.keep_state else None
        return engine

    def release_state(self) -> None:
        """Free the kept engine's KV cache and CUDA graphs (``keep_state``)."""
        if self._engine is not None:
            self._engine.release_state()

    def _max_batch_size(self, engine: DecodeEngine, prompt_ids: Sequence[Sequence[int]],
                        sampling: GenerationConfig) -> int | None:  # fmt: skip
        """Sequences that decode at once under the token and memory budgets (None: all of them)."""
        per_sequence = max(map(len, prompt_ids)) + sampling.max_new_tokens
        budgets = []
        if self.kv_cache_tokens is not None:
            if self.kv_cache_tokens < per_sequence:
                raise ValueError(
                    f"rollout_kv_cache_tokens={self.kv_cache_tokens} cannot hold one sequence of {per_sequence} tokens "
                    "(longest prompt + max_completion_length); raise it or leave it None."
                )
            budgets.append(self.kv_cache_tokens // per_sequence)
        if self.kv_cache_bytes is not None:
            v = engine.view
            token = KVCache.bytes_per_token(num_layers=len(v.layers), num_kv_heads=v.num_kv_heads, head_dim=v.head_dim,
                                            dtype=v.dtype, fp8=engine.kv_fp8)  # fmt: skip
            if self.kv_cache_bytes < per_sequence * token:
                raise ValueError(
                    f"rollout_kv_cache_gib={self.kv_cache_bytes / 2**30:.3g} cannot hold one sequence of {per_sequence} "
                    f"tokens (longest prompt + max_completion_length) at {token} bytes a token "
                    f"({per_sequence * token / 2**30:.3g} GiB); raise it, use rollout_kv_cache_dtype='fp8', or leave it None."
                )  # fmt: skip
            budgets.append(self.kv_cache_bytes // (per_sequence * token))
        return min(budgets) if budgets else None
