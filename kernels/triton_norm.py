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

from typing import Optional

import torch

from ._triton_support import call_op, cdiv, check_cuda_2d, check_scale_format, load_jit, sm_count

__all__ = ["add_rmsnorm_quant_fp8", "rmsnorm_backward", "rmsnorm_quant_fp8"]

_FP8 = torch.float8_e4m3fn
_GROUP = 128
_MAX_K = 65536
_TILE_ELEMENTS = 4096  # elements per program tile of the narrow-row norm kernels (rows of 128: 32 rows)


def _rows_per_tile(block_k: int) -> int:
    """Rows per program tile: one for rows of 4096 and more; several for narrow rows (Qwen3's per-head
    q/k norms have rows of 128), so that a program moves ~4096 elements, not one short row."""
    return max(1, _TILE_ELEMENTS // block_k)


@torch.library.custom_op("jetrl::rmsnorm_quant_fp8", mutates_args=(), device_types="cuda")
def _rmsnorm_quant_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_format: str, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    jit = load_jit("_triton_fused_jit")
    m, k = x.shape
    y = torch.empty((m, k), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    q = torch.empty((m if quantize else 0, k), dtype=_FP8, device=x.device)
    s = torch.empty((m if quantize else 0, cdiv(k, _GROUP)), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return y, q, s
    block_k = max(_GROUP, 1 << (k - 1).bit_length())
    rows = _rows_per_tile(block_k)
    jit.rmsnorm_quant_kernel[(cdiv(m, rows),)](
        x, weight, y, q.view(torch.uint8), s, m, k, float(k), eps, x.stride(0), y.stride(0), q.stride(0), s.stride(0),
        BLOCK_K=block_k, ROWS=rows, LEVELS=block_k.bit_length() - 2, GROUP=_GROUP, UE8M0=scale_format == "ue8m0",
        QUANT=quantize, num_warps=min(16, max(4, rows * block_k // 512)),
        enable_fp_fusion=False,  # x*x + y*y must round twice, as in the reference
    )
    return y, q, s


@_rmsnorm_quant_op.register_fake
def _(x, weight, eps, scale_format, quantize):
    m, k = x.shape
    return (
        x.new_empty((m, k), dtype=torch.promote_types(x.dtype, weight.dtype)),
        x.new_empty((m if quantize else 0, k), dtype=_FP8),
        x.new_empty((m if quantize else 0, cdiv(k, _GROUP)), dtype=torch.float32),
    )


def rmsnorm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_format: str = "fp32", quantize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y = rmsnorm_reference(x, weight, eps)`` and ``(q, s) = quantize_fp8_groups(y)``, in one pass.

    ``quantize=False`` writes ``y`` only (``q`` and ``s`` come back with 0 rows): a norm whose output
    feeds no FP8 GEMM, such as Qwen3's q/k norms in training."""
    check_cuda_2d(x, "x")
    check_scale_format(scale_format)
    if weight.dim() != 1 or weight.shape[0] != x.shape[1] or weight.device != x.device:
        raise ValueError(f"weight must be a 1-D tensor of {x.shape[1]} elements on {x.device}; got {tuple(weight.shape)} on {weight.device}.")
    if x.shape[1] > _MAX_K:
        raise ValueError(f"rmsnorm_quant_fp8 keeps a row in registers: K must be ≤ {_MAX_K}; got {x.shape[1]}.")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return call_op(_rmsnorm_quant_op, x, weight.contiguous(), float(eps), scale_format, bool(quantize))


# --------------------------------------------------------------------------------------------
# The residual add fused in front (the decode engine: h = h + o_proj(...), then the next norm)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("jetrl::add_rmsnorm_quant_fp8", mutates_args=(), device_types="cuda")
def _add_rmsnorm_quant_op(
    residual: torch.Tensor, delta: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
    scale_format: str, num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    jit = load_jit("_triton_fused_jit")
    m, k = residual.shape
    h = torch.empty_like(residual)
    y = torch.empty((m, k), dtype=torch.promote_types(residual.dtype, weight.dtype), device=residual.device)
    q = torch.empty((m, k), dtype=_FP8, device=residual.device)
    s = torch.empty((m, cdiv(k, _GROUP)), dtype=torch.float32, device=residual.device)
    if m == 0 or k == 0:
        return h, y, q, s
    block_k = max(_GROUP, 1 << (k - 1).bit_length())
    parts = delta.shape[0] if delta.dim() == 3 else 0
    jit.add_rmsnorm_quant_kernel[(m,)](
        residual, delta, bias if bias is not None else weight, weight, h, y, q.view(torch.uint8), s, m, k, float(k),
        eps, residual.stride(0), delta.stride(0) if parts == 0 else 0, h.stride(0), y.stride(0), q.stride(0),
        s.stride(0), PARTS=parts, HAS_BIAS=bias is not None, BLOCK_K=block_k, LEVELS=block_k.bit_length() - 2,
        GROUP=_GROUP, UE8M0=scale_format == "ue8m0", num_warps=num_warps or _add_norm_warps(block_k),
        enable_fp_fusion=False,  # as rmsnorm_quant_fp8 (and no FMA in the split sums)
    )  # fmt: skip
    return h, y, q, s


def _add_norm_warps(block_k: int) -> int:
    """Warps of the fused residual add + RMSNorm launch, by row width: up to 32 for rows of 4096. At
    decode it runs one program per row (16-64 programs), so wide programs keep more loads in flight
    (measured on the H200 against 8 and 4 warps: benchmarks/bench_decode_gemm.py --epilogue)."""
    return min(32, max(4, block_k // 128))


@_add_rmsnorm_quant_op.register_fake
def _(residual, delta, bias, weight, eps, scale_format, num_warps):
    m, k = residual.shape
    return (
        torch.empty_like(residual),
        residual.new_empty((m, k), dtype=torch.promote_types(residual.dtype, weight.dtype)),
        residual.new_empty((m, k), dtype=_FP8),
        residual.new_empty((m, cdiv(k, _GROUP)), dtype=torch.float32),
    )


def add_rmsnorm_quant_fp8(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
    bias: Optional[torch.Tensor] = None, scale_format: str = "fp32", num_warps: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``h = residual + delta`` and ``(y, q, s) = rmsnorm_quant_fp8(h, weight, eps)`` in one pass: ``(h, y, q, s)``.

    ``delta`` is ``[M, K]`` in ``residual``'s dtype, or the FP32 split-K partial sums ``[S, M, K]``
    (contiguous) of a decode GEMM (``triton_decode_gemm.fp8_decode_gemm_partials``), which are added
    in split order, plus ``bias``, and rounded to ``residual``'s dtype first: the same bits as that
    GEMM's own output followed by torch's add. ``bias`` only goes with partial sums. ``num_warps``: the
    launch's warps (None: by row width; a benchmark compares others)."""
    check_cuda_2d(residual, "residual")
    check_scale_format(scale_format)
    m, k = residual.shape
    if weight.dim() != 1 or weight.shape[0] != k or weight.device != residual.device:
        raise ValueError(f"weight must be a 1-D tensor of {k} elements on {residual.device}; got {tuple(weight.shape)}.")
    if k > _MAX_K:
        raise ValueError(f"add_rmsnorm_quant_fp8 keeps a row in registers: K must be ≤ {_MAX_K}; got {k}.")
    if delta.dim() == 3:
        if delta.dtype != torch.float32 or tuple(delta.shape[1:]) != (m, k) or not delta.is_contiguous():
            raise ValueError(f"split-K partial sums must be contiguous float32 [S, {m}, {k}]; got {delta.dtype} "
                             f"{tuple(delta.shape)}.")  # fmt: skip
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != k):
            raise ValueError(f"bias must be [{k}]; got {tuple(bias.shape)}.")
    else:
        if delta.shape != residual.shape or delta.dtype != residual.dtype or delta.device != residual.device:
            raise ValueError(f"delta must match residual ({residual.dtype} {tuple(residual.shape)}) or be FP32 split "
                             f"sums [S, M, K]; got {delta.dtype} {tuple(delta.shape)}.")  # fmt: skip
        if bias is not None:
            raise ValueError("bias goes with split-K partial sums only (add it to delta yourself).")
        delta = delta if delta.stride(-1) == 1 else delta.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    bias = bias.contiguous() if bias is not None else None
    if num_warps is not None and (num_warps < 1 or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be a power of two; got {num_warps}.")
    return call_op(_add_rmsnorm_quant_op, residual, delta, bias, weight.contiguous(), float(eps), scale_format,
                   num_warps or 0)  # fmt: skip


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
    rows = _rows_per_tile(block_k)
    tiles = cdiv(m, rows)
    sms = sm_count(x.device) if x.is_cuda else 2  # CPU: Triton's interpreter
    programs = min(tiles, 4 * sms)
    per_prog = cdiv(tiles, programs)
    programs = cdiv(tiles, per_prog)
    dw_part = torch.empty((programs, block_k), dtype=torch.float32, device=x.device)
    jit.rmsnorm_backward_kernel[(programs,)](
        x, weight, dy, dx, dw_part, m, k, float(k), eps, x.stride(0), dy.stride(0), dx.stride(0), per_prog,
        BLOCK_K=block_k, ROWS=rows, num_warps=min(16, max(4, rows * block_k // 512)),
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
