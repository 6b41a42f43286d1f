"""RoPE of the decode token's query and key, and the key/value append to the slot KV cache, in one launch.

Replaces, in the engine's decode step, transformers' eager ``apply_rotary_pos_emb`` (about eight
elementwise launches each for q and k: two products, a slice, a negation, a concatenation, a sum)
and the two indexed cache writes: at decode every one of those launches moves a few kilobytes, so
the step paid launches, not bytes. The values are the same bits as the eager ops (see the jit module).

=====================  ============================================  ==================
operand                shape / layout                                 dtype
=====================  ============================================  ==================
``q``                  [B, H, D], unit stride along D                 bf16 / fp16 / fp32
``k``, ``v``           [B, H_kv, D], unit stride along D              same
``cos``, ``sin``       [B, D] (HF rotary output at each row's position)  same
``k_cache, v_cache``   [S, H_kv, T, D], unit stride along D           same (written)
``slots``, ``positions``  [B] int                                     -
output                 rotated ``q`` [B, H, D], contiguous            same
=====================  ============================================  ==================
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton_support import call_op, load_jit

__all__ = ["rope_append"]


@torch.library.custom_op("jetrl::rope_append", mutates_args=("k_cache", "v_cache"), device_types="cuda")
def _rope_append_op(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    slots: Tensor, positions: Tensor,
) -> Tensor:  # fmt: skip
    jit = load_jit("_triton_rope_jit")
    B, H, D = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if B == 0:
        return out
    jit.rope_append_kernel[(B, H + k.shape[1])](
        q, k, v, cos, sin, out, k_cache, v_cache, slots, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), H=H, D=D, num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    return out


@_rope_append_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slots, positions):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def rope_append(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    slots: Tensor, positions: Tensor,
) -> Tensor:  # fmt: skip
    """Rotated ``q``; writes rotated ``k`` and ``v`` at ``[slots[b], :, positions[b]]`` of the caches."""
    B, H, D = q.shape
    if q.device.type != "cuda":
        raise ValueError("rope_append is a CUDA kernel; on CPU the engine runs the model's own apply_rotary_pos_emb.")
    if D & (D - 1) or D < 16 or k.shape != v.shape or k.shape[0] != B or k.shape[2] != D:
        raise ValueError(f"need q (B, H, D), k / v (B, H_kv, D) with a power-of-two D >= 16; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}.")  # fmt: skip
    if cos.shape != (B, D) or sin.shape != (B, D) or k_cache.shape != v_cache.shape or k_cache.shape[3] != D:
        raise ValueError(f"cos / sin must be (B, D) = {(B, D)} and the caches (S, H_kv, T, {D}); got "
                         f"{tuple(cos.shape)}, {tuple(k_cache.shape)}.")  # fmt: skip
    tensors = (q, k, v, cos, sin, k_cache, v_cache)
    if len({t.dtype for t in tensors}) != 1 or any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("q, k, v, cos, sin and the caches must share a dtype and have unit stride along head_dim.")
    return call_op(_rope_append_op, q, k, v, cos, sin, k_cache, v_cache, slots, positions)
