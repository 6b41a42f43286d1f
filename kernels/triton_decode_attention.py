"""Split-KV decode attention over a slot KV cache (flash-decoding), GQA-aware, and its reference.

One new query per row attends to the first ``lengths[b]`` positions of its slot ``slots[b]``:

=====================  ==========================================  ==========================
operand                shape / layout                               dtype
=====================  ==========================================  ==========================
``q``                  [B, H, D], unit stride along D               bf16 / fp16 / fp32
``k_cache, v_cache``   [S, H_kv, T, D], unit stride along D         same as ``q``
``slots``              [B]                                          int32 / int64
``lengths``            [B], 1 <= lengths[b] <= T                    int32 / int64
output                 [B, H, D], contiguous                        same as ``q``
=====================  ==========================================  ==========================

Why not SDPA: a masked SDPA over a static cache reads all T positions of every row (far slower
over a large slot cache: docs/history.md §7); this kernel reads each row's
live positions only, split over ``splits`` programs so that short batches still fill the GPU.
The launch depends on shapes alone (``lengths`` is read on the device), so it captures in a
CUDA graph. Departure from the reference: summation order only (FP32 accumulation; P·V with P
rounded to the cache dtype, as flash attention does).
"""

from __future__ import annotations

import struct
from typing import Optional

import torch
from torch import Tensor

from ._triton_support import call_op, cdiv, check_scale_format, load_jit, sm_count
from .settings import DecodeAttentionSettings
from .triton_rope_append import check_kv_scales

__all__ = ["decode_attention", "decode_attention_reference", "plan_splits"]

# Positions per tile and the order of arithmetic when the caller names none: flash attention's
# (benchmarks/probe_attention_bits.py). The engine passes the pair that reproduces the SDPA backend of
# its training forward instead (rollout/engine/attention.py: 128 positions, oldest first, for cuDNN).
BLOCK_N = 64
FLASH_ORDER = True
LOG2E = 1.4426950408889634


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def plan_splits(rows: int, kv_heads: int, max_len: int, block_n: int, sms: int,
                settings: DecodeAttentionSettings = DecodeAttentionSettings()) -> int:  # fmt: skip
    """KV splits per (row, KV head): enough programs for two per SM, each with at least
    ``settings.min_tiles_per_split`` tiles (a split costs a partial write and a reduce; it pays only
    while rows x KV heads leave SMs idle and each split still gets several tiles).

    Depends on shapes alone (``max_len`` is the cache's length, not the live one), so a CUDA graph
    captured for a batch bucket keeps its plan."""
    fill = cdiv(2 * sms, max(1, rows * kv_heads))
    return max(1, min(fill, cdiv(max_len, settings.min_tiles_per_split * block_n)))


def decode_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor, scale: float,
    k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
) -> Tensor:  # fmt: skip
    """Pure torch, FP32: softmax(q·kᵀ·scale over the live positions)·v per row and head (FP8 caches
    dequantized to the query dtype first, as the kernel does)."""
    B, H, D = q.shape
    k, v = k_cache[slots], v_cache[slots]  # (B, H_kv, T, D)
    if k_scale is not None:
        k = (k.float() * k_scale[slots][..., None]).to(q.dtype)
        v = (v.float() * v_scale[slots][..., None]).to(q.dtype)
    k, v = k.float(), v.float()
    groups = H // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", q.float(), k) * scale
    dead = torch.arange(k.shape[2], device=q.device)[None, :] >= lengths[:, None]
    scores = scores.masked_fill(dead[:, None, :], float("-inf"))
    return torch.einsum("bht,bhtd->bhd", scores.softmax(-1), v).to(q.dtype)


@torch.library.custom_op("jetrl::decode_attention", mutates_args=(), device_types="cuda")
def _decode_attention_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor, scale: float, splits: int,
    k_scale: Optional[Tensor], v_scale: Optional[Tensor], block_n: int, flash_order: bool, quant_format: str,
    pads: Optional[Tensor], num_warps: int, loop_stages: int, direct_single_split: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    jit = load_jit("_triton_decode_attention_jit")
    B, H, D = q.shape
    h_kv, T = k_cache.shape[1], k_cache.shape[2]
    groups = H // h_kv
    span = T + (block_n - 1 if pads is not None else 0)  # pads shift a row's tiles by up to block_n - 1
    tiles = cdiv(cdiv(span, splits), block_n)  # block_n-position tiles per split
    m = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((B, H, splits, D), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    quant = bool(quant_format)
    oq = torch.empty((B, H * D) if quant else (0,), dtype=torch.float8_e4m3fn, device=q.device)
    os_ = torch.empty((B, H) if quant else (0,), dtype=torch.float32, device=q.device)
    out_q = dict(H=H, QUANT=quant, UE8M0=quant_format == "ue8m0")
    fp8 = k_scale is not None
    direct = splits == 1 and direct_single_split
    # Flash attention's host computes scale·log2(e) in FP64 from the FP32 scale, then rounds it to FP32.
    scale_log2 = _fp32(_fp32(scale) * LOG2E)
    jit.decode_attention_split_kernel[(B, h_kv, splits)](
        q, k_cache, v_cache, slots, lengths, pads if pads is not None else lengths, m, l, acc, k_scale if fp8 else m, v_scale if fp8 else m, out,
        oq.view(torch.uint8), os_, scale, scale_log2,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), m.stride(0), m.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0, out.stride(0), out.stride(1), tiles,
        GROUPS=groups, G_PAD=max(16, 1 << (groups - 1).bit_length()), D=D, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # FP32 caches: no silent TF32
        KV_FP8=fp8, FLASH_ORDER=flash_order, DIRECT=direct, HAS_PADS=pads is not None, LOOP_STAGES=loop_stages,
        num_warps=num_warps, **out_q,
    )  # fmt: skip
    if direct:
        return out, oq, os_
    jit.decode_attention_reduce_kernel[(B, H)](
        m, l, acc, out, oq.view(torch.uint8), os_, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1), scale_log2, SPLITS=splits,
        S_PAD=max(2, 1 << (splits - 1).bit_length()), D=D, FLASH_ORDER=flash_order, num_warps=4, **out_q,
    )  # fmt: skip
    return out, oq, os_


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, slots, lengths, scale, splits, k_scale, v_scale, block_n, flash_order, quant_format, pads,
      num_warps, loop_stages, direct_single_split):  # fmt: skip
    B, H, D = q.shape
    quant = bool(quant_format)
    return (
        torch.empty_like(q),
        q.new_empty((B, H * D) if quant else (0,), dtype=torch.float8_e4m3fn),
        q.new_empty((B, H) if quant else (0,), dtype=torch.float32),
    )


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor, scale: float, *,
    splits: Optional[int] = None, k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
    block_n: int = BLOCK_N, flash_order: bool = FLASH_ORDER, quantize_output: Optional[str] = None,
    pads: Optional[Tensor] = None, settings: DecodeAttentionSettings = DecodeAttentionSettings(),
    direct_single_split: bool = True,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Attention of ``q`` ``(B, H, D)`` over each row's live cached positions; see the module table.

    FP8 caches (``float8_e4m3fn``) come with ``k_scale`` / ``v_scale`` ``(S, H_kv, T)``, one FP32 scale
    per position and KV head (the engine's ``KVCache(fp8=True)``). ``block_n`` positions per tile
    (a power of two >= 16); ``flash_order`` uses flash attention's order of arithmetic (see the jit module);
    ``splits`` defaults to :func:`plan_splits` for this GPU. ``quantize_output`` (a scale format,
    ``"fp32"`` or ``"ue8m0"``; head_dim 128) also returns the output's 1×128 FP8 quantization as
    ``(out, q [B, H·D], s [B, H])``, bit-identical to ``quantize_fp8_groups(out.reshape(B, H·D))``.
    ``pads`` ``[B]`` (integers >= 0): how many left-padding positions precede row ``b``'s first cached
    one in the training forward's padded batch. A tiled training kernel starts its tiles at the padded
    row's position 0, so row ``b``'s tiles here start ``pads[b] mod block_n`` positions early (masked),
    on the same boundaries; the sums then follow that kernel's order on padded rows too.
    ``settings``: the launch (warps, pipelining depth, the split plan's minimum tiles per split); the
    warps share a tile's row sums, so their number can change the order of the sums
    (``benchmarks/probe_attention_bits.py`` says how far from the training forward a setting lands).
    ``direct_single_split``: one split writes the normalized output from phase 1, one launch fewer
    than phase 2, with the same bits (False, for tests: phase 2 runs anyway)."""
    if q.device.type != "cuda":
        raise ValueError("decode_attention is a CUDA kernel; on CPU use decode_attention_reference.")
    B, H, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != D:
        raise ValueError(f"k_cache / v_cache must be (S, H_kv, T, {D}); got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}.")  # fmt: skip
    if H % k_cache.shape[1] or D & (D - 1) or D < 16:
        raise ValueError(f"need H % H_kv == 0 and a power-of-two head_dim >= 16; got H={H}, "
                         f"H_kv={k_cache.shape[1]}, D={D}.")  # fmt: skip
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16; got {block_n}.")
    fp8 = k_scale is not None
    if (not fp8 and q.dtype != k_cache.dtype) or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches (unless FP8) must share a dtype and have unit stride along head_dim.")
    if pads is not None and (pads.shape != (B,) or pads.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"pads must be an int32 / int64 tensor of shape ({B},); got {pads.dtype} {tuple(pads.shape)}.")
    if splits is None:
        splits = plan_splits(B, k_cache.shape[1], k_cache.shape[2], block_n, sm_count(q.device), settings)
    if splits < 1:
        raise ValueError(f"splits must be >= 1; got {splits}.")
    if quantize_output is not None:
        check_scale_format(quantize_output)
        if D != 128:
            raise ValueError(f"quantize_output needs head_dim 128 (one 1x128 group per head); got {D}.")
    out, oq, os_ = call_op(_decode_attention_op, q, k_cache, v_cache, slots, lengths, float(scale), int(splits),
                           k_scale, v_scale, int(block_n), bool(flash_order), quantize_output or "", pads,
                           settings.num_warps, settings.loop_stages, bool(direct_single_split))  # fmt: skip
    return (out, oq, os_) if quantize_output is not None else out
