"""FP8 linear for decode-sized M: a split-K Triton GEMM on 128×128-block FP8 weights.

At decode (M = 1 to 64 rows) a linear is bound by reading its weight, and the general FP8 path
(an activation-quant kernel, scale-layout copies, a blockwise ``_scaled_mm`` with few tiles at
small M) costs more in launches and idle SMs than it saves in bytes. This GEMM splits K so that
every SM streams weight tiles, scales per 128-group as the other backends do, and adds the splits
in a second small launch. Its activation comes in two forms with the same bits:

* already quantized 1×128 (``fp8_decode_gemm_nt``): what a fused RMSNorm / SwiGLU producer, or
  the act-quant kernel, hands over; this is what ``QuantLinear`` runs in rollouts;
* unquantized (``fp8_decode_linear``): each program quantizes its K slice in the prologue with
  the very ``@triton.jit`` functions of ``act_quant_fp8`` (bit-identical to
  ``quantize_fp8_groups``). One launch fewer, but every N tile re-quantizes its slice, which
  measured slower on the H200 at every decode M (docs/history.md §7), so it is off by default
  (``PROLOGUE_MAX_M``).

See ``_triton_decode_gemm_jit.py`` for the kernel layout.

=============================  =======================================  ========================
operand                        shape / layout                           dtype
=============================  =======================================  ========================
``x``                          [M, K], unit stride along K              bf16 / fp16 / fp32
or ``(x_q, x_s)``              [M, K] and [M, ceil(K/128)]              fp8_e4m3fn, fp32
``w_q, w_s``                   [N, K] and [ceil(N/128), ceil(K/128)]    fp8_e4m3fn, fp32
``bias``                       [N] or None                              any float
output                         [M, N], contiguous                       ``out_dtype``
=============================  =======================================  ========================

Departure from ``QuantLinear``'s general path: the FP32 summation order of the GEMM only (per-group
scaling as the other backends, K split into partial sums added in a fixed order). The quantized
activation and weight are the same bits. Launch parameters depend on shapes alone (no autotuning:
it would time kernels on the first call and break CUDA-graph capture).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from jetrl_trainer._choices import FLOAT_DTYPES, check_choice

from ._triton_support import call_op, cdiv, check_scale_format, load_jit, pdl_launch, sm_count

__all__ = [
    "DECODE_MAX_M", "PROLOGUE_MAX_M", "fp8_decode_gemm_grouped", "fp8_decode_gemm_grouped_partials",
    "fp8_decode_gemm_nt", "fp8_decode_gemm_partials", "fp8_decode_linear", "planned_splits",
]  # fmt: skip

_FP8 = torch.float8_e4m3fn

# Rows up to which the FP8 linear of the rollout phase takes this kernel instead of the general
# path (benchmarks/bench_decode_gemm.py measures the crossover on the GPU at hand).
DECODE_MAX_M = 64

# Launch parameters, from the sweep in benchmarks/bench_decode_gemm.py on an H200 (prequantized
# activation, Qwen3-8B shapes): BLOCK_N weight rows per program; WAVES programs per SM that the K split
# aims for, each with at least MIN_GROUPS_PER_SPLIT 128-wide K groups; SWAP (W as the MMA's M
# operand) wins while the M tile is below 64 rows; warps; stages. MIN_GROUPS_PER_SPLIT = 4 (from 1)
# took the k/v projections (1024 x 4096) from 16 splits of 2 groups to 8 of 4: 7.2 -> 5.0 us at
# M = 16 and 8.7 -> 6.1 us at M = 64 on 2026-12-02; fewer, longer programs (one per SM) were
# slower on the 4096 x 12288 down projection (22.9 -> 31.0 us at M = 64), so WAVES stays 2.
# MAX_BLOCK_M bounds the M tile (a benchmark knob for M > 64, where DECODE_MAX_M sends QuantLinear elsewhere).
# PREFETCH_GROUPS: under programmatic dependent launch (_triton_support.programmatic_dependent_launch),
# the weight tiles of its first groups each program asks L2 for before it waits for the kernel before.
# TMA: load the weight (and a prequantized activation) through tensor descriptors instead of pointers
# (Hopper and newer; the same bits). Off: on the H200 it won only q/k/v at M = 16 (8.22 against 8.50 us)
# and never made the top four at M = 64 (docs/history.md §7, run 37).
# SCALE_AHEAD: 1 loads the activation / weight scales one K group ahead (the jit module's doc); the
# same bits (GPU test). H200, 8B shape, batch-64 decode step (run 46): the decode GEMMs 2.651 -> 2.627
# ms, the step 5.106 -> 5.067 ms in replay; neutral at batch 256.
# BALANCE: 1 picks the K split by the busiest SM instead (`balanced_splits`): if the programs spread
# evenly, an SM streams at most cdiv(programs, SMs) x groups-per-program K groups, and the WAVES rule
# can leave some SMs a third program while others hold two (8B shape, M <= 64: q/k/v 3 splits = 288
# programs, o and down 5 = 320). Balanced, those take 4 splits (384, 256, 256 programs: a busiest
# SM's groups 33 -> 24, 21 -> 16, 60 -> 48); gate/up keep one. On: H100, batch-64 decode step in
# replay (2026-12-05, run 48), the decode GEMMs 3.255 -> 3.179 ms, the step 6.024 -> 5.947 ms.
# PREFETCH_AHEAD: k > 0 asks L2 for the weight lines k K groups ahead in every iteration (the jit
# module's doc): more weight bytes in flight per program than the pipeline's stages hold, the same
# bits. Only launches that split K take it (the short q/k/v, o and down at decode): on the one-split
# gate/up launch at 64 rows it took the registers from 168 to 178 a thread (sm_90), two programs per
# SM instead of three. Off: slower (run 48, k = 4: the decode GEMMs 3.255 -> 3.523 ms).
# Triton's automatic warp specialization of the K loop (TMA producer warps, one 12-warp program per SM)
# kept the bits but made the batch-64 step's decode GEMMs 1.75x slower (2.65 -> 4.65 ms, run 46,
# docs/history.md §7), so it was removed.
LAUNCH = dict(BLOCK_N=64, WAVES=2, MIN_GROUPS_PER_SPLIT=4, SWAP_BELOW_M=64, num_warps=4, num_stages=3, MAX_BLOCK_M=64,
              PREFETCH_GROUPS=2, TMA=0, SCALE_AHEAD=1, BALANCE=1, PREFETCH_AHEAD=0)  # fmt: skip
# Up to this M a QuantLinear quantizes the activation in the GEMM's prologue. 0: never. Every N tile
# re-quantizes its K slice, so on the H200 the prologue was slower than one act-quant launch plus
# the prequantized GEMM at every decode M measured (1 to 64, Qwen3-8B shapes); it stays available
# (``fp8_decode_linear``, bit-identical) for GPUs or shapes where that differs.
PROLOGUE_MAX_M = 0
REDUCE_BLOCK = 1024


def balanced_splits(tiles: int, groups: int, most: int, sms: int, waves: int) -> int:
    """The K split (1 to ``most``) that leaves the busiest SM the fewest K groups to stream, with the
    programs spread evenly over ``sms`` SMs: ``cdiv(programs, sms) x groups per program``. Among equals
    the one whose program count is nearest ``waves`` per SM (enough loads in flight on every SM,
    fewer partial sums than a finer split), then the fewer splits."""

    def cost(asked: int) -> tuple[int, int, int]:
        per = cdiv(groups, asked)
        programs = tiles * cdiv(groups, per)
        return cdiv(programs, sms) * per, abs(programs - waves * sms), asked

    return min(range(1, most + 1), key=cost)


def plan(m: int, n: int | Sequence[int], k: int, sms: int, launch: Optional[dict] = None) -> dict:
    """Tile sizes and K split for an ``[M, K] x [N, K]ᵀ`` GEMM on a GPU with ``sms`` SMs; ``n`` a
    sequence of widths for a grouped launch (each weight its own N tiles)."""
    launch = {**LAUNCH, **(launch or {})}
    block_m = max(16, min(launch["MAX_BLOCK_M"], 1 << (max(m, 1) - 1).bit_length()))  # one M tile up to 64 rows
    block_n = launch["BLOCK_N"]
    widths = [n] if isinstance(n, int) else list(n)
    swap = block_m < launch["SWAP_BELOW_M"]
    tiles = sum(cdiv(w, block_n) for w in widths) * cdiv(m, block_m)
    groups = cdiv(k, 128)
    most = cdiv(groups, launch["MIN_GROUPS_PER_SPLIT"])
    if launch["BALANCE"]:
        splits = balanced_splits(tiles, groups, most, sms, launch["WAVES"])
    else:
        splits = max(1, min(most, cdiv(launch["WAVES"] * sms, tiles)))
    per_split = cdiv(groups, splits)
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, GROUPS_PER_SPLIT=per_split, SPLITS=cdiv(groups, per_split),
        SWAP=swap, num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        PREFETCH_GROUPS=min(launch["PREFETCH_GROUPS"], per_split), TMA=bool(launch["TMA"]),
        SCALE_AHEAD=bool(launch["SCALE_AHEAD"]),
        PREFETCH_AHEAD=launch["PREFETCH_AHEAD"] if cdiv(groups, per_split) > 1 else 0,  # split launches only
    )


@torch.library.custom_op("jetrl::fp8_decode_linear", mutates_args=(), device_types="cuda")
def _decode_linear_op(
    x: Tensor, x_s: Optional[Tensor], w_q: Tensor, w_s: Tensor, bias: Optional[Tensor],
    scale_format: str, out_dtype: torch.dtype, write_q: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    m, k = x.shape
    n = w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    quantize = x_s is None
    q = torch.empty((m, k) if write_q else (0,), dtype=_FP8, device=x.device)
    s = torch.empty((m, cdiv(k, 128)) if write_q else (0,), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out, q, s
    _launch(x, x_s, [(w_q, w_s, bias, out)], scale_format, q, s, write_q)
    return out, q, s


def _launch(x: Tensor, x_s: Optional[Tensor], segments: list[tuple], scale_format: str, q: Tensor, s: Tensor,
            write_q: bool, partials: Optional[Tensor] = None) -> None:  # fmt: skip
    """The GEMM (and the split-K reduction) for ``segments``: one to three ``(w_q, w_s, bias, out)``.
    ``partials`` (no biases; one segment's ``out`` = ``partials[0]``, a group's outs unused): the FP32
    ``[SPLITS, M, N_0 + N_1 + N_2]`` to write the split sums into, unreduced (with one split the
    kernel writes its FP32 result there)."""
    jit = load_jit("_triton_decode_gemm_jit")
    m, k = x.shape
    widths = [w_q.shape[0] for w_q, *_ in segments]
    cfg = plan(m, widths, k, sm_count(x.device))
    pdl = pdl_launch(x.device)
    if not pdl["PDL"]:
        cfg["PREFETCH_GROUPS"] = 0
    splits, quantize, has_bias = cfg["SPLITS"], x_s is None, segments[0][2] is not None
    # Segment 0 is the arguments of a single-weight launch; segments 1-2 follow (unused: segment 0's).
    args = [(w_q, w_s, bias if bias is not None else w_s, out, w_q.shape[0]) for w_q, w_s, bias, out in segments]
    w_q, w_s, bias, out, n = args[0]
    rest = [a for seg in args[1:] for a in seg]
    rest += [w_q, w_s, bias, out, 0] * (3 - len(args))
    total = sum(widths)
    cfg["TMA"] = cfg["TMA"] and tma_loads_apply(x if x_s is not None else None, [w for w, *_ in segments])
    descriptors = _descriptors(x, x_s, [w for w, *_ in segments], cfg) if cfg["TMA"] else [x, w_q, w_q, w_q]
    grid = (sum(cdiv(w, cfg["BLOCK_N"]) for w in widths), splits, cdiv(m, cfg["BLOCK_M"]))
    if partials is not None:
        part = partials
    else:
        part = torch.empty((splits, m, total), dtype=torch.float32, device=x.device) if splits > 1 else out
    # A grouped launch's partials: one split writes them too (a single weight's out is partials[0] itself).
    grouped_partials = {"PARTIALS": True} if partials is not None and len(segments) > 1 else {}
    jit.fp8_decode_gemm_kernel[grid](
        x, x_s if x_s is not None else w_s, w_q, w_s, out, part, bias, q.view(torch.uint8), s, m, n, k,
        x.stride(0), x_s.stride(0) if x_s is not None else 0, w_q.stride(0), w_s.stride(0), out.stride(0), *rest,
        *descriptors, QUANTIZE=quantize, HAS_BIAS=has_bias, WRITE_Q=write_q and quantize,
        UE8M0=scale_format == "ue8m0", SEGMENTS=len(segments), **cfg, **pdl, **grouped_partials,
    )  # fmt: skip
    if splits > 1 and partials is None:
        jit.splitk_reduce_kernel[(cdiv(m * total, REDUCE_BLOCK),)](
            part, bias, out, m, n, out.stride(0), *rest[2:5], *rest[7:10],
            SPLITS=splits, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK, SEGMENTS=len(segments), num_warps=4, **pdl,
        )  # fmt: skip


def planned_splits(m: int, widths: Sequence[int], k: int, device: torch.device) -> int:
    """The K splits a launch of these shapes runs on ``device`` (1: the kernel writes its outputs itself)."""
    return plan(m, list(widths), k, sm_count(device))["SPLITS"]


def tma_loads_apply(x_q: Optional[Tensor], weights: Sequence[Tensor]) -> bool:
    """Whether tensor-descriptor (TMA) loads can read these FP8 operands: a GPU with TMA (compute
    capability 9.0+), 16-byte aligned bases and row strides, unit stride along K."""
    operands = [t for t in (x_q, *weights) if t is not None]
    if not operands[0].is_cuda or torch.cuda.get_device_capability(operands[0].device)[0] < 9:
        return False
    return all(t.stride(-1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in operands)


def _descriptors(x: Tensor, x_s: Optional[Tensor], weights: list[Tensor], cfg: dict) -> list:
    """Host tensor descriptors: the activation's (prequantized; else a placeholder) and up to three weights'."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    w_descs = [TensorDescriptor.from_tensor(w, [cfg["BLOCK_N"], 128]) for w in weights]
    w_descs += [w_descs[0]] * (3 - len(w_descs))
    x_desc = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], 128]) if x_s is not None else w_descs[0]
    return [x_desc, *w_descs]


@torch.library.custom_op("jetrl::fp8_decode_gemm_grouped", mutates_args=(), device_types="cuda")
def _decode_grouped_op(
    x_q: Tensor, x_s: Tensor, w_qs: list[Tensor], w_ss: list[Tensor], biases: list[Optional[Tensor]],
    out_dtype: torch.dtype,
) -> list[Tensor]:  # fmt: skip
    m = x_q.shape[0]
    outs = [torch.empty((m, w_q.shape[0]), dtype=out_dtype, device=x_q.device) for w_q in w_qs]
    if m:
        empty = torch.empty((0,), dtype=torch.float32, device=x_q.device)
        _launch(x_q, x_s, list(zip(w_qs, w_ss, biases, outs)), "fp32", empty, empty, False)
    return outs


@torch.library.custom_op("jetrl::fp8_decode_gemm_partials", mutates_args=(), device_types="cuda")
def _decode_partials_op(x_q: Tensor, x_s: Tensor, w_q: Tensor, w_s: Tensor) -> Tensor:
    m, n = x_q.shape[0], w_q.shape[0]
    splits = planned_splits(m, [n], x_q.shape[1], x_q.device)
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=x_q.device)
    if m and n:
        empty = torch.empty((0,), dtype=torch.float32, device=x_q.device)
        _launch(x_q, x_s, [(w_q, w_s, None, parts[0])], "fp32", empty, empty, False, partials=parts)
    return parts


@torch.library.custom_op("jetrl::fp8_decode_gemm_grouped_partials", mutates_args=(), device_types="cuda")
def _decode_grouped_partials_op(x_q: Tensor, x_s: Tensor, w_qs: list[Tensor], w_ss: list[Tensor]) -> Tensor:
    m, widths = x_q.shape[0], [w_q.shape[0] for w_q in w_qs]
    splits = planned_splits(m, widths, x_q.shape[1], x_q.device)
    parts = torch.empty((splits, m, sum(widths)), dtype=torch.float32, device=x_q.device)
    if m:
        empty = torch.empty((0,), dtype=torch.float32, device=x_q.device)
        _launch(x_q, x_s, [(w_q, w_s, None, parts) for w_q, w_s in zip(w_qs, w_ss)], "fp32", empty, empty, False,
                partials=parts)  # fmt: skip
    return parts


@_decode_grouped_partials_op.register_fake
def _(x_q, x_s, w_qs, w_ss):
    m, widths = x_q.shape[0], [w_q.shape[0] for w_q in w_qs]
    splits = planned_splits(m, widths, x_q.shape[1], x_q.device)
    return x_q.new_empty((splits, m, sum(widths)), dtype=torch.float32)


@_decode_partials_op.register_fake
def _(x_q, x_s, w_q, w_s):
    m, n = x_q.shape[0], w_q.shape[0]
    splits = planned_splits(m, [n], x_q.shape[1], x_q.device)
    return x_q.new_empty((splits, m, n), dtype=torch.float32)


@_decode_grouped_op.register_fake
def _(x_q, x_s, w_qs, w_ss, biases, out_dtype):
    return [x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype) for w_q in w_qs]


@_decode_linear_op.register_fake
def _(x, x_s, w_q, w_s, bias, scale_format, out_dtype, write_q):
    m, k = x.shape
    out = x.new_empty((m, w_q.shape[0]), dtype=out_dtype)
    if write_q:
        return out, x.new_empty((m, k), dtype=_FP8), x.new_empty((m, cdiv(k, 128)), dtype=torch.float32)
    return out, x.new_empty((0,), dtype=_FP8), x.new_empty((0,), dtype=torch.float32)


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


def fp8_decode_linear(
    x: Tensor, w_q: Tensor, w_s: Tensor, bias: Optional[Tensor] = None, *, scale_format: str = "fp32",
    out_dtype: Optional[torch.dtype] = None, return_quantized: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(quantize_fp8_groups(x) ⊗ (w_q, w_s)) + bias`` for a CUDA ``x [M, K]``, in one launch (two if K is split).

    ``return_quantized=True`` (tests) also returns the activation quantization the prologue
    computed, ``(q [M, K], s [M, ceil(K/128)])``, which equals ``quantize_fp8_groups(x)`` bit for bit.
    """
    if not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a 2-D CUDA tensor with unit stride along K; got {tuple(x.shape)} on {x.device}.")
    check_choice("x dtype", x.dtype, FLOAT_DTYPES)
    check_scale_format(scale_format)
    _check_weight(w_q, w_s, x.shape[1])
    out_dtype = out_dtype or x.dtype
    check_choice("out_dtype", out_dtype, FLOAT_DTYPES)
    out, q, s = call_op(_decode_linear_op, x, None, w_q, w_s, bias, scale_format, out_dtype, return_quantized)
    return (out, q, s) if return_quantized else out


def fp8_decode_gemm_nt(
    x_q: Tensor, x_s: Tensor, w_q: Tensor, w_s: Tensor, bias: Optional[Tensor] = None, *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:  # fmt: skip
    """The same GEMM for an activation already quantized 1×128 (e.g. by a fused RMSNorm + quant)."""
    _check_prequantized(x_q, x_s)
    m, k = x_q.shape
    _check_weight(w_q, w_s, k)
    check_choice("out_dtype", out_dtype, FLOAT_DTYPES)
    return call_op(_decode_linear_op, x_q, x_s, w_q, w_s, bias, "fp32", out_dtype, False)[0]


def fp8_decode_gemm_partials(x_q: Tensor, x_s: Tensor, w_q: Tensor, w_s: Tensor) -> Tensor:
    """:func:`fp8_decode_gemm_nt` without its split-K reduction: the FP32 partial sums ``[S, M, N]``
    (``S`` the planned K splits, 1 when K is not split), for a consumer that reduces them itself in
    split order (``triton_norm.add_rmsnorm_quant_fp8``: the reduction, the residual add and the next
    RMSNorm in one launch). Summed in order and rounded once, they give the bits of
    ``fp8_decode_gemm_nt``."""
    _check_prequantized(x_q, x_s)
    _check_weight(w_q, w_s, x_q.shape[1])
    if not w_q.is_contiguous():
        raise ValueError("the weight of fp8_decode_gemm_partials must be contiguous.")
    return call_op(_decode_partials_op, x_q, x_s, w_q, w_s)


def fp8_decode_gemm_grouped(
    x_q: Tensor, x_s: Tensor, weights: Sequence[tuple[Tensor, Tensor]], biases: Sequence[Optional[Tensor]] = (),
    *, out_dtype: torch.dtype = torch.bfloat16,
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
    return call_op(_decode_grouped_op, x_q, x_s, w_qs, w_ss, biases, out_dtype)


def fp8_decode_gemm_grouped_partials(x_q: Tensor, x_s: Tensor, weights: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """:func:`fp8_decode_gemm_grouped` without its split-K reduction and biases: the FP32 partial sums
    ``[S, M, N_0 + N_1 (+ N_2)]``, the weights' columns side by side (``S`` the planned K splits, 1 when
    K is not split), for a consumer that reduces them itself
    (``triton_rope_append.rope_append_from_partials``: the q/k/v reduction inside the RoPE + KV-append
    launch). Summed in split
    order, plus each weight's bias, and rounded once, they give the bits of the grouped launch."""
    _check_group(x_q, x_s, weights)
    return call_op(_decode_grouped_partials_op, x_q, x_s, [w for w, _ in weights], [s for _, s in weights])
