"""transformers' eager ``apply_rotary_pos_emb`` for the exact contract, one launch for q and k.

Under `ExactOps` the eager function is about five launches per rotated tensor (the two products,
``rotate_half``'s slices, negation and concatenation, the sum), in every layer of every decode step.
`jetrl_trainer.exact` calls this kernel in both phases instead (`_triton_exact_rope_jit.py`): the same
bits as the eager function (its reference, which the tests compare against with ``torch.equal``), one
program per (position, head).

=====================  ==========================================================  ==================
operand                shape / layout                                              dtype
=====================  ==========================================================  ==================
``q``, ``k``           ``(B, H, T, D)`` (``unsqueeze_dim=1``) or ``(B, T, H, D)``   bf16 / fp16 / fp32
                       (``=2``), any strides (copied where D's stride is not 1);
                       k may have fewer heads (GQA)
``cos``, ``sin``       ``(B, T, D)`` or ``(1, T, D)`` (broadcast over the batch)    one dtype
outputs                like q / k (``empty_like``), in ``promote_types(x, cos)``    as eager's
=====================  ==========================================================  ==================
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetrl_trainer._choices import FLOAT_DTYPES
from jetrl_trainer.kernels._triton_support import load_jit
from jetrl_trainer.kernels.settings import ExactRopeSettings

__all__ = ["exact_rope", "unsupported_reason"]

_DEFAULT = ExactRopeSettings()


def unsupported_reason(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> str | None:
    """Why `exact_rope` cannot take these operands (the caller then runs the eager function), or None."""
    if any(t.dtype not in FLOAT_DTYPES for t in (q, k, cos, sin)) or cos.dtype != sin.dtype:
        return "dtypes: q, k, cos and sin must be floats, cos and sin of one dtype"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or unsqueeze_dim % 4 not in (1, 2):
        return "shapes: q and k 4-D with their heads at unsqueeze_dim (1 or 2), cos and sin 3-D and alike"
    q, k = q.movedim(unsqueeze_dim % 4, 1), k.movedim(unsqueeze_dim % 4, 1)  # (B, H, T, D)
    b, _, t, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (t, d) or cos.shape[1:] != (t, d) or cos.shape[0] not in (1, b):
        return f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)} and cos {tuple(cos.shape)} do not pair up"
    if d % 2:
        return f"an odd head_dim ({d})"
    return None


def exact_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1,
               settings: ExactRopeSettings = _DEFAULT) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)``'s two outputs, with its bits (layouts above)."""
    reason = unsupported_reason(q, k, cos, sin, unsqueeze_dim)
    if reason is not None:
        raise ValueError(f"exact_rope: {reason}.")
    heads = unsqueeze_dim % 4
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    outs = tuple(torch.empty_like(x, dtype=torch.promote_types(x.dtype, cos.dtype)) for x in (q, k))
    q, k, q_out, k_out = (x.movedim(heads, 1) for x in (q, k, *outs))  # (B, H, T, D) views
    b, h_q, t, d = q.shape
    cos, sin = (c.expand(b, t, d) for c in (cos, sin))
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:  # the kernel reads both with one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    if q.numel() or k.numel():
        load_jit("_triton_exact_rope_jit").exact_rope_kernel[(b * t, h_q + k.shape[1])](
            q, k, cos, sin, q_out, k_out, t, h_q, *_bht(q), *_bht(k), cos.stride(0), cos.stride(1), *_bht(q_out),
            *_bht(k_out), HALF=d // 2, BLOCK_D=1 << (d - 1).bit_length(), num_warps=settings.num_warps,
            # FP32: eager multiplies, then adds, rounding each; a fused multiply-add would round the
            # sum of a product once and so differ from eager's bits (CPU's, or the other phase's)
            enable_fp_fusion=False,
        )  # fmt: skip
    return outs  # the tensors themselves, not views: autograd forbids in-place changes of a Function's views


def _bht(x: Tensor) -> tuple[int, int, int]:
    """The batch, head and position strides of ``x`` ``(B, H, T, D)``."""
    return x.stride(0), x.stride(1), x.stride(2)
