"""Exact attention for CUDA: each query's bits depend on its own keys and values only.

The kernel (`_triton_exact_attention_jit.py`) is what `jetrl_trainer.exact.exact_attention` runs on
CUDA, in the prefill, every decode step and the training forward alike: one launch per call (two with
``split_keys``: the splits, then their merge), where the torch version launches a dozen kernels per
64-key tile (a decode step over 8k positions: 1,500 per layer). Its arithmetic is its own (``tl.exp``,
its dot instructions), not the torch version's, so one device runs one of the two in both phases.
"""

from __future__ import annotations

import os

import torch

from jetrl_trainer.kernels._triton_support import cdiv, load_jit
from jetrl_trainer.kernels.settings import ExactAttentionSettings

__all__ = ["exact_attention", "uses_tensor_cores"]

_DEFAULT = ExactAttentionSettings()


def uses_tensor_cores(settings: ExactAttentionSettings, q_dtype: torch.dtype) -> bool:
    """Whether the kernel takes its products on tensor cores for queries of ``q_dtype`` (see
    ``ExactAttentionSettings.dot``). ``"auto"`` stays on FP32 FMA under Triton's interpreter, whose
    BF16 dots are wrong (Triton 3.6 multiplies their raw bits); the interpreter has no tensor cores
    to win anyway."""
    if settings.dot == "auto":
        return q_dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1"
    return settings.dot == "bf16"


def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_key: torch.Tensor, last_key: torch.Tensor, scale: float,
    settings: ExactAttentionSettings = _DEFAULT, *, kv_rows: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Softmax attention ``(B, H, S, D)`` of q ``(B, H, S, D)`` over k / v ``(B, H_kv, T, D)`` (any float
    dtypes, any strides; GQA: head ``h`` reads KV head ``h // (H / H_kv)``), query ``(b, s)`` reading keys
    ``first_key[b]`` ``(B,)`` to ``last_key[b, s]`` ``(B, S)``, both included (none where ``last < first``).
    Computed in FP32 (no TF32), or with the products on tensor cores from BF16-rounded operands where
    ``uses_tensor_cores(settings, q.dtype)``, returned in ``q``'s dtype; a query with no key gives 0.

    The engine's cache in place: ``kv_rows`` ``(B,)`` picks batch row ``b``'s keys and values among k /
    v's first dim (its slots), and FP8 keys and values come with ``k_scale`` / ``v_scale`` ``(slots,
    H_kv, T)``, read as ``q * scale`` in FP32 (`rollout/engine/kv_cache.py`'s roundtrip)."""
    b, h, s, d = q.shape
    h_kv, t = k.shape[1], k.shape[2]
    if (k_scale is None) != (v_scale is None):
        raise ValueError("exact_attention: pass both k_scale and v_scale (an FP8 cache) or neither.")
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    first = first_key.to(device=q.device, dtype=torch.int64).contiguous()
    last = last_key.to(device=q.device, dtype=torch.int64)
    scaled = k_scale is not None
    rows_index = kv_rows.to(device=q.device, dtype=torch.int64).contiguous() if kv_rows is not None else first
    scale_strides = k_scale.stride() if scaled else (0, 0, 0)
    if scaled and v_scale.stride() != k_scale.stride():
        raise ValueError("exact_attention: k_scale and v_scale must have the same strides.")
    jit = load_jit("_triton_exact_attention_jit")
    block_d = max(16, 1 << (d - 1).bit_length())
    split = settings.split_keys
    # The splits cover the longest run a row can hold (t keys): a graph captured for the cache's size
    # launches them all, and a split past a row's keys leaves an empty state that its merge skips.
    splits = cdiv(t, split) if split else 1
    # The split states of a long query run (a training forward: B x H x S x splits x D in FP32, 2.3 GiB
    # per 16k sequence of the 8B shape) are made and merged a chunk of positions at a time. Each query's
    # bits are its own, whatever queries share its launch (the contract already has the decode's single
    # query meet the training forward's many), so the chunks change no bit.
    chunk = min(s, max(1, settings.max_split_state_bytes // (b * h * splits * (d + 2) * 4))) if split else s
    # One set of state buffers for every chunk (a shorter last chunk uses their front), so the states never
    # take more than the bound, as a new set allocated while the last one is still held would.
    if split:
        part_m = torch.empty(b * h * chunk * splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_m)
        part_acc = torch.empty(b * h * chunk * splits, d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_sum = part_acc = out  # not read
    for first_query in range(0, s, chunk):
        queries = slice(first_query, min(first_query + chunk, s))
        q_part, out_part, last_part = q[:, :, queries], out[:, :, queries], last[:, queries]
        s_part = q_part.shape[2]
        rows = (h // h_kv) * s_part
        grid = (cdiv(rows, settings.block_m), b * h_kv, splits)
        jit.exact_attention_kernel[grid](
            q_part, k, v, out_part, first, last_part, rows_index, k_scale if scaled else first,
            v_scale if scaled else first, part_m, part_sum, part_acc, s_part, t, rows, splits,
            float(scale), *q_part.stride(), *k.stride(), *v.stride(), *out_part.stride(), *last_part.stride(),
            *scale_strides, GROUP=h // h_kv, HEADS_KV=h_kv, D=d, BLOCK_D=block_d, BLOCK_M=settings.block_m,
            BLOCK_N=settings.block_n, KV_ROWS=kv_rows is not None, SCALED=scaled,
            BF16_DOT=uses_tensor_cores(settings, q.dtype), SPLIT=split,
            num_warps=settings.num_warps, num_stages=settings.num_stages,
        )  # fmt: skip
        if split:
            n_queries = b * h * s_part
            jit.exact_attention_combine_kernel[(cdiv(n_queries, settings.combine_rows),)](
                part_m, part_sum, part_acc, out_part, first, last_part, s_part, n_queries, splits,
                *out_part.stride(), *last_part.stride(), HEADS=h, D=d, BLOCK_D=block_d,
                BLOCK_R=settings.combine_rows, SPLIT=split,
            )  # fmt: skip
    return out
