"""RMSNorm + FP8 quantization in one kernel, bit-identical to its pure-torch reference.

The reference is ``jetrl_trainer.quant.reference.rmsnorm_reference`` (Qwen3/Llama's RMSNorm with
a fixed pairwise-tree mean of squares and ``x / sqrt(var + eps)``, so that a kernel can reproduce
it; see that module for the departures). ``rmsnorm_quant_fp8`` returns ``(y, q, s)`` with
``y == rmsnorm_reference(x, weight, eps)`` and ``(q, s) == quantize_fp8_groups(y)`` as computed on
CUDA.

Layout: ``x [M, K]`` (fp32/bf16/fp16, unit stride along K) and ``weight [K]`` on CUDA;
``y [M, K]`` in ``promote_types(x.dtype, weight.dtype)``, ``q [M, K] float8_e4m3fn``,
``s [M, ceil(K/128)] float32``, all contiguous.
"""

from __future__ import annotations

import torch

from ._triton_support import call_op, cdiv, check_cuda_2d, check_scale_format, load_jit

__all__ = ["rmsnorm_backward", "rmsnorm_quant_fp8"]

_FP8 = torch.float8_e4m3fn
_GROUP = 128
_MAX_K = 65536


@torch.library.custom_op("jetrl::rmsnorm_quant_fp8", mutates_args=(), device_types="cuda")
def _rmsnorm_quant_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_format: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    jit = load_jit("_triton_fused_jit")
    m, k = x.shape
    y = torch.empty((m, k), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    q = torch.empty((m, k), dtype=_FP8, device=x.device)
    s = torch.empty((m, cdiv(k, _GROUP)), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return y, q, s
    block_k = max(_GROUP, 1 << (k - 1).bit_length())
    jit.rmsnorm_quant_kernel[(m,)](
        x, weight, y, q.view(torch.uint8), s, k, float(k), eps, x.stride(0), y.stride(0), q.stride(0), s.stride(0),
        BLOCK_K=block_k, LEVELS=block_k.bit_length() - 2, GROUP=_GROUP, UE8M0=scale_format == "ue8m0",
        num_warps=min(16, max(4, block_k // 512)),
        enable_fp_fusion=False,  # x*x + y*y must round twice, as in the reference
    )
    return y, q, s


@_rmsnorm_quant_op.register_fake
def _(x, weight, eps, scale_format):
    m, k = x.shape
    return (
        x.new_empty((m, k), dtype=torch.promote_types(x.dtype, weight.dtype)),
        x.new_empty((m, k), dtype=_FP8),
        x.new_empty((m, cdiv(k, _GROUP)), dtype=torch.float32),
    )


def rmsnorm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_format: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y = rmsnorm_reference(x, weight, eps)`` and ``(q, s) = quantize_fp8_groups(y)``, in one pass."""
    check_cuda_2d(x, "x")
    check_scale_format(scale_format)
    if weight.dim() != 1 or weight.shape[0] != x.shape[1] or weight.device != x.device:
        raise ValueError(f"weight must be a 1-D tensor of {x.shape[1]} elements on {x.device}; got {tuple(weight.shape)} on {weight.device}.")
    if x.shape[1] > _MAX_K:
        raise ValueError(f"rmsnorm_quant_fp8 keeps a row in registers: K must be ≤ {_MAX_K}; got {x.shape[1]}.")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return call_op(_rmsnorm_quant_op, x, weight.contiguous(), float(eps), scale_format)


# --------------------------------------------------------------------------------------------
# Backward (for quant.fused.FusedRMSNorm): one pass over x and dy, not a chain of FP32 torch ops
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("jetrl::rmsnorm_backward", mutates_args=(), device_types="cuda")
def _rmsnorm_backward_op(
    x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    jit = load_jit("_triton_fused_jit")
    m, k = x.shape
    dx = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0 or k == 0:
        return dx, torch.zeros_like(weight)
    block_k = max(16, 1 << (k - 1).bit_length())
    programs = min(m, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    rows = cdiv(m, programs)
    programs = cdiv(m, rows)
    dw_part = torch.empty((programs, block_k), dtype=torch.float32, device=x.device)
    jit.rmsnorm_backward_kernel[(programs,)](
        x, weight, dy, dx, dw_part, m, k, float(k), eps, x.stride(0), dy.stride(0), dx.stride(0),
        BLOCK_K=block_k, ROWS_PER_PROG=rows, num_warps=min(16, max(4, block_k // 512)),
    )
    return dx, dw_part[:, :k].sum(0).to(weight.dtype)


@_rmsnorm_backward_op.register_fake
def _(x, weight, dy, eps):
    return torch.empty_like(x), torch.empty_like(weight)


def rmsnorm_backward(
    x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, dweight)`` of ``rmsnorm_reference(x, weight, eps)`` for output gradient ``dy``.

    FP32 math in one kernel; the cast to the input dtype is treated as the identity (as autograd
    does). ``x``, ``dy`` ``[M, K]`` on CUDA with unit stride along K; ``dx`` has ``x``'s dtype.
    """
    check_cuda_2d(x, "x")
    check_cuda_2d(dy, "dy")
    if dy.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"dy must match x {tuple(x.shape)} and weight must be [{x.shape[1]}]; got {tuple(dy.shape)}, {tuple(weight.shape)}.")
    x = x if x.stride(-1) == 1 else x.contiguous()
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    return call_op(_rmsnorm_backward_op, x, weight.contiguous(), dy, float(eps))
