"""The engine's KV cache: one preallocated block per layer, a slot per running sequence.

Slot ``s`` holds one sequence's keys and values from position 0 (prompts are stored without their
left padding), ``lengths[s]`` of them live. Finished sequences free their slot and a waiting one
takes it, so the cache is sized by the number of sequences decoded at once, not the batch.

``fp8=True`` stores keys and values as FP8 E4M3 with one FP32 scale per (token, KV head): each
head vector is quantized as one group (``quantize_fp8_groups(x, group=head_dim)``, the library's
reference numerics) and read back as ``q * scale``. About half the memory and attention bytes. The
rollout then attends over other keys and values than a plain training forward, unless that forward
reads them the same way: `fp8_kv_roundtrip` is what the cache does to a key or value, and under the
exact contract (`ExactOps(kv_roundtrip=...)`) the training forward's attention applies it too, so the
unified flow stays exactly on-policy with the FP8 cache. On CUDA that forward's attention kernel
reads the codes and scales themselves (`FP8KVRoundtrip.encode`), as the decode reads the cache: the
kernel's tensor-core products round an FP8-coded operand otherwise than the same value handed over in
FP32 (measured on an H100: a different bit in one query of three). Without the exact contract ``JetGRPOConfig``
allows the FP8 cache only with a corrector, outside the unified flow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from jetrl_trainer import kernels
from jetrl_trainer.quant.fp8 import FP8_DTYPE, dequantize_fp8_groups, quantize_fp8_groups

__all__ = ["FP8KVRoundtrip", "KVCache", "fp8_kv_encode", "fp8_kv_roundtrip", "kv_roundtrip"]


def fp8_kv_encode(x: Tensor) -> tuple[Tensor, Tensor]:
    """Keys or values ``(..., head_dim)`` as the FP8 cache stores them: E4M3 codes shaped like ``x`` and
    one FP32 scale per head vector ``(...)``."""
    q, s = quantize_fp8_groups(x, x.shape[-1])
    return q, s[..., 0]


def fp8_kv_roundtrip(x: Tensor) -> Tensor:
    """A key or value ``(..., head_dim)`` (any float dtype) as the FP8 cache stores and returns it: FP32
    ``q * scale``, exactly what `KVCache.read` gives for ``dtype=torch.float32``."""
    q, s = fp8_kv_encode(x)
    return dequantize_fp8_groups(q, s[..., None], x.shape[-1], torch.float32)


@dataclass(frozen=True)
class FP8KVRoundtrip:
    """The FP8 cache's rounding for `ExactOps`: called, `fp8_kv_roundtrip` (what the torch attention
    reads); ``encode``, `fp8_kv_encode` (the codes and scales the CUDA kernel reads, as over the cache)."""

    def __call__(self, x: Tensor) -> Tensor:
        return fp8_kv_roundtrip(x)

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return fp8_kv_encode(x)


def kv_roundtrip(kv_cache_dtype: str) -> FP8KVRoundtrip | None:
    """What a cache of ``kv_cache_dtype`` does to keys and values (`ExactOps`' ``kv_roundtrip``): None
    where it keeps them as they are."""
    return FP8KVRoundtrip() if kv_cache_dtype == "fp8" else None


class KVCache:
    """``k``, ``v``: ``(layers, slots, kv_heads, max_len, head_dim)``; with ``fp8``, ``k_scale`` / ``v_scale``
    ``(layers, slots, kv_heads, max_len)``. Freed with the engine call."""

    def __init__(
        self, *, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device, fp8: bool = False,
    ) -> None:  # fmt: skip
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.dtype = dtype  # what reads return
        self.k = torch.zeros(shape, dtype=FP8_DTYPE if fp8 else dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale = torch.ones(shape[:-1], dtype=torch.float32, device=device) if fp8 else None
        self.v_scale = torch.ones_like(self.k_scale) if fp8 else None
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        # Left-padding positions before each slot's prompt in the training forward's padded batch: the
        # decode attention kernel lines its tiles up with that forward's (kernels/triton_decode_attention).
        self.pads = torch.zeros(num_slots, dtype=torch.long, device=device)

    @staticmethod
    def bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, fp8: bool) -> int:
        """Cache bytes one position of one sequence takes: keys and values of every layer and KV head,
        FP8 with their FP32 scales (an 8B Qwen3: 147,456 in BF16, 76,032 in FP8)."""
        per_vector = head_dim + 4 if fp8 else head_dim * dtype.itemsize
        return 2 * num_layers * num_kv_heads * per_vector

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Device memory the cache holds (keys, values, FP8 scales, lengths, pads)."""
        tensors = (self.k, self.v, self.k_scale, self.v_scale, self.lengths, self.pads)
        return sum(t.nbytes for t in tensors if t is not None)

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Keys or values ``(..., head_dim)`` in the cache's format: ``(values, scales)``, scales
        ``(...)`` for FP8 and None otherwise. Each head vector is encoded on its own, so encoding a
        padded batch of prompts once and slicing it equals encoding each slice."""
        return fp8_kv_encode(x) if self.fp8 else (x, None)

    def _write(self, index: tuple, k: tuple[Tensor, Tensor | None], v: tuple[Tensor, Tensor | None]) -> None:
        for cache, scales, (values, s) in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            cache[index] = values.to(cache.dtype)  # widening only: the cache holds the prefill's promoted dtype
            if scales is not None:
                scales[index] = s

    def store_encoded(
        self, slots: Tensor, k: tuple[Tensor, Tensor | None], v: tuple[Tensor, Tensor | None], *, row: int,
        length: int, pad: int = 0,
    ) -> None:  # fmt: skip
        """Start ``slots`` (a 1-D index) with one prompt: the last ``length`` positions of ``row`` of the
        left-padded prompts' keys/values ``(layers, N, kv_heads, P, head_dim)``, already in the cache
        format (:meth:`encode`), for every layer at once; their lengths become ``length`` and their
        pads ``pad`` (the prompt's left padding in the training forward's batch).

        One copy per tensor whatever the number of layers and slots (GRPO starts the generations of
        a prompt together): a slot at a time and a layer at a time was 72 launches per sequence on
        a 36-layer model."""
        picked = [tuple(t[:, row, None, :, -length:] if t is not None else None for t in x) for x in (k, v)]
        self._write((slice(None), slots, slice(None), slice(0, length)), *picked)
        self.lengths[slots] = length
        self.pads[slots] = pad

    def append(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write one new token per row (``k``, ``v``: ``(B, kv_heads, head_dim)``) at ``lengths[slots]``."""
        fused = _kv_append_kernel(k)
        if fused is None:
            self._write((layer, slots, slice(None), self.lengths[slots]), self.encode(k), self.encode(v))
            return
        # The exact decode appends every layer's keys through here: in torch ops an FP8 append is about
        # a dozen small launches (the encoding, then the indexed writes), one launch fused, the same bytes.
        scales = dict(k_scale=self.k_scale[layer], v_scale=self.v_scale[layer]) if self.fp8 else {}
        fused(k, v, self.k[layer], self.v[layer], slots, self.lengths, **scales)

    def read(self, layer: int, slots: Tensor, length: int | None = None,
             dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
        """The rows' keys and values ``(B, kv_heads, length or max_len, head_dim)``: the first ``length``
        positions, in the cache's dtype, an FP8 cache's dequantized to ``dtype`` (default the model dtype;
        FP32 gives `fp8_kv_roundtrip`'s values)."""
        positions = slice(0, length)
        k, v = self.k[layer, slots, :, positions], self.v[layer, slots, :, positions]
        if not self.fp8:
            return k, v
        return tuple(
            dequantize_fp8_groups(x, s[layer, slots, :, positions][..., None], x.shape[-1], dtype or self.dtype)
            for x, s in ((k, self.k_scale), (v, self.v_scale))
        )


def _kv_append_kernel(x: Tensor):
    """`kernels.triton_rope_append.kv_append` where it runs, for keys or values like ``x``: CUDA tensors,
    Triton installed, a head_dim the kernel tiles (a power of two >= 16); None elsewhere (torch ops)."""
    if not x.is_cuda or not kernels.triton_available():
        return None
    module = kernels.optional_module("triton_rope_append")
    return module.kv_append if module is not None and module.tiles_head_dim(x.shape[-1]) else None
