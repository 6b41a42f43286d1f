"""Pure-torch references of the fused RMSNorm and SwiGLU kernels (the part before the FP8 quant).

They run on any device and are what ``quant.fused`` computes off CUDA or without Triton; the
kernels in ``kernels/triton_norm.py`` and ``kernels/triton_swiglu.py`` reproduce them bit for bit
on CUDA and add the FP8 quantization of the output (``quant/fp8.py`` is that reference).

``rmsnorm_reference`` follows Qwen3/Llama's ``RMSNorm.forward`` op for op — FP32 variance, the
normalised row cast back to the input dtype, *then* multiplied by the weight in the promoted
dtype — with two departures that make it exactly reproducible by a kernel:

* the mean of squares is summed in a fixed pairwise tree (adjacent pairs, level by level, the row
  zero-padded to a power of two) instead of ATen's reduction order, which no kernel can replicate;
* ``x / sqrt(var + eps)`` (IEEE ``sqrt`` and division) instead of ``x * rsqrt(var + eps)``:
  ``rsqrt`` is an approximate hardware instruction, and the IEEE form is also nearer the exact value.

So the result can differ from ``transformers``' module in the last bit of some elements: ≤ 2 BF16
ulps, since transformers rounds twice (the normalized value, then its product with the weight) and
this rounds once; over 95% of the elements are equal (the tests bound both).

``swiglu_reference`` is exactly what Qwen3/Llama's MLP computes between ``gate_proj``/``up_proj``
and ``down_proj``: ``F.silu(gate) * up`` in the input dtype (no departure).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rmsnorm_reference", "swiglu_reference"]


def _pairwise_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in the kernel's tree: zero-pad to 2^n, then add adjacent pairs."""
    width = 1 << max(0, (v.shape[-1] - 1).bit_length())
    v = F.pad(v, (0, width - v.shape[-1]))
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the fused kernel computes it (see the module docstring for the two departures)."""
    xf = x.float()
    total = _pairwise_sum(xf * xf)  # (..., 1)
    # A tensor divisor: on CUDA, `t / K` with a Python scalar is run as `t * (1/K)`.
    var = total / torch.full_like(total, float(x.shape[-1]))
    h = xf / torch.sqrt(var + eps)
    return weight * h.to(x.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` exactly as ``Qwen3MLP`` / ``LlamaMLP`` compute it."""
    return F.silu(gate) * up
