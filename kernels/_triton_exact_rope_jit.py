"""``@triton.jit`` RoPE with eager ``apply_rotary_pos_emb``'s bits (imported only when Triton is present).

One program per (position, head) over the query heads then the key heads, so a position's bits depend on
its own q / k, cos and sin only, never on how many positions or heads the launch holds (no reductions;
``T`` is not specialized on). Each element computes ``x * cos + rotate_half(x) * sin`` with eager's
roundings: the inputs widened to FP32 (exact), each product in FP32 rounded to the output dtype, their
sum in FP32 rounded to the output dtype. A product of two BF16 (or FP16) values is exact in FP32, so
those are eager's BF16 (FP16) ops; for FP32 the launch disables FMA contraction (see the launcher).

BF16 is rounded to nearest even by hand (`_round_to`): Triton's interpreter truncates a float -> BF16
cast (and rounds ties away from zero with ``rtne``), so the interpreter tests could not check eager's
BF16 bits otherwise; integer ops give the same bits compiled and interpreted.
"""

import triton
import triton.language as tl


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """FP32 ``x`` rounded to ``dtype`` to nearest, ties to even, as ATen rounds a BF16 / FP16 result."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # carry into the exponent is the right result
        bits = tl.where(x != x, 0x7FC0, bits)  # NaN stays a (quiet) NaN
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rotate_head(x_ptr, out_ptr, cos, sin, d, partner_d, in_head, HALF: tl.constexpr):
    """One head vector: ``out = x * cos + rotate_half(x) * sin`` in ``out``'s dtype, eager's roundings."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + d, mask=in_head, other=0.0).to(tl.float32)
    partner = tl.load(x_ptr + partner_d, mask=in_head, other=0.0).to(tl.float32)
    rotated = tl.where(d < HALF, -partner, partner)  # rotate_half: cat(-x2, x1), exact
    with_cos = _round_to(x * cos, dtype).to(tl.float32)
    with_sin = _round_to(rotated * sin, dtype).to(tl.float32)
    tl.store(out_ptr + d, _round_to(with_cos + with_sin, dtype), mask=in_head)


@triton.jit(do_not_specialize=["T"])
def exact_rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, T, H_Q,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_cb, stride_ct,
    stride_oqb, stride_oqh, stride_oqt, stride_okb, stride_okh, stride_okt,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(B * T, H_Q + H_K)``: position ``b * T + t``, query head ``h`` then key head ``h - H_Q``.
    q / k / outputs ``(B, H, T, D)`` by strides, unit stride along D; cos / sin ``(B, T, D)`` likewise
    (stride 0 where broadcast over the batch)."""
    position = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = position // T
    t = position % T
    d = tl.arange(0, BLOCK_D)
    in_head = d < 2 * HALF
    partner_d = tl.where(d < HALF, d + HALF, d - HALF)
    cos = tl.load(cos_ptr + b * stride_cb + t * stride_ct + d, mask=in_head, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + b * stride_cb + t * stride_ct + d, mask=in_head, other=0.0).to(tl.float32)
    if h < H_Q:
        _rotate_head(q_ptr + b * stride_qb + h * stride_qh + t * stride_qt,
                     q_out_ptr + b * stride_oqb + h * stride_oqh + t * stride_oqt, cos, sin, d, partner_d, in_head,
                     HALF)  # fmt: skip
    else:
        h = h - H_Q
        _rotate_head(k_ptr + b * stride_kb + h * stride_kh + t * stride_kt,
                     k_out_ptr + b * stride_okb + h * stride_okh + t * stride_okt, cos, sin, d, partner_d, in_head,
                     HALF)  # fmt: skip
