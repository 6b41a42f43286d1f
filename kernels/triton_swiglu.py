"""SwiGLU (``silu(gate) * up``) + FP8 quantization in one kernel, bit-identical to its reference.

The reference is ``jetrl_trainer.quant.reference.swiglu_reference``: exactly ``F.silu(gate) * up``
in the input dtype, as Qwen3/Llama's MLP computes it. The kernel reproduces ATen's CUDA formula
``g / (1 + expf(-g))`` with the same libdevice ``expf`` and an IEEE division, so on CUDA it equals
the reference (and hence the unfused module) bit for bit; ``(q, s) == quantize_fp8_groups(h)`` as
computed on CUDA. On CPU the reference uses ATen's vectorised ``exp``, a different function, so
CPU and GPU results are not comparable bit for bit.

Layout: ``gate``, ``up`` ``[M, K]`` of one dtype (fp32/bf16/fp16, unit stride along K) on CUDA;
returns ``h [M, K]`` (that dtype), ``q [M, K] float8_e4m3fn``, ``s [M, ceil(K/128)] float32``,
all contiguous.
"""

from __future__ import annotations

import torch

from ._triton_support import call_op, cdiv, check_cuda_2d, check_scale_format, load_jit

__all__ = ["swiglu_quant_fp8"]

_FP8 = torch.float8_e4m3fn
_GROUP = 128


@torch.library.custom_op("jetrl::swiglu_quant_fp8", mutates_args=(), device_types="cuda")
def _swiglu_quant_op(
    gate: torch.Tensor, up: torch.Tensor, scale_format: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    jit = load_jit("_triton_fused_jit")
    m, k = gate.shape
    h = torch.empty((m, k), dtype=gate.dtype, device=gate.device)
    q = torch.empty((m, k), dtype=_FP8, device=gate.device)
    s = torch.empty((m, cdiv(k, _GROUP)), dtype=torch.float32, device=gate.device)
    if m == 0 or k == 0:
        return h, q, s
    groups_per_prog = 2 if cdiv(k, _GROUP) >= 2 else 1
    block_m = 8
    grid = (cdiv(m, block_m), cdiv(cdiv(k, _GROUP), groups_per_prog))
    jit.swiglu_quant_kernel[grid](
        gate, up, h, q.view(torch.uint8), s, m, k,
        gate.stride(0), up.stride(0), h.stride(0), q.stride(0), s.stride(0),
        GROUP=_GROUP, BLOCK_M=block_m, GROUPS_PER_PROG=groups_per_prog, UE8M0=scale_format == "ue8m0",
        num_warps=4,
        enable_reflect_ftz=False,  # libdevice expf without flush-to-zero, as nvcc builds ATen's
    )
    return h, q, s


@_swiglu_quant_op.register_fake
def _(gate, up, scale_format):
    m, k = gate.shape
    return (
        gate.new_empty((m, k)),
        gate.new_empty((m, k), dtype=_FP8),
        gate.new_empty((m, cdiv(k, _GROUP)), dtype=torch.float32),
    )


def swiglu_quant_fp8(
    gate: torch.Tensor, up: torch.Tensor, *, scale_format: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``h = swiglu_reference(gate, up)`` and ``(q, s) = quantize_fp8_groups(h)``, in one pass."""
    check_cuda_2d(gate, "gate")
    check_cuda_2d(up, "up")
    check_scale_format(scale_format)
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate and up must match in shape, dtype and device; got {tuple(gate.shape)} {gate.dtype} {gate.device} "
            f"and {tuple(up.shape)} {up.dtype} {up.device}."
        )
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    return call_op(_swiglu_quant_op, gate, up, scale_format)
