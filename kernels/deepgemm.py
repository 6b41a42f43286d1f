"""GEMM backend ``"deepgemm"``: DeepGEMM's SM90 FP8 kernels, registered only if ``deep_gemm`` imports.

**Opt-in, because it is untested against a real DeepGEMM.** The adapter was written from
DeepGEMM's source and is exercised on CPU against a strict fake of that contract
(``tests/kernels/test_deepgemm_backend.py``); the one build of DeepGEMM 2.6.1 tried on an H200 crashed on
its first GEMM call. So the automatic choice never picks it; force it with
``JETRL_GEMM_BACKEND=deepgemm``, ``use_gemm_backend("deepgemm")`` or ``backend="deepgemm"``.
Make it automatic (``opt_in=False`` below) only after ``test_real_deepgemm_matches_emulated`` has
passed on a GPU with the real library.

DeepGEMM's contract, read from its repository (v2.6.1 at HEAD, and v2.1.1 for the older names):

* ``deep_gemm.fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False)``
  computes ``d = c + deq(a) @ deq(b).T`` in place, ``a = (a_fp8 [M, K], sfa)``,
  ``b = (b_fp8 [N, K], sfb)`` (``csrc/apis/gemm.hpp``; since 2.6 ``fp8_gemm_nt`` is an alias of
  ``fp8_fp4_gemm_nt``, which adds ``recipe_a``/``recipe_b``; we pass only the common keywords).
  ``deep_gemm/__init__.py`` imports it inside ``try/except ImportError`` (absent when DeepGEMM was
  built for CUDA < 12.1), and DeepGEMM 1.x had other names — so we also require the attribute.
* On SM90 both data operands must be K-major (``stride(-1) == 1``, ``fp8_requires_k_major`` in
  ``csrc/utils/layout.hpp``); they are read through TMA, whose global strides must be 16-byte
  multiples (``csrc/jit_kernels/impls/runtime_utils.hpp``), i.e. ``K % 16 == 0``. ``d`` must be
  N-major (``check_major_type_cd``), with a 16-byte-aligned row stride too.
* Scales on SM90 are FP32 (README "Notices"); ``recipe = (gran_m, gran_n, gran_k)``; the SM90
  default is ``(1, 128, 128)`` (``get_default_recipe``). ``csrc/apis/layout.hpp``
  (``transform_sf_into_required_layout``) turns 1×128 FP32 scales of shape ``[MN, ceil(K/128)]``
  into the MN-major TMA-aligned layout itself; 128×128 FP32 scales ``[ceil(N/128), ceil(K/128)]``
  are used as given and must be contiguous or transposed-contiguous (``check_sf_layout``).
* Two SM90 kernels (``csrc/jit_kernels/impls/sm90_fp8_gemm_1d2d.hpp`` / ``..._1d1d.hpp``):
  recipe ``(1, 128, 128)`` → 1D2D, **BF16 ``d`` only and no ``c``**; recipe ``(1, 1, 128)`` (1×128
  on B too — our wgrad "group" form) → 1D1D, **FP32 ``d`` and a ``c`` required** (the accumulating
  wgrad kernel; DeepGEMM's own ``tests/test_fp8_fp4.py`` passes ``c = d``).
* ``compiled_dims`` names the dimensions baked into the JIT-compiled kernel as constants.
* SM100 wants UE8M0 (power-of-two) scales and by default *rounds FP32 scales up* to them
  (``disable_ue8m0_cast``); our scales are arbitrary FP32, so the backend is SM90-only.

What the adapter does (none of it changes a value):

* ``K`` is zero-padded to a multiple of 128 when ragged (the group count is unchanged). DeepGEMM's
  own tests only use such K; its kernels probably handle a ragged tail through TMA zero-fill, but
  that is not something we could check here. Wgrad has ``K`` = token count, often ragged.
* ``d`` is a ``[M, N]`` view of a ``[M, round_up(N, 8)]`` buffer (row stride 16-byte aligned for
  BF16 and FP32); a ragged ``N`` costs one copy of the output, not of the weight.
* Block B and a BF16 output → 1D2D. Anything else (group B, or an FP32/FP16 output) → 1D1D into a
  zeroed FP32 ``d`` passed as its own ``c``; block B scales are first expanded to one row each
  (``[N, ceil(K/128)]``), which dequantizes to the same values. The result is cast to ``out_dtype``.
* ``compiled_dims``: ``"nk"`` for block B (a weight: N and K fixed, M = tokens varies) and ``"mn"``
  for group B (wgrad: K = tokens varies), so a new batch size does not force a recompile.
* A ``RuntimeError`` from DeepGEMM (a host assertion, or a failed JIT compile) becomes
  ``NotImplementedError`` (once automatic, the choice would fall through to the next backend).
"""

from __future__ import annotations

import contextlib
import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from jetrl_trainer.kernels.gemm import register_gemm_backend

__all__ = ["deepgemm_available", "deepgemm_fp8_gemm_nt"]

_GROUP = 128
_N_ALIGN = 8  # 16 bytes of BF16; also a multiple of FP32's 4
RECIPE_BLOCK = (1, 128, 128)  # 1x128 on A, 128x128 on B -> SM90 1D2D kernel
RECIPE_GROUP = (1, 1, 128)  # 1x128 on both -> SM90 1D1D kernel
_log = logging.getLogger(__name__)


def _import_deep_gemm() -> ModuleType | None:
    try:
        import deep_gemm
    except ModuleNotFoundError as exc:
        if exc.name != "deep_gemm":  # installed, but one of its own imports is missing
            _log.warning("deep_gemm is installed but failed to import: %s", exc)
        return None
    except Exception as exc:  # e.g. its init asserting on a missing CUDA home: never break our import
        _log.warning("deep_gemm failed to import (%s: %s); the deepgemm backend is off", type(exc).__name__, exc)
        return None
    if not callable(getattr(deep_gemm, "fp8_gemm_nt", None)):
        _log.warning("deep_gemm has no fp8_gemm_nt (DeepGEMM < 2.0, or built for CUDA < 12.1); backend off")
        return None
    return deep_gemm


_deep_gemm = _import_deep_gemm()


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    # The one driver query; tests replace it to run the adapter on CPU.
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)


def deepgemm_available(device: torch.device | str) -> bool:
    """True if ``deep_gemm`` imported with ``fp8_gemm_nt`` and ``device`` is an SM90 GPU."""
    if _deep_gemm is None:
        return False
    capability = _cuda_capability(torch.device(device))
    return capability is not None and capability[0] == 9


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_k(q: torch.Tensor, k_pad: int) -> torch.Tensor:
    # F.pad has no FP8 kernel: pad the bytes (0x00 is +0.0).
    q = q.contiguous()
    if q.shape[1] == k_pad:
        return q
    return F.pad(q.view(torch.uint8), (0, k_pad - q.shape[1])).view(q.dtype)


def deepgemm_fp8_gemm_nt(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    b_granularity: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``deq(a) @ deq(b).T`` through ``deep_gemm.fp8_gemm_nt``; see the module docstring."""
    m, k = a_q.shape
    n = b_q.shape[0]
    if m == 0 or n == 0 or k == 0:  # DeepGEMM 2.1 asserts k > 0; nothing to launch anyway
        return torch.zeros(m, n, dtype=out_dtype, device=a_q.device)
    if _deep_gemm is None:
        raise NotImplementedError("deep_gemm is not importable.")
    k_pad = _round_up(k, _GROUP)
    a, b = _pad_k(a_q, k_pad), _pad_k(b_q, k_pad)
    sfa = a_s.contiguous()
    n_pad = _round_up(n, _N_ALIGN)
    if b_granularity == "block" and out_dtype == torch.bfloat16:
        recipe, sfb, c = RECIPE_BLOCK, b_s.contiguous(), None
        d = torch.empty(m, n_pad, dtype=torch.bfloat16, device=a.device)[:, :n]
    else:
        # 1D1D: FP32 D = C + A @ B.T with C = D = 0. Block scales, one row each, dequantize the same.
        rows = b_s if b_granularity == "group" else b_s.repeat_interleave(_GROUP, dim=0)[:n]
        recipe, sfb = RECIPE_GROUP, rows.contiguous()
        d = torch.zeros(m, n_pad, dtype=torch.float32, device=a.device)[:, :n]
        c = d
    compiled_dims = "nk" if b_granularity == "block" else "mn"
    device_ctx = torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext()
    try:
        with device_ctx:
            _deep_gemm.fp8_gemm_nt((a, sfa), (b, sfb), d, c=c, recipe=recipe, compiled_dims=compiled_dims)
    except RuntimeError as exc:  # DG_HOST_ASSERT / JIT failure, raised before anything is launched
        raise NotImplementedError(f"DeepGEMM refused this FP8 GEMM ({m}x{n}x{k}, {b_granularity}): {exc}") from exc
    out = d.to(out_dtype)
    return out if out.is_contiguous() else out.contiguous()


if _deep_gemm is not None:
    # Priority 30 (above scaled_mm's 20) takes effect only once it is not opt-in.
    register_gemm_backend(
        "deepgemm", deepgemm_fp8_gemm_nt, is_available=deepgemm_available, priority=30, opt_in=True
    )
