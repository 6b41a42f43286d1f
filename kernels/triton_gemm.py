"""GEMM backend ``"triton"``: a portable blockwise-scaled FP8 GEMM in Triton.

The fallback for GPUs or builds without cuBLASLt blockwise scaling (any GPU with FP8 tensor
cores that Triton supports: SM89/SM90+). Same contract as every backend (``kernels/gemm.py``):
``a [M, K]`` FP8 row-major with ``a_s [M, ceil(K/128)]``; ``b [N, K]`` FP8 row-major with
``b_s [ceil(N/128), ceil(K/128)]`` ("block") or ``[N, ceil(K/128)]`` ("group"); scales may have
any strides. Ragged M, N, K need no padding (masked loads). Tile sizes come from a
``TritonGemmSettings`` (``kernels/settings.py``) above 64 rows and a fixed rule below, never from
autotuning, which would time kernels (host syncs) on the first call and break CUDA-graph capture.

Departure from a textbook FP8 GEMM: each 128-wide K group is accumulated into a fresh tile and
scaled before it joins the FP32 accumulator (blockwise scaling needs it; see the jit module). The
groups are summed in chunks fixed by K (``TritonGemmSettings.split_k_groups``); a launch with fewer
tiles than SMs spreads the chunks over programs and adds them here, in the order a program would:
the exact mode's FP8 layers get a row's bits at any M, and a decode step fills the GPU.
"""

from __future__ import annotations

import torch

from jetrl_trainer._choices import FLOAT_DTYPES, check_choice
from jetrl_trainer.kernels._triton_support import call_op, cdiv, load_jit, sm_count, triton_available
from jetrl_trainer.kernels.gemm import register_gemm_backend
from jetrl_trainer.kernels.settings import TritonGemmSettings
from jetrl_trainer.kernels.triton_chunk_sum import add_chunks

__all__ = ["triton_fp8_gemm_nt", "triton_gemm_available"]

_FP8 = torch.float8_e4m3fn


def triton_gemm_available(device: torch.device) -> bool:
    """True on a CUDA device with FP8 tensor cores (compute capability ≥ 8.9) when Triton imports."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not triton_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 9)


_DEFAULT = TritonGemmSettings()


def _config(m: int, n: int, large: tuple[int, int, int, int, int]) -> dict:
    # Decode-sized M: the GEMM is bound by reading B, so spread N over many programs.
    if m <= 64:
        block_n = 64 if cdiv(n, 64) >= 132 else 32
        return dict(BLOCK_M=64, BLOCK_N=block_n, GROUP_M=1, num_warps=4, num_stages=4)
    return dict(zip(("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages"), large))


# The settings travel as ints (a custom op's schema takes no dataclass); the defaults are _DEFAULT's.
@torch.library.custom_op("jetrl::triton_fp8_gemm_nt", mutates_args=(), device_types="cuda")
def _gemm_op(
    a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, b_block: bool, out_dtype: torch.dtype,
    block_m: int = _DEFAULT.block_m, block_n: int = _DEFAULT.block_n, group_m: int = _DEFAULT.group_m,
    num_warps: int = _DEFAULT.num_warps, num_stages: int = _DEFAULT.num_stages,
    split_k_groups: int = _DEFAULT.split_k_groups,
) -> torch.Tensor:
    jit = load_jit("_triton_gemm_jit")
    m, k = a_q.shape
    n = b_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = _config(m, n, (block_m, block_n, group_m, num_warps, num_stages))
    tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    chunks = cdiv(cdiv(k, 128), split_k_groups)
    # Decode-sized launches leave SMs idle: spread the K chunks over programs (the same bits, see the jit module).
    spread = chunks > 1 and tiles < sm_count(a_q.device)
    partials = torch.empty((chunks, m, n), dtype=torch.float32, device=a_q.device) if spread else out
    jit.fp8_gemm_nt_kernel[(tiles, chunks if spread else 1)](
        a_q, b_q, partials, a_s, b_s, m, n, k,
        a_q.stride(0), b_q.stride(0), partials.stride(0) if spread else 0, partials.stride(-2), a_s.stride(0),
        a_s.stride(1), b_s.stride(0), b_s.stride(1),
        B_BLOCK=b_block, BLOCK_K=128, CHUNK_GROUPS=split_k_groups, SPREAD=spread,
        ONE_B_SCALE=b_block and cfg["BLOCK_N"] <= 128, **cfg,
    )  # fmt: skip
    if spread:  # the chunks added to a zero total in order, as a program adds its own; one rounding at the end
        add_chunks(partials, out)
    return out


@_gemm_op.register_fake
def _(a_q, a_s, b_q, b_s, b_block, out_dtype, *launch):
    return a_q.new_empty((a_q.shape[0], b_q.shape[0]), dtype=out_dtype)


def triton_fp8_gemm_nt(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    b_granularity: str,
    out_dtype: torch.dtype,
    *,
    settings: TritonGemmSettings = _DEFAULT,
) -> torch.Tensor:
    """``deq(a) @ deq(b).T`` with FP32 accumulation; operands as in ``kernels/gemm.py``; ``settings``:
    the tiles above 64 rows."""
    check_choice("out_dtype", out_dtype, FLOAT_DTYPES)
    a_q = a_q if a_q.stride(-1) == 1 else a_q.contiguous()
    b_q = b_q if b_q.stride(-1) == 1 else b_q.contiguous()
    s = settings
    return call_op(_gemm_op, a_q, a_s, b_q, b_s, b_granularity == "block", out_dtype,
                   s.block_m, s.block_n, s.group_m, s.num_warps, s.num_stages, s.split_k_groups)  # fmt: skip


register_gemm_backend("triton", triton_fp8_gemm_nt, is_available=triton_gemm_available, priority=10)
