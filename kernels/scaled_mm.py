"""GEMM backend ``"scaled_mm"``: cuBLASLt blockwise FP8 through ``torch._scaled_mm`` (SM90).

Needs torch ≥ 2.9 built with CUDA ≥ 12.9 and a compute-capability 9.x GPU. ``_scaled_mm(a, b)``
wants ``a [M, K]`` row-major and ``b [K, N]`` column-major (i.e. our ``[N, K]`` row-major weight,
transposed as a view) and recognises the blockwise recipes only from the scales' shapes *and
strides* (ATen ``is_blockwise_1x128_scaling`` / ``is_blockwise_128x128_scaling``):

* 1×128 on ``a``: ``scale_a`` ``(M, ceil(K/128))`` column-major, i.e. strides ``(1, M)``;
* 128×128 on ``b``: ``scale_b`` is the transposed *view* of the row-major ``(N/128, K/128)`` grid;
* 1×128 on ``b`` (the wgrad form): ``scale_b`` is the transposed view of an ``(N, K/128)``
  column-major tensor, i.e. ``s.t().contiguous()``.

Departures from a bare ``_scaled_mm`` call, none of which changes a value:

* ``ceil(K/128)`` is zero-padded to a multiple of 4 (data with zeros, scales with ones): some
  torch versions want that row stride for the scale grid and silently computed garbage otherwise;
  the padded groups add exact zeros. A ragged last K group is padded the same way.
* ``N`` is padded to a multiple of 16 (cuBLASLt's alignment for the FP8 operand and the output);
  the padded output columns are dropped.
* ``M`` is padded to a multiple of 4 (rows of zeros, scales of one): on the H200 with torch 2.11 /
  CUDA 13.0, cuBLASLt's heuristic returned CUBLAS_STATUS_NOT_SUPPORTED for M = 1, 2, 7, 231, 257
  and accepted M = 4, 8, 12, 100 (``benchmarks/probe_scaled_mm.py``): the column-major ``scale_a``
  needs a 16-byte-aligned leading dimension. The padded output rows are dropped (a view, no copy).
* The same probe found *silently wrong* results (relative error 20 to 1e20) for 128×128 B scales
  whenever ceil(K/128) was not a multiple of 4 — hence that padding is not optional.
* A call cuBLASLt still refuses raises ``NotImplementedError``, so the automatic choice falls
  through to the next backend (Triton) instead of failing.
* Output dtypes other than BF16 are computed in FP32 by cuBLASLt (``out_dtype=float32``) and cast.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from jetrl_trainer.kernels.gemm import column_major, register_gemm_backend

__all__ = ["scaled_mm_available", "scaled_mm_fp8_gemm_nt"]

_GROUP = 128
M_ALIGN = 4  # rows of A (and of scale_a's leading dimension) are padded to this multiple


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _version_at_least(version: str | None, wanted: tuple[int, int]) -> bool:
    if not version:
        return False
    try:
        parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return parts >= wanted


@functools.cache
def _torch_supports_blockwise() -> bool:
    return (
        hasattr(torch, "_scaled_mm")
        and _version_at_least(torch.__version__, (2, 9))
        and _version_at_least(torch.version.cuda, (12, 9))
    )


def scaled_mm_available(device: torch.device) -> bool:
    """True on an SM90 CUDA device with a torch/CUDA build that has blockwise ``_scaled_mm``."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not _torch_supports_blockwise():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] == 9


def _pad_fp8(q: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    # F.pad has no FP8 kernel: pad the bytes (0x00 is +0.0).
    if q.shape == (rows, cols):
        return q
    return F.pad(q.view(torch.uint8), (0, cols - q.shape[1], 0, rows - q.shape[0])).view(q.dtype)


def _pad_scale(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if s.shape == (rows, cols):
        return s
    return F.pad(s, (0, cols - s.shape[1], 0, rows - s.shape[0]), value=1.0)


def prepare_scaled_mm_operands(
    a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, b_granularity: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad and lay out the operands as ``_scaled_mm`` wants them: ``(a, b [K', N'] view, scale_a, scale_b)``.

    Pure torch (testable on CPU). ``K' = 128 * round_up(ceil(K/128), 4)``, ``N' = round_up(N, 16)``,
    ``M' = round_up(M, M_ALIGN)``.
    """
    m, k = a_q.shape
    n = b_q.shape[0]
    groups = _round_up(-(-k // _GROUP), 4)
    k_pad, n_pad, m_pad = groups * _GROUP, _round_up(n, 16), _round_up(m, M_ALIGN)
    a_q = _pad_fp8(a_q.contiguous(), m_pad, k_pad)
    b_q = _pad_fp8(b_q.contiguous(), n_pad, k_pad)
    scale_a = column_major(_pad_scale(a_s, m_pad, groups))  # (M', G') strides (1, M')
    if b_granularity == "block":
        scale_b = _pad_scale(b_s, b_s.shape[0], groups).contiguous().t()  # view of (Nb, G') row-major
    else:
        scale_b = column_major(_pad_scale(b_s, n_pad, groups)).t()  # (G', N'); .t() is (N', G') col-major
    return a_q, b_q.t(), scale_a, scale_b


def scaled_mm_fp8_gemm_nt(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    b_granularity: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``deq(a) @ deq(b).T`` through cuBLASLt; see the module docstring for the layouts."""
    if a_q.shape[0] == 0 or b_q.shape[0] == 0:
        return torch.zeros(a_q.shape[0], b_q.shape[0], dtype=out_dtype, device=a_q.device)
    n = b_q.shape[0]
    a, b, scale_a, scale_b = prepare_scaled_mm_operands(a_q, a_s, b_q, b_s, b_granularity)
    mm_dtype = out_dtype if out_dtype == torch.bfloat16 else torch.float32
    try:
        out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=mm_dtype)
    except RuntimeError as exc:  # cuBLASLt's heuristic refused the layout (host-side, nothing launched)
        raise NotImplementedError(f"cuBLASLt refused this blockwise FP8 GEMM: {exc}") from exc
    if out.shape[0] != a_q.shape[0]:
        out = out[: a_q.shape[0]]
    if out.shape[1] != n:
        out = out[:, :n]
    if out.dtype != out_dtype or not out.is_contiguous():
        out = out.to(out_dtype).contiguous()
    return out


register_gemm_backend("scaled_mm", scaled_mm_fp8_gemm_nt, is_available=scaled_mm_available, priority=20)
