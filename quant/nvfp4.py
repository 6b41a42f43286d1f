"""NVFP4 reference quantizer (emulated), in pure torch.

NVFP4 stores E2M1 values ``±{0, .5, 1, 1.5, 2, 3, 4, 6}`` in blocks of 16 along the last (reduction)
dim; each block has an E4M3 scale, and an FP32 *outer* scale sits on top. Dequantized value:
``e2m1 * float(block_scale) * outer``. Hopper has no FP4 tensor cores, so everything here is
emulated: the GEMM dequantizes to FP32 (see :mod:`jetrl_trainer.quant.linear`).

How we depart from plain NVFP4 and why:

* outer scale **per token** for activations (``outer="token"``: one FP32 per row), not per tensor.
  A per-tensor amax depends on the whole batch: a padded or later token could change how an
  earlier token is quantized, which breaks batch invariance and leaks future tokens into past ones.
  Weights keep the standard per-tensor outer scale (``outer="tensor"``).
* "Four over six" (Cook et al., 2025, arXiv:2512.02010, ``mit-han-lab/fouroversix``): every block
  is encoded twice, once with its amax mapped to 6 and once mapped to 4, and the encoding with the
  smaller sum of squared dequantization errors is kept (ties keep 6). Mapping to 4 makes the
  block's grid near its maximum finer (4 → 6 is a step of 2). As in the paper, with four-over-six
  the outer scale maps the amax to ``6 * 256`` instead of ``6 * 448``, so a block scale ``≤ 256``
  (max → 6) times 1.5 (max → 4) stays ``≤ 384`` and never overflows E4M3. Without four-over-six
  the standard ``6 * 448`` is used.
* rounding onto the E2M1 grid is round-to-nearest, ties to the even mantissa (0.25 → 0, 0.75 → 1,
  1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4), saturating at ±6. Block scales are rounded
  to E4M3 by torch's cast (nearest even), clamped at 448. A block whose scale underflows to 0
  encodes as zeros.

Formulas (amax over the row for ``token``, over the tensor for ``tensor``)::

    outer  = max(amax, 1e-10) / (6 * M)          # M = 256 with four-over-six, else 448
    sb_t   = e4m3(min(block_amax / (t * outer), 448))          # t = 6, or 4 for the second candidate
    q_t    = rne_e2m1(x / (float(sb_t) * outer))  (0 where sb_t == 0)
    err_t  = sum((q_t * (float(sb_t) * outer) - x) ** 2)        # per block

Ragged last dims are zero-padded to a multiple of 16; padding never changes an amax and always
encodes exactly as 0. Non-finite values are not clipped: a NaN or Inf makes its outer scale or
block scale non-finite, so the whole row (``token``) or tensor (``tensor``) dequantizes to
non-finite values and the trainer sees it.

Storage: two 4-bit codes per ``uint8`` (element ``2i`` in the low nibble), code = ``sign << 3 |
index into the E2M1 grid``, which is exactly the E2M1 bit pattern.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jetrl_trainer._choices import FLOAT_DTYPES, NVFP4_OUTERS, check_choice

__all__ = [
    "E2M1_GRID",
    "E2M1_MAX",
    "NVFP4_BLOCK",
    "NVFP4_OUTERS",
    "NVFP4Tensor",
    "dequantize_nvfp4",
    "quantize_nvfp4",
    "round_to_e2m1",
]

E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
_E4M3_MAX = 448.0
_E4M3_MAX_FOUR_OVER_SIX = 256.0  # leaves room for the ×1.5 of the "max → 4" candidate
_AMAX_FLOOR = 1e-10


@dataclass(frozen=True)
class NVFP4Tensor:
    """An NVFP4-quantized tensor of logical shape ``shape = (..., K)``.

    ``data``: ``uint8 [..., ceil(K/16) * 8]``, two E2M1 codes per byte (low nibble first).
    ``block_scale``: ``float8_e4m3fn [..., ceil(K/16)]``.
    ``outer_scale``: FP32, ``[..., 1]`` for ``outer="token"``, ``[]`` for ``outer="tensor"``.
    """

    data: torch.Tensor
    block_scale: torch.Tensor
    outer_scale: torch.Tensor
    shape: tuple[int, ...]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three storage tensors (e.g. for ``ctx.save_for_backward``)."""
        return self.data, self.block_scale, self.outer_scale


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to the even mantissa), saturating at ±6; FP32 out.

    The grid has step 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]; rounding ``x / step`` half to
    even gives even multiples exactly at the even mantissas, so ``torch.round`` is the tie rule.
    """
    mag = x.float().abs()
    fine = torch.round(mag * 2) / 2
    mid = torch.round(mag)
    coarse = torch.round(mag / 2) * 2
    rounded = torch.where(mag < 2, fine, torch.where(mag < 4, mid, coarse)).clamp(max=E2M1_MAX)
    return torch.copysign(rounded, x.float())


@functools.lru_cache(maxsize=None)
def _grid(device: torch.device) -> torch.Tensor:
    # Built once per device: a host-to-device copy in every forward would stall the GPU stream.
    return torch.tensor(E2M1_GRID, device=device)


def _encode(values: torch.Tensor) -> torch.Tensor:
    """E2M1 grid values (FP32) -> 4-bit codes (uint8, one per element)."""
    grid = _grid(values.device)
    index = torch.bucketize(torch.nan_to_num(values.abs(), nan=0.0), grid).clamp(max=7)
    return (index | (torch.signbit(values).to(index.dtype) << 3)).to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _code_table(device: torch.device) -> torch.Tensor:
    grid = _grid(device)
    return torch.cat([grid, -grid])  # codes 8..15 are the negatives (8 is -0)


def _decode(codes: torch.Tensor) -> torch.Tensor:
    return _code_table(codes.device)[codes.long()]


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(data: torch.Tensor) -> torch.Tensor:
    return torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)


def _encode_blocks(
    blocks: torch.Tensor, block_amax: torch.Tensor, outer: torch.Tensor, target: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One candidate encoding with each block's amax mapped to ``target`` (6 or 4)."""
    scale_hp = block_amax / (target * outer)
    block_scale = torch.clamp(scale_hp, max=_E4M3_MAX).to(torch.float8_e4m3fn)  # clamp keeps NaN
    step = (block_scale.float() * outer).unsqueeze(-1)  # (..., B, 1) dequantization multiplier
    values = round_to_e2m1(torch.where(step != 0, blocks / step, 0.0))
    err = ((values * step - blocks) ** 2).sum(dim=-1)
    return values, block_scale, err


def quantize_nvfp4(x: torch.Tensor, *, outer: str = "token", four_over_six: bool = True) -> NVFP4Tensor:
    """Quantize ``x [..., K]`` to NVFP4 with 1×16 blocks along the last dim.

    ``outer="token"`` gives every row its own FP32 outer scale (activations: batch invariant);
    ``outer="tensor"`` one for the whole tensor (weights). See the module docstring for the recipe.
    """
    check_choice("x dtype", x.dtype, FLOAT_DTYPES)
    check_choice("outer", outer, NVFP4_OUTERS)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x needs a non-empty last dim (the blocked one); got shape {tuple(x.shape)}.")
    xf = x.float()
    pad = (-xf.shape[-1]) % NVFP4_BLOCK
    blocks = (F.pad(xf, (0, pad)) if pad else xf).unflatten(-1, (-1, NVFP4_BLOCK))  # (..., B, 16)
    block_amax = blocks.abs().amax(dim=-1)  # (..., B)
    if outer == "token":
        amax = block_amax.amax(dim=-1, keepdim=True)  # (..., 1)
    else:
        amax = block_amax.amax() if block_amax.numel() else block_amax.new_zeros(())
    outer_max = _E4M3_MAX_FOUR_OVER_SIX if four_over_six else _E4M3_MAX
    outer_scale = torch.clamp(amax, min=_AMAX_FLOOR) / (E2M1_MAX * outer_max)
    values, block_scale, err6 = _encode_blocks(blocks, block_amax, outer_scale, 6.0)
    if four_over_six:
        values4, block_scale4, err4 = _encode_blocks(blocks, block_amax, outer_scale, 4.0)
        pick4 = err4 < err6  # (..., B); a tie keeps the standard encoding
        values = torch.where(pick4.unsqueeze(-1), values4, values)
        block_scale = torch.where(pick4, block_scale4, block_scale)
    data = _pack(_encode(values.flatten(-2)))
    return NVFP4Tensor(data=data, block_scale=block_scale, outer_scale=outer_scale, shape=tuple(x.shape))


def dequantize_nvfp4(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``e2m1 * float(block_scale) * outer`` back to ``t.shape`` in ``dtype``."""
    if not isinstance(t, NVFP4Tensor):
        raise ValueError(f"expected an NVFP4Tensor (from quantize_nvfp4); got {type(t).__name__}.")
    values = _decode(_unpack(t.data)).unflatten(-1, (-1, NVFP4_BLOCK))  # (..., B, 16)
    step = (t.block_scale.float() * t.outer_scale).unsqueeze(-1)  # same product as when encoding
    out = (values * step).flatten(-2)[..., : t.shape[-1]]
    return out.to(dtype)
