"""Triton FP8 quantization kernels: bit-identical to ``jetrl_trainer.quant.fp8`` on CUDA.

The references these kernels must reproduce are the pure-torch functions in ``quant/fp8.py``
(run on the same CUDA input); the GPU tests compare every output bit. Each host wrapper is a
``torch.library.custom_op`` with a fake implementation, so it traces under ``torch.compile`` and
can be captured in a CUDA graph: no host syncs, shapes only from metadata.

Memory layouts (outputs row-major/contiguous; ``weight_quant_fp8`` and ``transpose_fp8_blocks`` also
write into given ``out`` tensors, which a weight-cache refresh uses):

=========================  ======================================  ==================================
function                   inputs                                  outputs
=========================  ======================================  ==================================
``act_quant_fp8``          x [M, K] (fp32/bf16/fp16, any           q [M, K] fp8_e4m3fn,
                           strides)                                 s [M, ceil(K/g)] fp32
``weight_quant_fp8``       w [N, K]                                q [N, K], s_inv [ceil(N/b), ceil(K/b)]
``requant_transpose_fp8``  q [M, K] fp8, s [M, ceil(K/g)]           qt [K, M], st [K, ceil(M/g)]
``transpose_fp8_blocks``   q [N, K] fp8, s_inv [Nb, Kb]             q.t() [K, N], s_inv.t() [Kb, Nb]
=========================  ======================================  ==================================

Departure from the reference: none in values. The kernels only accept CUDA tensors and power-of-two
group sizes in [16, 1024]; ``jetrl_trainer.quant._dispatch`` falls back to the reference elsewhere.

Launch parameters (tile sizes, warps) come from a :class:`~jetrl_trainer.kernels.settings.QuantKernelSettings`
that the caller passes (an FP8 recipe's ``kernels``); they change speed only, never a bit.
"""

from __future__ import annotations

import torch

from ._triton_support import call_op, cdiv, check_cuda_2d, check_group, check_scale_format, load_jit
from .settings import QuantKernelSettings

__all__ = ["act_quant_fp8", "out_layout_error", "requant_transpose_fp8", "transpose_fp8_blocks", "weight_quant_fp8"]

_FP8 = torch.float8_e4m3fn


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# --------------------------------------------------------------------------------------------
# act_quant_fp8: 1 x group along K
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("jetrl::act_quant_fp8", mutates_args=(), device_types="cuda")
def _act_quant_op(
    x: torch.Tensor, group: int, scale_format: str, launch: list[int], launch_transposed: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    jit = load_jit("_triton_quant_jit")
    m, k = x.shape
    q = torch.empty((m, k), dtype=_FP8, device=x.device)
    s = torch.empty((m, cdiv(k, group)), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    block_m, groups_per_prog, warps = launch_transposed if x.stride(0) == 1 and m > 1 else launch
    groups_per_prog = min(groups_per_prog, 1 << (cdiv(k, group) - 1).bit_length())
    block_m = max(1, block_m * 128 // group)  # the same tile size for other group sizes
    grid = (cdiv(m, block_m), cdiv(cdiv(k, group), groups_per_prog))
    jit.act_quant_kernel[grid](
        x, q.view(torch.uint8), s, m, k, x.stride(0), x.stride(1), q.stride(0), s.stride(0),
        GROUP=group, BLOCK_M=block_m, GROUPS_PER_PROG=groups_per_prog, UE8M0=scale_format == "ue8m0",
        num_warps=warps,
    )
    return q, s


@_act_quant_op.register_fake
def _(x, group, scale_format, launch, launch_transposed):
    m, k = x.shape
    return x.new_empty((m, k), dtype=_FP8), x.new_empty((m, cdiv(k, group)), dtype=torch.float32)


def act_quant_fp8(
    x: torch.Tensor, *, group: int = 128, scale_format: str = "fp32",
    settings: QuantKernelSettings = QuantKernelSettings(),
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """1×``group`` activation quantization along the last dim; == ``quantize_fp8_groups`` bit for bit.

    ``x`` is a CUDA tensor ``[M, K]`` (fp32/bf16/fp16) with any strides — pass ``dy.t()`` directly
    rather than ``dy.t().contiguous()``: the kernel reads the transposed view coalesced, saving a
    copy (launched with ``settings.act_transposed``, other inputs with ``settings.act``). Returns
    ``q [M, K] float8_e4m3fn`` and ``s [M, ceil(K/group)] float32``, both contiguous.
    """
    check_cuda_2d(x, "x")
    check_group(group)
    check_scale_format(scale_format)
    return call_op(_act_quant_op, x, group, scale_format, list(settings.act), list(settings.act_transposed))


# --------------------------------------------------------------------------------------------
# weight_quant_fp8: block x block tiles
# --------------------------------------------------------------------------------------------
def _launch_weight_quant(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int, scale_format: str,
                         warps: int) -> None:  # fmt: skip
    n, k = w.shape
    if n == 0 or k == 0:
        return
    load_jit("_triton_quant_jit").weight_quant_kernel[(s.shape[0], s.shape[1])](
        w, q.view(torch.uint8), s, n, k, w.stride(0), q.stride(0), s.stride(0),
        BLOCK=block, UE8M0=scale_format == "ue8m0", num_warps=warps,
    )


@torch.library.custom_op("jetrl::weight_quant_fp8", mutates_args=(), device_types="cuda")
def _weight_quant_op(w: torch.Tensor, block: int, scale_format: str, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    q = torch.empty((n, k), dtype=_FP8, device=w.device)
    s = torch.empty((cdiv(n, block), cdiv(k, block)), dtype=torch.float32, device=w.device)
    _launch_weight_quant(w, q, s, block, scale_format, warps)
    return q, s


@_weight_quant_op.register_fake
def _(w, block, scale_format, warps):
    n, k = w.shape
    return w.new_empty((n, k), dtype=_FP8), w.new_empty((cdiv(n, block), cdiv(k, block)), dtype=torch.float32)


# Writes into tensors it is given: a weight-cache refresh keeps its tensors (a captured CUDA graph
# reads them) without a second pass copying a fresh result over them.
@torch.library.custom_op("jetrl::weight_quant_fp8_into", mutates_args=("q", "s"), device_types="cuda")
def _weight_quant_into_op(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int, scale_format: str,
                          warps: int) -> None:  # fmt: skip
    _launch_weight_quant(w, q, s, block, scale_format, warps)


def out_layout_error(out, like: torch.Tensor, shapes, dtypes=(_FP8, torch.float32)) -> str | None:
    """Why ``out`` cannot take the ``(q, s)`` pair of ``shapes`` for ``like``'s device, or None if it can."""
    if len(out) != len(shapes):
        return f"{len(out)} tensors, not {len(shapes)}"
    for t, shape, dtype, name in zip(out, shapes, dtypes, ("first", "second")):
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != like.device or not t.is_contiguous():
            return (f"the {name} tensor must be a contiguous {dtype} {tuple(shape)} on {like.device}; got "
                    f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")  # fmt: skip
    return None


def _check_out(out, like: torch.Tensor, shapes, what: str) -> None:
    error = out_layout_error(out, like, shapes)
    if error is not None:
        raise ValueError(f"{what} out: {error}.")


def weight_quant_fp8(
    w: torch.Tensor, *, block: int = 128, scale_format: str = "fp32",
    out: tuple[torch.Tensor, torch.Tensor] | None = None, settings: QuantKernelSettings = QuantKernelSettings(),
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``block``×``block`` weight quantization; == ``quantize_fp8_blocks`` bit for bit.

    ``w`` is a CUDA tensor ``[N, K]`` (unit stride along K). Returns ``q [N, K] float8_e4m3fn`` and
    ``s_inv [ceil(N/block), ceil(K/block)] float32`` (the dequantization multiplier), contiguous:
    fresh tensors, or ``out`` written in place and returned. Launched with ``settings.weight_warps``.
    """
    check_cuda_2d(w, "weight")
    check_group(block, "block")
    check_scale_format(scale_format)
    w = _unit_stride(w)
    if out is None:
        return call_op(_weight_quant_op, w, block, scale_format, settings.weight_warps)
    n, k = w.shape
    _check_out(out, w, ((n, k), (cdiv(n, block), cdiv(k, block))), "weight_quant_fp8")
    call_op(_weight_quant_into_op, w, out[0], out[1], block, scale_format, settings.weight_warps)
    return out[0], out[1]


# --------------------------------------------------------------------------------------------
# requant_transpose_fp8: the WGrad operand, re-grouped along tokens
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("jetrl::requant_transpose_fp8", mutates_args=(), device_types="cuda")
def _requant_transpose_op(
    q: torch.Tensor, s: torch.Tensor, group: int, scale_format: str, block_k: int, warps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    jit = load_jit("_triton_quant_jit")
    m, k = q.shape
    qt = torch.empty((k, m), dtype=_FP8, device=q.device)
    st = torch.empty((k, cdiv(m, group)), dtype=torch.float32, device=q.device)
    if m == 0 or k == 0:
        return qt, st
    block_k = min(group, block_k)  # (group x block_k) tile; the transpose goes through shared memory
    # Four tokens per 32-bit word through the transpose where qt's rows hold whole words: measured
    # faster than moving single bytes (docs/performance.md); other M take the byte transpose.
    pack4 = m % 4 == 0 and group % 4 == 0
    out, out_row = (qt.view(torch.int32), m // 4) if pack4 else (qt.view(torch.uint8), qt.stride(0))
    jit.requant_transpose_kernel[(cdiv(m, group), cdiv(k, block_k))](
        q.view(torch.uint8), s, out, st, m, k, q.stride(0), s.stride(0), out_row, st.stride(0),
        GROUP=group, BLOCK_K=block_k, UE8M0=scale_format == "ue8m0", PACK4=pack4, num_warps=warps,
    )
    return qt, st


@_requant_transpose_op.register_fake
def _(q, s, group, scale_format, block_k, warps):
    m, k = q.shape
    return q.new_empty((k, m), dtype=_FP8), q.new_empty((k, cdiv(m, group)), dtype=torch.float32)


def requant_transpose_fp8(
    q: torch.Tensor, s: torch.Tensor, *, group: int = 128, scale_format: str = "fp32",
    settings: QuantKernelSettings = QuantKernelSettings(),
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Dequantize → transpose → re-quantize 1×``group`` along the old rows (tokens), fused.

    == ``quantize_fp8_groups(dequantize_fp8_groups(q, s, group).t().contiguous(), group)``.
    ``q [M, K] float8_e4m3fn`` (unit stride along K) with ``s [M, ceil(K/group)] float32``;
    returns ``qt [K, M] float8_e4m3fn`` and ``st [K, ceil(M/group)] float32``, both contiguous.
    Launched with ``settings.requant_block_k`` and ``settings.requant_warps``.
    """
    check_cuda_2d(q, "q", (_FP8,))
    check_cuda_2d(s, "s", (torch.float32,))
    check_group(group)
    check_scale_format(scale_format)
    expected = (q.shape[0], cdiv(q.shape[1], group))
    if tuple(s.shape) != expected:
        raise ValueError(f"s has shape {tuple(s.shape)}; expected {expected} for q {tuple(q.shape)}, group={group}.")
    return call_op(_requant_transpose_op, _unit_stride(q), _unit_stride(s), group, scale_format,
                   settings.requant_block_k, settings.requant_warps)  # fmt: skip


# --------------------------------------------------------------------------------------------
# transpose_fp8_blocks: the DGrad operand (no re-quantization)
# --------------------------------------------------------------------------------------------
def _launch_transpose_blocks(q: torch.Tensor, qt: torch.Tensor, launch: list[int]) -> None:
    n, k = q.shape
    if n and k:
        block_r, block_c, warps = launch
        load_jit("_triton_quant_jit").transpose_u8_kernel[(cdiv(n, block_r), cdiv(k, block_c))](
            q.view(torch.uint8), qt.view(torch.uint8), n, k, q.stride(0), qt.stride(0),
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
        )


@torch.library.custom_op("jetrl::transpose_fp8_blocks", mutates_args=(), device_types="cuda")
def _transpose_blocks_op(q: torch.Tensor, s_inv: torch.Tensor, launch: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = q.shape
    qt = torch.empty((k, n), dtype=_FP8, device=q.device)
    _launch_transpose_blocks(q, qt, launch)
    # A fresh tensor even when the transpose is a no-op view (custom ops may not alias inputs).
    return qt, s_inv.t().clone(memory_format=torch.contiguous_format)


@_transpose_blocks_op.register_fake
def _(q, s_inv, launch):
    n, k = q.shape
    return q.new_empty((k, n)), s_inv.new_empty((s_inv.shape[1], s_inv.shape[0]))


@torch.library.custom_op("jetrl::transpose_fp8_blocks_into", mutates_args=("qt", "st"), device_types="cuda")
def _transpose_blocks_into_op(
    q: torch.Tensor, s_inv: torch.Tensor, qt: torch.Tensor, st: torch.Tensor, launch: list[int]
) -> None:
    _launch_transpose_blocks(q, qt, launch)
    st.copy_(s_inv.t())


def transpose_fp8_blocks(
    q: torch.Tensor, s_inv: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
    settings: QuantKernelSettings = QuantKernelSettings(),
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(q.t().contiguous(), s_inv.t().contiguous())`` for a 128×128-block FP8 weight.

    ``q [N, K] float8_e4m3fn``, ``s_inv [Nb, Kb] float32``; returns ``[K, N]`` and ``[Kb, Nb]``,
    contiguous (fresh, or ``out`` written in place and returned). Transposing a block grid needs no
    re-quantization, so the values are unchanged. Launched with ``settings.transpose``.
    """
    check_cuda_2d(q, "q", (_FP8,))
    check_cuda_2d(s_inv, "s_inv", (torch.float32,))
    q = _unit_stride(q)
    if out is None:
        return call_op(_transpose_blocks_op, q, s_inv, list(settings.transpose))
    shapes = ((q.shape[1], q.shape[0]), (s_inv.shape[1], s_inv.shape[0]))
    _check_out(out, q, shapes, "transpose_fp8_blocks")
    call_op(_transpose_blocks_into_op, q, s_inv, out[0], out[1], list(settings.transpose))
    return out[0], out[1]
