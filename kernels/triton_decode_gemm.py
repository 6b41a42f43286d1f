"""FP8 linear for decode-sized M: a split-K Triton GEMM on 128×128-block FP8 weights.

At decode (M = 1 to 64 rows) a linear is bound by reading its weight, and the general FP8 path
(scale-layout copies, a blockwise ``_scaled_mm`` with few tiles at small M) costs more in launches
and idle SMs than it saves in bytes. This GEMM splits K so that every SM streams weight tiles,
scales per 128-group as the other backends do, and adds the splits in a second small launch. Its
activation comes quantized 1×128: what a fused RMSNorm / SwiGLU producer, or the act-quant kernel,
hands over. See ``_triton_decode_gemm_jit.py`` for the kernel layout.

=============================  =======================================  ========================
operand                        shape / layout                           dtype
=============================  =======================================  ========================
``(x_q, x_s)``                 [M, K] and [M, ceil(K/128)]              fp8_e4m3fn, fp32
``w_q, w_s``                   [N, K] and [ceil(N/128), ceil(K/128)]    fp8_e4m3fn, fp32
``bias``                       [N] or None                              any float
output                         [M, N], contiguous                       ``out_dtype``
=============================  =======================================  ========================

Departure from ``QuantLinear``'s general path: the FP32 summation order of the GEMM only (per-group
scaling as the other backends, K split into partial sums added in a fixed order). The quantized
activation and weight are the same bits. The launch (tile sizes, K split) is planned from the
shapes and the caller's :class:`~jetrl_trainer.kernels.settings.DecodeGemmSettings` alone, no
autotuning: that would time kernels on the first call and break CUDA-graph capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from jetrl_trainer._choices import FLOAT_DTYPES, check_choice

from ._triton_support import call_op, cdiv, load_jit, sm_count
from .settings import DecodeGemmSettings

__all__ = [
    "fp8_decode_gemm_grouped", "fp8_decode_gemm_grouped_partials", "fp8_decode_gemm_nt", "fp8_decode_gemm_partials",
    "planned_splits",
]  # fmt: skip

_FP8 = torch.float8_e4m3fn
REDUCE_BLOCK = 1024  # elements per program of the split-K reduction


class DecodeGemmPlan(NamedTuple):
    """One launch: the M and N tiles, the K split (``splits`` programs of ``groups_per_split`` 128-wide
    K groups per output tile), whether W is the MMA's M operand, and Triton's warps and stages. Plain
    ints, so a custom op takes it as ``list[int]``."""

    block_m: int
    block_n: int
    groups_per_split: int
    splits: int
    swap: int
    num_warps: int
    num_stages: int


def balanced_splits(tiles: int, groups: int, most: int, sms: int, waves: int) -> int:
    """The K split (1 to ``most``) that leaves the busiest SM the fewest K groups to stream, with the
    programs spread evenly over ``sms`` SMs: ``cdiv(programs, sms) x groups per program``. Among equals
    the one whose program count is nearest ``waves`` per SM (enough loads in flight on every SM,
    fewer partial sums than a finer split), then the fewer splits.

    Splitting for ``waves`` programs per SM alone can leave some SMs a third program while others hold
    two (Qwen3-8B at M <= 64: q/k/v in 3 splits is 288 programs on 132 SMs); the busiest SM sets the
    time, and the balanced split measured faster (docs/performance.md)."""

    def cost(asked: int) -> tuple[int, int, int]:
        per = cdiv(groups, asked)
        programs = tiles * cdiv(groups, per)
        return cdiv(programs, sms) * per, abs(programs - waves * sms), asked

    return min(range(1, most + 1), key=cost)


def plan(m: int, n: int | Sequence[int], k: int, sms: int, settings: DecodeGemmSettings = DecodeGemmSettings()
         ) -> DecodeGemmPlan:  # fmt: skip
    """The launch of an ``[M, K] x [N, K]ᵀ`` GEMM on a GPU with ``sms`` SMs; ``n`` a sequence of widths
    for a grouped launch (each weight its own N tiles)."""
    block_m = max(16, min(settings.max_block_m, 1 << (max(m, 1) - 1).bit_length()))  # one M tile up to 64 rows
    widths = [n] if isinstance(n, int) else list(n)
    tiles = sum(cdiv(w, settings.block_n) for w in widths) * cdiv(m, block_m)
    groups = cdiv(k, 128)
    splits = balanced_splits(tiles, groups, cdiv(groups, settings.min_groups_per_split), sms, settings.waves)
    per_split = cdiv(groups, splits)
    return DecodeGemmPlan(block_m, settings.block_n, per_split, cdiv(groups, per_split),
                          int(block_m < settings.swap_below_m), settings.num_warps, settings.num_stages)  # fmt: skip


def planned_splits(m: int, widths: Sequence[int], k: int, device: torch.device,
                   settings: DecodeGemmSettings = DecodeGemmSettings()) -> int:  # fmt: skip
    """The K splits a launch of these shapes runs on ``device`` (1: the kernel writes its outputs itself)."""
    return plan(m, list(widths), k, sm_count(device), settings).splits


def _launch(x_q: Tensor, x_s: Tensor, segments: list[tuple], launch: DecodeGemmPlan,
            partials: Optional[Tensor] = None) -> None:  # fmt: skip
    """The GEMM (and the split-K reduction) for ``segments``: one to three ``(w_q, w_s, bias, out)``.
    ``partials`` (no biases; one segment's ``out`` = ``partials[0]``, a group's outs unused): the FP32
    ``[SPLITS, M, N_0 + N_1 + N_2]`` to write the split sums into, unreduced (with one split the
    kernel writes its FP32 result there)."""
    jit = load_jit("_triton_decode_gemm_jit")
    m, k = x_q.shape
    widths = [w_q.shape[0] for w_q, *_ in segments]
    splits, has_bias = launch.splits, segments[0][2] is not None
    # Segment 0 is the arguments of a single-weight launch; segments 1-2 follow (unused: segment 0's).
    args = [(w_q, w_s, bias if bias is not None else w_s, out, w_q.shape[0]) for w_q, w_s, bias, out in segments]
    w_q, w_s, bias, out, n = args[0]
    rest = [a for seg in args[1:] for a in seg]
    rest += [w_q, w_s, bias, out, 0] * (3 - len(args))
    total = sum(widths)
    grid = (sum(cdiv(w, launch.block_n) for w in widths), splits, cdiv(m, launch.block_m))
    if partials is not None:
        part = partials
    else:
        part = torch.empty((splits, m, total), dtype=torch.float32, device=x_q.device) if splits > 1 else out
    jit.fp8_decode_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, out, part, bias, m, n, k,
        x_q.stride(0), x_s.stride(0), w_q.stride(0), w_s.stride(0), out.stride(0), *rest,
        GROUPS_PER_SPLIT=launch.groups_per_split, SPLITS=splits, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        SWAP=bool(launch.swap), HAS_BIAS=has_bias, SEGMENTS=len(segments),
        # a grouped launch's partials: one split writes them too (a single weight's out is partials[0] itself)
        PARTIALS=partials is not None and len(segments) > 1,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if splits > 1 and partials is None:
        jit.splitk_reduce_kernel[(cdiv(m * total, REDUCE_BLOCK),)](
            part, bias, out, m, n, out.stride(0), *rest[2:5], *rest[7:10],
            SPLITS=splits, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK, SEGMENTS=len(segments), num_warps=4,
        )  # fmt: skip


# The custom ops take the host's plan as ints (an op cannot take a settings object); so their fake
# implementations read the K split from it and agree with the launch by construction.
@torch.library.custom_op("jetrl::fp8_decode_gemm_nt", mutates_args=(), device_types="cuda")
def _decode_gemm_op(
    x_q: Tensor, x_s: Tensor, w_q: Tensor, w_s: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype,
    launch: list[int],
) -> Tensor:  # fmt: skip
    m, n = x_q.shape[0], w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m and n:
        _launch(x_q, x_s, [(w_q, w_s, bias, out)], DecodeGemmPlan(*launch))
    return out


@torch.library.custom_op("jetrl::fp8_decode_gemm_grouped", mutates_args=(), device_types="cuda")
def _decode_grouped_op(
    x_q: Tensor, x_s: Tensor, w_qs: list[Tensor], w_ss: list[Tensor], biases: list[Optional[Tensor]],
    out_dtype: torch.dtype, launch: list[int],
) -> list[Tensor]:  # fmt: skip
    m = x_q.shape[0]
    outs = [torch.empty((m, w_q.shape[0]), dtype=out_dtype, device=x_q.device) for w_q in w_qs]
    if m:
        _launch(x_q, x_s, list(zip(w_qs, w_ss, biases, outs)), DecodeGemmPlan(*launch))
    return outs


@torch.library.custom_op("jetrl::fp8_decode_gemm_partials", mutates_args=(), device_types="cuda")
def _decode_partials_op(x_q: Tensor, x_s: Tensor, w_q: Tensor, w_s: Tensor, launch: list[int]) -> Tensor:
    launch = DecodeGemmPlan(*launch)
    m, n = x_q.shape[0], w_q.shape[0]
    parts = torch.empty((launch.splits, m, n), dtype=torch.float32, device=x_q.device)
    if m and n:
        _launch(x_q, x_s, [(w_q, w_s, None, parts[0])], launch, partials=parts)
    return parts


@torch.library.custom_op("jetrl::fp8_decode_gemm_grouped_partials", mutates_args=(), device_types="cuda")
def _decode_grouped_partials_op(x_q: Tensor, x_s: Tensor, w_qs: list[Tensor], w_ss: list[Tensor],
                                launch: list[int]) -> Tensor:  # fmt: skip
    launch = DecodeGemmPlan(*launch)
    m, widths = x_q.shape[0], [w_q.shape[0] for w_q in w_qs]
    parts = torch.empty((launch.splits, m, sum(widths)), dtype=torch.float32, device=x_q.device)
    if m:
        _launch(x_q, x_s, [(w_q, w_s, None, parts) for w_q, w_s in zip(w_qs, w_ss)], launch, partials=parts)
    return parts


@_decode_gemm_op.register_fake
def _(x_q, x_s, w_q, w_s, bias, out_dtype, launch):
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)


@_decode_grouped_op.register_fake
def _(x_q, x_s, w_qs, w_ss, biases, out_dtype, launch):
    return [x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype) for w_q in w_qs]


@_decode_partials_op.register_fake
def _(x_q, x_s, w_q, w_s, launch):
    return x_q.new_empty((DecodeGemmPlan(*launch).splits, x_q.shape[0], w_q.shape[0]), dtype=torch.float32)


@_decode_grouped_partials_op.register_fake
def _(x_q, x_s, w_qs, w_ss, launch):
    widths = [w_q.shape[0] for w_q in w_qs]
    return x_q.new_empty((DecodeGemmPlan(*launch).splits, x_q.shape[0], sum(widths)), dtype=torch.float32)


def _check_weight(w_q: Tensor, w_s: Tensor, k: int) -> None:
    if w_q.dtype != _FP8 or w_q.dim() != 2 or w_q.shape[1] != k or w_q.stride(-1) != 1 or not w_q.is_cuda:
        raise ValueError(f"w_q must be a CUDA float8_e4m3fn [N, {k}] with unit stride along K; got "
                         f"{w_q.dtype} {tuple(w_q.shape)} on {w_q.device}.")  # fmt: skip
    expected = (cdiv(w_q.shape[0], 128), cdiv(k, 128))
    if w_s.dtype != torch.float32 or tuple(w_s.shape) != expected or w_s.stride(-1) != 1:
        raise ValueError(f"w_s must be float32 {expected} (128x128 blocks, unit stride); got {w_s.dtype} "
                         f"{tuple(w_s.shape)}.")  # fmt: skip


def _check_count(weights: Sequence) -> None:
    if not 2 <= len(weights) <= 3:
        raise ValueError(f"a grouped decode GEMM takes 2 or 3 weights; got {len(weights)}.")


def _check_group(x_q: Tensor, x_s: Tensor, weights: Sequence[tuple[Tensor, Tensor]]) -> None:
    _check_count(weights)
    _check_prequantized(x_q, x_s)
    for w_q, w_s in weights:
        _check_weight(w_q, w_s, x_q.shape[1])
        if not (w_q.is_contiguous() and w_s.is_contiguous()):
            raise ValueError("the weights of a grouped decode GEMM must be contiguous.")


def _check_prequantized(x_q: Tensor, x_s: Tensor) -> None:
    if x_q.dtype != _FP8 or x_q.dim() != 2 or x_q.stride(-1) != 1 or not x_q.is_cuda:
        raise ValueError(f"x_q must be a 2-D CUDA float8_e4m3fn with unit stride; got {x_q.dtype} {tuple(x_q.shape)}.")
    m, k = x_q.shape
    if x_s.dtype != torch.float32 or tuple(x_s.shape) != (m, cdiv(k, 128)) or x_s.stride(-1) != 1:
        raise ValueError(f"x_s must be float32 {(m, cdiv(k, 128))} with unit stride; got {x_s.dtype} {tuple(x_s.shape)}.")


def _plan_for(x_q: Tensor, widths: Sequence[int], settings: DecodeGemmSettings) -> DecodeGemmPlan:
    return plan(x_q.shape[0], list(widths), x_q.shape[1], sm_count(x_q.device), settings)


def fp8_decode_gemm_nt(
    x_q: Tensor, x_s: Tensor, w_q: Tensor, w_s: Tensor, bias: Optional[Tensor] = None, *,
    out_dtype: torch.dtype = torch.bfloat16, settings: DecodeGemmSettings = DecodeGemmSettings(),
) -> Tensor:  # fmt: skip
    """``(x_q, x_s) ⊗ (w_q, w_s) + bias`` for an activation quantized 1×128 (e.g. by a fused RMSNorm +
    quant), in one launch (two if K is split)."""
    _check_prequantized(x_q, x_s)
    _check_weight(w_q, w_s, x_q.shape[1])
    check_choice("out_dtype", out_dtype, FLOAT_DTYPES)
    return call_op(_decode_gemm_op, x_q, x_s, w_q, w_s, bias, out_dtype, _plan_for(x_q, [w_q.shape[0]], settings))


def fp8_decode_gemm_partials(x_q: Tensor, x_s: Tensor, w_q: Tensor, w_s: Tensor, *,
                             settings: DecodeGemmSettings = DecodeGemmSettings()) -> Tensor:  # fmt: skip
    """:func:`fp8_decode_gemm_nt` without its split-K reduction: the FP32 partial sums ``[S, M, N]``
    (``S`` the planned K splits, 1 when K is not split), for a consumer that reduces them itself in
    split order (``triton_norm.add_rmsnorm_quant_fp8``: the reduction, the residual add and the next
    RMSNorm in one launch). Summed in order and rounded once, they give the bits of
    ``fp8_decode_gemm_nt`` with the same ``settings``."""
    _check_prequantized(x_q, x_s)
    _check_weight(w_q, w_s, x_q.shape[1])
    if not w_q.is_contiguous():
        raise ValueError("the weight of fp8_decode_gemm_partials must be contiguous.")
    return call_op(_decode_partials_op, x_q, x_s, w_q, w_s, _plan_for(x_q, [w_q.shape[0]], settings))


def fp8_decode_gemm_grouped(
    x_q: Tensor, x_s: Tensor, weights: Sequence[tuple[Tensor, Tensor]], biases: Sequence[Optional[Tensor]] = (),
    *, out_dtype: torch.dtype = torch.bfloat16, settings: DecodeGemmSettings = DecodeGemmSettings(),
) -> list[Tensor]:  # fmt: skip
    """:func:`fp8_decode_gemm_nt` of one prequantized activation with two or three weights (q/k/v,
    gate/up) in one launch: ``[x ⊗ w_0, x ⊗ w_1, ...]``. At decode each projection alone is too
    small to keep every SM streaming (k/v of an 8B model are 4 MB of FP8); together they fill the
    GPU with one launch and one reduction. Biases: all or none. Same operands, and per output the
    same math as separate calls; only the K split (summation order) may differ."""
    _check_count(weights)
    biases = list(biases) or [None] * len(weights)
    if len(biases) != len(weights) or len({b is None for b in biases}) != 1:
        raise ValueError("give a bias for every weight of a grouped decode GEMM, or none.")
    _check_group(x_q, x_s, weights)
    if len({b.dtype for b in biases if b is not None}) > 1:
        raise ValueError("the biases of a grouped decode GEMM must share one dtype.")
    check_choice("out_dtype", out_dtype, FLOAT_DTYPES)
    w_qs, w_ss = [w for w, _ in weights], [s for _, s in weights]
    launch = _plan_for(x_q, [w.shape[0] for w in w_qs], settings)
    return call_op(_decode_grouped_op, x_q, x_s, w_qs, w_ss, biases, out_dtype, launch)


def fp8_decode_gemm_grouped_partials(x_q: Tensor, x_s: Tensor, weights: Sequence[tuple[Tensor, Tensor]], *,
                                     settings: DecodeGemmSettings = DecodeGemmSettings()) -> Tensor:  # fmt: skip
    """:func:`fp8_decode_gemm_grouped` without its split-K reduction and biases: the FP32 partial sums
    ``[S, M, N_0 + N_1 (+ N_2)]``, the weights' columns side by side (``S`` the planned K splits, 1 when
    K is not split), for a consumer that reduces them itself
    (``triton_rope_append.rope_append_from_partials``: the q/k/v reduction inside the RoPE + KV-append
    launch). Summed in split order, plus each weight's bias, and rounded once, they give the bits of
    the grouped launch with the same ``settings``."""
    _check_group(x_q, x_s, weights)
    w_qs, w_ss = [w for w, _ in weights], [s for _, s in weights]
    launch = _plan_for(x_q, [w.shape[0] for w in w_qs], settings)
    return call_op(_decode_grouped_partials_op, x_q, x_s, w_qs, w_ss, launch)
