"""``@triton.jit`` blockwise-scaled FP8 GEMM (imported only when Triton is present).

``C [M, N] = sum_g (A_g @ B_g^T) * sa[:, g] * sb[:, g]``: each 128-wide K group is multiplied on
the tensor cores into a fresh FP32 tile, then scaled and added to the FP32 accumulator. Scaling
per group (instead of one long MMA chain) is what blockwise FP8 requires, and it also promotes the
partial sums out of Hopper's reduced-precision FP8 accumulator every 128 K (as DeepGEMM does).

The groups are summed in chunks of ``CHUNK_GROUPS`` (the split plan, fixed by K), each chunk from
zero, and the chunks added to a zero total in order. ``SPREAD=False``: each program adds its own
chunks; ``SPREAD=True``: program ``(tile, c)`` stores chunk ``c``'s FP32 sum at ``c_ptr`` (``(chunks,
M, N)``) and the caller adds them in the same order (`triton_gemm.py`), for decode-sized launches
that would leave SMs idle. The same additions either way, so the same bits.
"""

import triton
import triton.language as tl


@triton.jit
def _chunk_sum(a_base, b_base, sa_ptrs, sb_ptrs, offs_k, first, last, K, stride_asg, stride_bsg,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               ONE_B_SCALE: tl.constexpr):  # fmt: skip
    """The FP32 sum of groups ``first .. last - 1`` of the tile's scaled group products, each
    ``part * (sa * sb)``: the scale product first, so that a tile inside one 128-wide weight block
    (``ONE_B_SCALE``: ``sb_ptrs`` is one pointer) multiplies ``BLOCK_M`` scales instead of a tile of
    them, and every tile shape gives each output the same value."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(first, last):
        k_left = K - g * BLOCK_K
        a = tl.load(a_base + g * BLOCK_K, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_base + g * BLOCK_K, mask=offs_k[:, None] < k_left, other=0.0)
        sa = tl.load(sa_ptrs + g * stride_asg)
        sb = tl.load(sb_ptrs + g * stride_bsg)
        part = tl.dot(a, b)
        if ONE_B_SCALE:
            acc += part * (sa * sb)[:, None]
        else:
            acc += part * (sa[:, None] * sb[None, :])
    return acc


@triton.jit
def fp8_gemm_nt_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
    stride_am, stride_bn, stride_cc, stride_cm, stride_asm, stride_asg, stride_bsn, stride_bsg,
    B_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, CHUNK_GROUPS: tl.constexpr, SPREAD: tl.constexpr, ONE_B_SCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order: GROUP_M row blocks share B tiles in L2.
    width = GROUP_M * grid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)  # clamp, not mask: no branch in the K loop
    rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    a_base = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_base = b_ptr + rows_b[None, :] * stride_bn + offs_k[:, None]  # (BLOCK_K, BLOCK_N) view of B^T
    sa_ptrs = as_ptr + rows_a * stride_asm
    if ONE_B_SCALE:  # 128 x 128 weight blocks, tiles no wider than one (starting at multiples of BLOCK_N)
        sb_ptrs = bs_ptr + (pid_n * BLOCK_N // 128) * stride_bsn
    elif B_BLOCK:
        sb_ptrs = bs_ptr + (rows_b // 128) * stride_bsn
    else:
        sb_ptrs = bs_ptr + rows_b * stride_bsn

    groups = (K + BLOCK_K - 1) // BLOCK_K
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPREAD:  # this program's chunk, stored in FP32 for the caller's ordered sum
        c = tl.program_id(1)
        first = c * CHUNK_GROUPS
        acc = _chunk_sum(a_base, b_base, sa_ptrs, sb_ptrs, offs_k, first, tl.minimum(first + CHUNK_GROUPS, groups), K,
                         stride_asg, stride_bsg, BLOCK_M, BLOCK_N, BLOCK_K, ONE_B_SCALE)  # fmt: skip
        c_ptrs = c_ptr + c.to(tl.int64) * stride_cc + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc, mask=out_mask)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for first in range(0, groups, CHUNK_GROUPS):
            total += _chunk_sum(a_base, b_base, sa_ptrs, sb_ptrs, offs_k, first, tl.minimum(first + CHUNK_GROUPS, groups),
                                K, stride_asg, stride_bsg, BLOCK_M, BLOCK_N, BLOCK_K, ONE_B_SCALE)  # fmt: skip
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=out_mask)
