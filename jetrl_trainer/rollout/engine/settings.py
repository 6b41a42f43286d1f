"""What a decode engine launches, chosen once when it is built: `EngineSettings`.

The fields pick where the step runs (Triton kernels, graphed or eager, or the model's modules),
the attention order the kernel reproduces, and the attention kernel's launch. The engine reads them
in its constructor, where it builds the per-layer plan (`plan.py`); nothing changes them afterwards.
A benchmark or a test that compares two choices builds two engines (``dataclasses.replace``).
The kernel path's fusions (grouped projections, fused epilogues) and the generate loop's look-ahead
are not settings: none measured slower than what it replaces (docs/history.md), and the separate
launches run only where a fused one cannot (`plan.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch.nn.attention import SDPBackend

from jetrl_trainer._choices import DECODE_PATHS, check_choice
from jetrl_trainer.kernels.settings import DecodeAttentionSettings

from .attention import MATCHED_BACKENDS

__all__ = ["EngineSettings"]


@dataclass(frozen=True)
class EngineSettings:
    """How a `DecodeEngine` runs its decode step and its generate loop.

    Parameters:
        decode_path: ``"torch_graphs"`` (``exact`` only): the model's modules under the exact ops,
            captured in a CUDA graph per batch-size bucket (no host sync in that step).
            ``"graphs"``: the step's Triton kernels (RoPE + KV append, split-KV attention,
            grouped FP8 GEMMs, fused epilogues), captured in a CUDA graph per batch-size bucket;
            ``"kernels"``: the same launches, eager (probes); ``"torch"``: the model's modules and
            SDPA over each row's live KV (CPU, and the reference). None: ``"graphs"`` on CUDA with
            Triton, else ``"torch"``.
        attention: launch settings of the split-KV decode attention kernel.
        attention_order: the SDPA backend whose summation order (tile size and tile order) the decode
            attention kernel reproduces (``attention.py``): ``CUDNN_ATTENTION`` or ``FLASH_ATTENTION``.
            None: the backend torch runs for the training forward's attention on the engine's device.
        exact: decode with the batch-invariant ops of `jetrl_trainer.exact` (the model's modules under
            `ExactOps`, the exact attention over the cache), so that every recorded log-prob is the bit
            the training forward under `ExactOps` computes (docs/architecture.md#exact-on-policy). It runs
            the model's modules, captured (``"torch_graphs"``) where CUDA graphs run, else eager
            (``"torch"``): the kernel path has no exact kernels yet.
        prefill_chunk: with ``exact``, the prefill runs the prompts ``prefill_chunk`` positions per
            forward, attending over the earlier chunks' keys, so a long prompt's activations are
            held a chunk at a time. Under the exact ops a query's bits do not depend on which others
            share its forward, so the prefill's bits are the unchunked ones (tests/exact/). Without
            ``exact`` the prefill runs whole: a chunked one would sum in another order than the
            training forward's attention.
    """

    decode_path: Optional[str] = None
    attention: DecodeAttentionSettings = field(default_factory=DecodeAttentionSettings)
    attention_order: Optional[SDPBackend] = None
    exact: bool = False
    prefill_chunk: int = 1024

    def __post_init__(self) -> None:
        chunk = self.prefill_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"EngineSettings.prefill_chunk must be a positive number of positions; got {chunk!r}.")
        if self.decode_path is not None:
            check_choice("EngineSettings.decode_path", self.decode_path, DECODE_PATHS)
        if self.attention_order is not None and self.attention_order not in MATCHED_BACKENDS:
            names = ", ".join(b.name for b in MATCHED_BACKENDS)
            raise ValueError(f"EngineSettings.attention_order must be None or one of {names}; "
                             f"got {self.attention_order!r}.")  # fmt: skip
        if self.decode_path == "torch_graphs" and not self.exact:
            raise ValueError("decode_path='torch_graphs' captures the exact decode (exact=True); the plain-torch decode "
                             "reads each row's live length on the host and cannot be captured.")  # fmt: skip
        if self.exact and self.decode_path not in (None, "torch", "torch_graphs"):
            raise ValueError(f"EngineSettings(exact=True) decodes on the 'torch' or 'torch_graphs' path; got decode_path="
                             f"{self.decode_path!r}. Leave decode_path None.")  # fmt: skip
        if not isinstance(self.attention, DecodeAttentionSettings):
            raise ValueError(f"EngineSettings.attention must be a DecodeAttentionSettings; got {self.attention!r}.")
