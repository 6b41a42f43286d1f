"""FP8 E4M3 reference quantizers, in pure torch: the numerics contract (docs/architecture.md#numerics-contract).

Every other FP8 path — the Triton kernels, the rollout and the training forward — must reproduce
these functions bit for bit, so they are written for clarity, not speed.

* scale ``s = max(amax, 1e-10) * fp32(1/448)`` in FP32. The multiply is deliberate
  (docs/architecture.md#fp8-format-and-scales): on CUDA, ATen runs ``tensor / 448.0`` as a
  multiply by the FP32 reciprocal, so writing the multiply makes the CPU and CUDA references (and
  the kernels) agree bit for bit; the two definitions differ in the last bit of about half the scales;
* ``q = saturate(round_to_nearest_even(x / s))`` — a true division, never ``x * (1 / s)``,
  because the two differ in the last bit and kernels must match;
* optional ``ue8m0`` scale format: ``s`` rounded *up* to a power of two (DeepGEMM / Blackwell).
  Finite inputs saturate, never overflow: a group with amax above ``448 * 2^119`` (≈ 2.98e38) gets the
  largest scale ``2^120``, where ``q = 256`` would dequantize to ``2^128 = inf``; there ``q``
  saturates at ±240 instead (``240 * 2^120`` ≈ 3.19e38 is the largest finite ue8m0 value). With
  ``fp32`` scales ``q * s`` stays finite up to the float32 maximum without this;
* a ragged last group or block takes its amax over the elements present;
* an all-zero group gets scale ``1e-10 / 448`` and values 0; NaN/Inf are not clipped into finite
  numbers: a group holding one quantizes (and dequantizes) to non-finite values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from jetrl_trainer._choices import FLOAT_DTYPES, SCALE_FORMATS, check_choice

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_FORMATS",
    "dequantize_fp8_blocks",
    "dequantize_fp8_groups",
    "fp8_scale_from_amax",
    "quantize_fp8_blocks",
    "quantize_fp8_groups",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_AMAX_FLOOR = 1e-10
_INV_FP8_MAX = 1.0 / FP8_MAX  # rounded to FP32 by the multiply, as ATen's CUDA division does
_UE8M0_TOP = 2.0**120  # the largest power-of-two scale a finite amax can get (float32 max / 448 < 2^120)
_UE8M0_TOP_MAX = 240.0  # the largest E4M3 value q with q * 2^120 finite (256 * 2^120 = 2^128 overflows)


def fp8_scale_from_amax(amax: torch.Tensor, scale_format: str = "fp32") -> torch.Tensor:
    """FP32 dequantization scale for the given FP32 amax (``x ≈ q * scale``)."""
    check_choice("scale_format", scale_format, SCALE_FORMATS)
    scale = torch.clamp(amax.float(), min=_AMAX_FLOOR) * _INV_FP8_MAX  # clamp keeps NaN as NaN
    if scale_format == "ue8m0":
        # Round up to 2^k exactly: frexp gives scale = m * 2^e with m in [0.5, 1).
        mantissa, exponent = torch.frexp(scale)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
        scale = torch.where(torch.isfinite(scale), torch.ldexp(torch.ones_like(scale), exponent), scale)
    return scale


def _to_fp8(x_over_s: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    # The cast rounds to nearest even; whether it saturates differs by torch version and device,
    # so saturate explicitly (clamp keeps NaN as NaN). Under the top ue8m0 scale, saturate at 240 so
    # that q * scale stays finite (only ue8m0 can produce that scale; fp32 scales are all below it).
    if scale is None:
        return torch.clamp(x_over_s, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    limit = torch.where(scale == _UE8M0_TOP, _UE8M0_TOP_MAX, FP8_MAX)
    return torch.clamp(x_over_s, -limit, limit).to(FP8_DTYPE)


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer (e.g. 128); got {value!r}.")


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return F.pad(x, (0, pad)) if pad else x


def quantize_fp8_groups(
    x: torch.Tensor, group: int = 128, *, scale_format: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` in 1×``group`` groups along the last dim.

    Returns ``(q, scale)``: ``q`` is ``float8_e4m3fn`` shaped like ``x``; ``scale`` is FP32 shaped
    ``[..., ceil(K / group)]``. Each row is quantized on its own (batch invariant by construction).
    """
    check_choice("x dtype", x.dtype, FLOAT_DTYPES)
    check_choice("scale_format", scale_format, SCALE_FORMATS)
    _check_size("group", group)
    if x.dim() < 1:
        raise ValueError(f"x needs at least one dim; got shape {tuple(x.shape)}.")
    k = x.shape[-1]
    xf = _pad_last(x.float(), group)
    xg = xf.unflatten(-1, (-1, group))  # (..., G, group)
    scale = fp8_scale_from_amax(xg.abs().amax(dim=-1), scale_format)  # (..., G)
    q = _to_fp8(xg / scale.unsqueeze(-1), scale.unsqueeze(-1)).flatten(-2)[..., :k]
    return q, scale


def dequantize_fp8_groups(
    q: torch.Tensor, scale: torch.Tensor, group: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_groups` (up to the quantization error)."""
    _check_size("group", group)
    k = q.shape[-1]
    expected = (*q.shape[:-1], math.ceil(k / group))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected {expected} for q {tuple(q.shape)}, group={group}.")
    s = scale.float().repeat_interleave(group, dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


def quantize_fp8_blocks(
    w: torch.Tensor, block: int = 128, *, scale_format: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight ``w [N, K]`` in ``block``×``block`` tiles.

    Returns ``(q, scale_inv)``: ``q`` is ``float8_e4m3fn [N, K]``; ``scale_inv`` is FP32
    ``[ceil(N / block), ceil(K / block)]`` — the dequantization multiplier, named as in vLLM and
    transformers block-FP8 checkpoints.
    """
    check_choice("weight dtype", w.dtype, FLOAT_DTYPES)
    check_choice("scale_format", scale_format, SCALE_FORMATS)
    _check_size("block", block)
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features]; got shape {tuple(w.shape)}.")
    n, k = w.shape
    wf = _pad_last(_pad_last(w.float(), block).t(), block).t()  # (N', K')
    tiles = wf.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # (Nb, block, Kb, block)
    scale_inv = fp8_scale_from_amax(tiles.abs().amax(dim=(1, 3)), scale_format)  # (Nb, Kb)
    q = _to_fp8(tiles / scale_inv[:, None, :, None], scale_inv[:, None, :, None]).flatten(2).flatten(0, 1)[:n, :k]
    return q, scale_inv


def dequantize_fp8_blocks(
    q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_blocks` (up to the quantization error)."""
    _check_size("block", block)
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D; got shape {tuple(q.shape)}.")
    n, k = q.shape
    expected = (math.ceil(n / block), math.ceil(k / block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}; expected {expected} for q {(n, k)}, block={block}.")
    s = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (q.float() * s).to(dtype)
