"""Batch-invariant operations: each output row's bits depend on that row's inputs and the inner sizes only.

The exact on-policy contract (docs/architecture.md#exact-on-policy) needs the rollout and the
training forward to compute every log-prob with the same bits. They run the same modules on
different shapes: the training forward multiplies ``B × (P + T)`` rows at once, a decode step ``B``
rows, a prefill ``N × P``. A BLAS GEMM sums a row in an order that depends on M (FP32 on CPU: a row
of an ``(M, K) @ (K, N)`` product changes with M, measured on torch 2.13), and SDPA tiles its keys
from each padded row's position 0. So these functions fix the shapes the hardware sees:

* `row_invariant_matmul`: on CPU every GEMM call is a batch of ``ROWS × K @ K × N`` products, the
  rows padded up to a multiple of ``ROWS``. A row's sum order then depends on (K, N) only; where in
  its chunk a row sits, and what the other rows hold, does not change it (tests/exact/). On CUDA a
  Triton kernel with one tile shape and K summed in chunks fixed by K (`kernels/triton_invariant_matmul.py`).
* `exact_attention`: flash-style attention over key tiles of ``KV_TILE`` positions counted from each
  row's first real key (left padding removed), tile by tile in order, with the online-softmax update
  in FP32. A query's output is a function of its own keys and values only, whether the call holds
  one query (a decode step) or a whole sequence (prefill, the training forward); tiles a query
  cannot see add exact zeros. The backward is autograd's through these ops. On CUDA one Triton
  kernel with the same structure (`kernels/triton_exact_attention.py`) computes it in both phases.
* `row_mean`: the RMSNorm's mean of squares as a product with a ones column; where Triton runs,
  `rms_norm` replaces the whole Llama / Qwen2 / Qwen3 RMSNorm module by one fused kernel instead.
* `rotary`: where Triton runs, the modeling modules' ``apply_rotary_pos_emb`` in one fused kernel with
  the eager function's bits (element-wise, so there is no order to fix, only eager's roundings).
* `log_probs` / `token_logprobs`: temperature and log-softmax, one row at a time, as the sampler
  and the training forward both call it.

What stays in torch's hands: element-wise ops (vectorized the same for every element when the
widths are multiples of the vector length: true of every supported model, and checked end to end by
the contract tests), ``amax`` (exact in any order) and ``log_softmax`` (one row per thread or
block, measured invariant). Plain torch on every device but for the CUDA matmul kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from jetrl_trainer._choices import FLOAT_DTYPES
from jetrl_trainer.kernels.settings import (
    ExactAttentionSettings,
    ExactRopeSettings,
    InvariantMatmulSettings,
    RowSumSettings,
)

__all__ = [
    "KV_TILE",
    "ROWS",
    "exact_attention",
    "exact_attention_over_runs",
    "exact_linear",
    "log_probs",
    "rms_norm",
    "rotary",
    "row_invariant_matmul",
    "row_mean",
    "straight_through",
    "token_logprobs",
]

ROWS = 16  # rows per GEMM: the decode batch pads up to it, so keep it small
KV_TILE = 64  # keys per attention tile

_MASKED = torch.finfo(torch.float32).min  # finite, so a query with no key left gives no NaN
ATTENTION = ExactAttentionSettings()  # the CUDA attention kernel's tiles: both phases launch it with this one
MATMUL = InvariantMatmulSettings()  # the CUDA matmul kernel's tiles: both phases launch it with this one
ROW_SUM = RowSumSettings()  # the CUDA row-sum kernel's chunks: both phases launch it with this one
ROPE = ExactRopeSettings()  # the CUDA RoPE kernel's launch: both phases launch it with this one


def row_invariant_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for ``a`` ``(..., M, K)`` and ``b`` ``(..., K, N)`` (batch dims broadcast), each output row
    summed in an order fixed by (K, N): ``ROWS``-row chunks on CPU, the invariant kernel on CUDA.

    Differentiable; the backward is the plain matmuls' (any correct gradient will do, and a chunked
    backward would materialize the broadcast weight's gradient once per chunk)."""
    return _InvariantMatmul.apply(a, b)


def _plain_torch(fn):
    """Run ``fn`` with torch's function handling off: these ops call the invariant products themselves, and
    under `ExactOps` each torch call inside would pass through the mode's handler again, a product being
    chunked twice (a decode step on CPU spent most of its time there)."""

    @functools.wraps(fn)
    def plain(*args, **kwargs):
        with torch._C.DisableTorchFunction():  # private, but the one switch that also covers modes
            return fn(*args, **kwargs)

    return plain


class _InvariantMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return _invariant_matmul(a, b)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors  # under the mode: unpacking may recompute a checkpointed forward
        return _matmul_grads(a, b, grad, *ctx.needs_input_grad)


@_plain_torch  # the mode is on while autograd runs (`_backward_in_mode`): cuBLAS's products here, not ours
def _matmul_grads(a: Tensor, b: Tensor, grad: Tensor, grad_a: bool, grad_b: bool) -> tuple[Tensor | None, Tensor | None]:
    da = (grad @ b.mT.to(grad.dtype)).sum_to_size(a.shape).to(a.dtype) if grad_a else None
    db = (a.mT.to(grad.dtype) @ grad).sum_to_size(b.shape).to(b.dtype) if grad_b else None
    return da, db


@_plain_torch
def _invariant_matmul(a: Tensor, b: Tensor) -> Tensor:
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if a.dtype != b.dtype:
        a, b = (t.to(torch.promote_types(a.dtype, b.dtype)) for t in (a, b))
    if a.is_cuda and _triton_matmul() is not None:
        return _cuda_matmul(a, b, batch)
    if n == 1:  # a one-column product is a GEMV, whose order varies with the batch: make it two columns
        return _invariant_matmul(a, F.pad(b, (0, 1)))[..., :1]
    chunks = -(-m // ROWS)
    if chunks * ROWS != m:
        a = F.pad(a, (0, 0, 0, chunks * ROWS - m))
    a = a.expand(*batch, chunks * ROWS, k).reshape(-1, ROWS, k)
    b = b.expand(*batch, k, n)[..., None, :, :].expand(*batch, chunks, k, n).reshape(-1, k, n)
    out = torch.bmm(a, b)
    return out.view(*batch, chunks * ROWS, n)[..., :m, :]


def _triton_matmul():
    # The exact ops' kernels ask `triton_available`, not `triton_enabled`: their arithmetic is the
    # contract's on CUDA (the torch fallbacks there give other bits, cuBLAS not even batch-invariant),
    # so JETRL_DISABLE_TRITON, which swaps fast kernels for same-bit references, leaves them alone.
    from jetrl_trainer import kernels

    return kernels.optional_module("triton_invariant_matmul") if kernels.triton_available() else None


def _cuda_matmul(a: Tensor, b: Tensor, batch: torch.Size) -> Tensor:
    """The Triton kernel's product: one tile shape for every call (cuBLAS's batched FP32 products
    changed with the batch count on an H200). Autocast is applied here, as torch applies it to a matmul."""
    if torch.is_autocast_enabled("cuda") and a.dtype == torch.float32:
        dtype = torch.get_autocast_dtype("cuda")
        a, b = a.to(dtype), b.to(dtype)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out = _triton_matmul().invariant_matmul(a.expand(*batch, m, k).reshape(-1, m, k),
                                            b.expand(*batch, k, n).reshape(-1, k, n), MATMUL)  # fmt: skip
    return out.view(*batch, m, n)


def exact_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with `row_invariant_matmul` (the bias added after the product, in the output dtype)."""
    out = row_invariant_matmul(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def row_mean(x: Tensor) -> Tensor:
    """``x.mean(-1, keepdim=True)`` with each row summed in one fixed order: a torch reduction kernel
    picks its thread layout by the number of rows. The row-sum kernel where Triton runs (`_RowSum`),
    elsewhere a `row_invariant_matmul` with a ones column."""
    rows = x.reshape(-1, x.shape[-1])
    with torch.autocast(x.device.type, enabled=False):  # a mean keeps its dtype under autocast
        if _row_sum_kernel_runs(x):
            sums = _RowSum.apply(rows)
        else:
            sums = row_invariant_matmul(rows, torch.ones(x.shape[-1], 1, dtype=x.dtype, device=x.device))
        return (sums / x.shape[-1]).view(*x.shape[:-1], 1)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """The Llama / Qwen2 / Qwen3 RMSNorm module's output, ``weight * (x * rsqrt(mean(x²) + eps)).to(x.dtype)``,
    in one launch of the fused kernel (`kernels/triton_exact_rmsnorm.py`) where Triton runs; None
    elsewhere, where the module's own ops run under the mode (their mean being `row_mean`). Both phases
    take the same branch, so a row's bits are the same in each. Differentiable (`_FusedRMSNorm`)."""
    if not (_on_kernel_device(x) and x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES):
        return None
    module = _triton_rmsnorm()
    return None if module is None else _FusedRMSNorm.apply(x, weight, eps)


def _triton_rmsnorm():
    from jetrl_trainer import kernels

    return kernels.optional_module("triton_exact_rmsnorm") if kernels.triton_available() else None


class _FusedRMSNorm(torch.autograd.Function):
    """The kernel's forward; the backward recomputes the module's formula in plain torch (a gradient need
    not be exact, only correct)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        with torch._C.DisableTorchFunction():
            return _triton_rmsnorm().exact_rmsnorm(x, weight, eps, ROW_SUM)

    @staticmethod
    @_plain_torch  # the mode is on while autograd runs
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            xf = xd.float()
            out = wd * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype)
            dx, dw = torch.autograd.grad(out, (xd, wd), grad)
        return dx, dw, None


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor] | None:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)``, its eager bits, in one launch of
    the fused kernel (`kernels/triton_exact_rope.py`) where Triton runs; None elsewhere, and for a layout
    the kernel does not take, where the eager function runs. Both phases call it with the same dtypes
    and layouts, so they take the same branch. Differentiable (`_FusedRotary`)."""
    if not (_on_kernel_device(q) and all(t.device == q.device for t in (k, cos, sin))):
        return None
    module = _triton_rope()
    if module is None or module.unsupported_reason(q, k, cos, sin, unsqueeze_dim) is not None:
        return None
    return _FusedRotary.apply(q, k, cos, sin, unsqueeze_dim)


def _triton_rope():
    from jetrl_trainer import kernels

    return kernels.optional_module("triton_exact_rope") if kernels.triton_available() else None


def _eager_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The eager formula, ``x * cos + rotate_half(x) * sin`` (cos / sin unsqueezed), for the backward."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _FusedRotary(torch.autograd.Function):
    """The kernel's forward; a gradient need not be exact, only correct, so the backward is torch's.
    For q and k it is the formula's transpose, which needs only cos and sin: q and k are saved only in
    the rare case that cos or sin want a gradient, which autograd then recomputes through the eager formula."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> tuple[Tensor, Tensor]:
        ctx.tables_need_grad = any(ctx.needs_input_grad[2:4])
        ctx.save_for_backward(*((q, k) if ctx.tables_need_grad else ()), cos, sin)
        ctx.unsqueeze_dim, ctx.dtypes = unsqueeze_dim, (q.dtype, k.dtype)
        with torch._C.DisableTorchFunction():
            return _triton_rope().exact_rope(q, k, cos, sin, unsqueeze_dim, ROPE)

    @staticmethod
    @_plain_torch  # the mode is on while autograd runs
    def backward(ctx, grad_q: Tensor, grad_k: Tensor):
        if ctx.tables_need_grad:
            return (*_FusedRotary._recomputed_grads(ctx, grad_q, grad_k), None)
        cos, sin = (t.unsqueeze(ctx.unsqueeze_dim) for t in ctx.saved_tensors)
        grads = (_rotary_transpose(g, cos, sin).to(dtype) if need and g is not None else None
                 for g, need, dtype in zip((grad_q, grad_k), ctx.needs_input_grad[:2], ctx.dtypes))
        return (*grads, None, None, None)

    @staticmethod
    def _recomputed_grads(ctx, grad_q: Tensor, grad_k: Tensor) -> tuple:
        needs = ctx.needs_input_grad[:4]
        with torch.enable_grad(), torch.autocast(grad_q.device.type, enabled=False):
            q, k, cos, sin = (t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs))
            c, s = cos.unsqueeze(ctx.unsqueeze_dim), sin.unsqueeze(ctx.unsqueeze_dim)
            outputs = _eager_rotary(q, c, s), _eager_rotary(k, c, s)
            wanted = [t for t, need in zip((q, k, cos, sin), needs) if need]
            grads = iter(torch.autograd.grad(outputs, wanted, (grad_q, grad_k), allow_unused=True))
        return tuple(next(grads) if need else None for need in needs)


def _rotary_transpose(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The eager formula's gradient with respect to x: ``grad * cos + rotate_half^T(grad * sin)``, where
    rotate_half^T(y) = cat(y2, -y1) undoes rotate_half's (-x2, x1)."""
    half = grad.shape[-1] // 2
    scaled = grad * sin
    return grad * cos + torch.cat((scaled[..., half:], -scaled[..., :half]), dim=-1)


def _on_kernel_device(x: Tensor) -> bool:
    """Where the exact ops' Triton kernels run: CUDA; CPU tensors too under Triton's interpreter, where
    the interpreter tests run the whole exact contract through them (tests/exact/test_exact_kernel_path.py)."""
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _row_sum_kernel_runs(x: Tensor) -> bool:
    return _on_kernel_device(x) and x.dtype in FLOAT_DTYPES and _triton_row_sum() is not None


def _triton_row_sum():
    from jetrl_trainer import kernels

    return kernels.optional_module("triton_row_sum") if kernels.triton_available() else None


class _RowSum(torch.autograd.Function):
    """Each row's sum ``(M, 1)`` in the input's dtype, from the kernel's FP32 sum; the gradient is
    the incoming one spread over the row."""

    @staticmethod
    @_plain_torch
    def forward(ctx, rows: Tensor) -> Tensor:
        ctx.k = rows.shape[-1]
        return _triton_row_sum().row_sum(rows, ROW_SUM)[:, None].to(rows.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.expand(grad.shape[0], ctx.k)


def _first_key(key_valid: Tensor) -> Tensor:
    """Per batch row, the first key any query reads ``(B,)`` (0 for a row with none)."""
    seen = key_valid.any(dim=-2)  # (B, T)
    return torch.where(seen.any(-1), seen.to(torch.uint8).argmax(-1), 0)


def _shift_left(x: Tensor, offsets: Tensor, fill) -> Tensor:
    """Row ``b`` of ``x`` ``(B, ..., T, *)`` moved left by ``offsets[b]`` along dim 2 (or the last
    dim for a mask ``(B, S, T)``), ``fill`` coming in from the right."""
    if not bool(offsets.any()):
        return x
    mask_like = x.dtype == torch.bool
    t_dim = -1 if mask_like else 2
    t = x.shape[t_dim]
    index = torch.arange(t, device=x.device)[None, :] + offsets[:, None]  # (B, T)
    inside = index < t
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[t_dim] = t
    gathered = torch.take_along_dim(x, index.clamp(max=t - 1).view(shape), dim=t_dim)
    return torch.where(inside.view(shape), gathered, fill)


def exact_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, scale: float, *, kv_roundtrip=None) -> Tensor:
    """Softmax attention ``(B, H, S, D)`` of q ``(B, H, S, D)`` over k / v ``(B, H_kv, T, D)`` (GQA:
    query head ``h`` reads KV head ``h // (H / H_kv)``), query ``s`` reading the keys where
    ``key_valid[b, s]`` ``(B, S, T)`` is True.

    Each batch row's keys must be one run starting at its first real key (left padding before it,
    anything after): the tiles start there, so the same query sees the same tiles in a padded
    training batch, a prefill and the engine's cache. Computed in FP32, returned in ``q``'s dtype.
    On CUDA one Triton kernel (`kernels/triton_exact_attention.py`) computes it, each query's keys
    ``first key .. its last valid key``; elsewhere the torch ops below. Differentiable: the kernel's
    backward is torch's fused attention backward (`_fused_backward`; any correct gradient will do).

    ``kv_roundtrip`` (`ExactOps`'): keys and values are read as the KV cache returns them, the
    gradient passing straight through the rounding. The kernel reads the roundtrip's ``encode`` (the
    cache's codes and scales) where it has one, exactly as the decode reads the cache in place.
    """
    encode = getattr(kv_roundtrip, "encode", None)
    if _runs_kernel(q) and encode is not None:
        return _KernelAttention.apply(q, k, v, key_valid, scale, encode)
    if kv_roundtrip is not None:
        k, v = straight_through(k, kv_roundtrip), straight_through(v, kv_roundtrip)
    if _runs_kernel(q):
        return _KernelAttention.apply(q, k, v, key_valid, scale, None)
    return _torch_attention(q, k, v, key_valid, scale)


def _runs_kernel(q: Tensor) -> bool:
    return _on_kernel_device(q) and _triton_attention() is not None


def exact_attention_over_runs(q: Tensor, k: Tensor, v: Tensor, first_key: Tensor, last_key: Tensor, scale: float,
                              **cache) -> Tensor | None:  # fmt: skip
    """`exact_attention`'s CUDA kernel with each query's keys given as a run, ``first_key[b]`` ``(B,)`` to
    ``last_key[b, s]`` ``(B, S)``, no grad: the engine's decode step over its cache in place (``cache``:
    the kernel's ``kv_rows``, ``k_scale``, ``v_scale``), with no mask to build, no copy and no host
    sync. None where the kernel does not run (off CUDA, no Triton): the caller reads the cache out."""
    if not _runs_kernel(q):
        return None
    return _triton_attention().exact_attention(q, k, v, first_key, last_key, scale, _attention_settings(q), **cache)


def _attention_settings(q: Tensor) -> ExactAttentionSettings:
    """`ATTENTION` for this call: ``dot="auto"`` takes tensor cores for FP32 queries too under BF16
    autocast, where the plain forward's attention computes in BF16 as well (TRL's default, FP32
    master weights with ``bf16=True``, would otherwise run the FP32 FMA products, 20-100x slower on
    an H100). Both phases run under the same autocast (`ExactOps`' contract), so they settle alike."""
    device = q.device.type
    autocast_bf16 = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16
    if ATTENTION.dot == "auto" and autocast_bf16 and _triton_attention().uses_tensor_cores(ATTENTION, torch.bfloat16):
        return _with_bf16_dot(ATTENTION)
    return ATTENTION


@functools.lru_cache(maxsize=4)
def _with_bf16_dot(settings: ExactAttentionSettings) -> ExactAttentionSettings:
    """One object per settings, not a new one per attention call (a decode step makes one per layer)."""
    return dataclasses.replace(settings, dot="bf16")


def _triton_attention():
    from jetrl_trainer import kernels

    return kernels.optional_module("triton_exact_attention") if kernels.triton_available() else None


def _key_runs(key_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Each batch row's first key ``(B,)`` and each query's last valid key ``(B, S)`` (``first - 1``
    where a query reads none), the kernel's description of ``key_valid`` (one run per query)."""
    first = _first_key(key_valid)
    t = key_valid.shape[-1]
    last = t - 1 - key_valid.flip(-1).to(torch.uint8).argmax(-1)
    return first, torch.where(key_valid.any(-1), last, first[:, None] - 1)


class _KernelAttention(torch.autograd.Function):
    """The kernel's forward and `_fused_backward`. ``encode``: keys and values go to the kernel as the
    FP8 cache's codes and scales, which it reads as the decode does (its tensor-core products round a
    coded operand otherwise than the same value in FP32); the backward reads the dequantized values
    and passes their gradients straight through to the unrounded keys and values."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, scale: float, encode) -> Tensor:
        settings = _attention_settings(q)
        ctx.scale, ctx.bf16_dot = scale, _triton_attention().uses_tensor_cores(settings, q.dtype)
        ctx.k_dtype, ctx.v_dtype = k.dtype, v.dtype
        with torch._C.DisableTorchFunction():
            first, last = _key_runs(key_valid)
            k_scale = v_scale = None
            if encode is not None:  # the codes and scales (1 byte + 4 per head vector) saved, not FP32 values
                (k, k_scale), (v, v_scale) = encode(k), encode(v)
            out = _triton_attention().exact_attention(q, k, v, first, last, scale, settings, k_scale=k_scale,
                                                      v_scale=v_scale)  # fmt: skip
            # the key runs, not the (B, S, T) mask
            ctx.save_for_backward(q, k, v, first, last, k_scale, v_scale)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, first, last, k_scale, v_scale = ctx.saved_tensors
        if k_scale is not None:
            k, v = k.float() * k_scale[..., None], v.float() * v_scale[..., None]
        dq, dk, dv = _fused_backward(q, k, v, first, last, grad, ctx.scale, bf16_dot=ctx.bf16_dot)
        return dq, dk.to(ctx.k_dtype), dv.to(ctx.v_dtype), None, None, None


@_plain_torch  # the mode is on while autograd runs: this SDPA is torch's own, not `exact_sdpa`
def _fused_backward(q: Tensor, k: Tensor, v: Tensor, first: Tensor, last: Tensor, grad: Tensor, scale: float, *,
                    bf16_dot: bool = False) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The attention's gradients from torch's fused SDPA backward (flash-attention style, its
    memory-efficient kernel on CUDA for the mask), after recomputing its forward: a gradient need not
    be exact, only correct, and the fused kernels are far faster than a tiled torch backward (FP32
    products and a dozen launches per key tile). The recomputed probabilities are the kernel's to
    rounding: ``bf16_dot`` (the forward's products on tensor cores) recomputes in BF16, as flash
    attention would, and otherwise in the queries' dtype. A query that reads no key (left padding)
    gets one key and no gradient, where SDPA would give NaN."""
    keys = torch.arange(k.shape[2], device=q.device)
    valid = (keys >= first[:, None, None]) & (keys <= last[:, :, None])  # (B, S, T)
    empty = ~valid.any(-1, keepdim=True)
    valid = valid | (empty & (keys == 0))
    dtype = torch.bfloat16 if bf16_dot else q.dtype
    group = q.shape[1] // k.shape[1]
    with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
        qd = q.detach().to(dtype).requires_grad_()
        kd, vd = (x.detach().to(dtype).requires_grad_() for x in (k, v))
        # GQA as repeated heads: the memory-efficient kernel's mask path takes equal head counts
        out = F.scaled_dot_product_attention(qd, kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1),
                                             attn_mask=valid[:, None], scale=scale)  # fmt: skip
        dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), grad.to(dtype).masked_fill(empty[:, None], 0))
    return dq.to(q.dtype), dk, dv


@_plain_torch
def _torch_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, scale: float) -> Tensor:
    b, h, s, d = q.shape
    h_kv = k.shape[1]
    offsets = _first_key(key_valid)
    k, v = _shift_left(k, offsets, 0.0), _shift_left(v, offsets, 0.0)
    valid = _shift_left(key_valid, offsets, False)
    t = k.shape[2]
    tiles = -(-t // KV_TILE)
    pad = tiles * KV_TILE - t
    with torch.autocast(q.device.type, enabled=False):  # FP32 throughout, whatever the caller's autocast
        kf = F.pad(k.float(), (0, 0, 0, pad))
        ones = torch.ones(*v.shape[:-1], 1, dtype=torch.float32, device=v.device)
        v1 = F.pad(torch.cat([v.float(), ones], dim=-1), (0, 0, 0, pad))  # p @ [v | 1]: values and the sum of p
        valid = F.pad(valid, (0, pad))
        # GQA: the queries of one KV head are the rows of one matmul
        qf = q.float().reshape(b, h_kv, (h // h_kv) * s, d)
        rows = qf.shape[2]
        valid = valid[:, None].expand(b, h // h_kv, s, valid.shape[-1]).reshape(b, 1, rows, valid.shape[-1])
        m = torch.full((b, h_kv, rows, 1), _MASKED, dtype=torch.float32, device=q.device)
        acc = torch.zeros(b, h_kv, rows, d + 1, dtype=torch.float32, device=q.device)
        for j in range(tiles):
            keys = slice(j * KV_TILE, (j + 1) * KV_TILE)
            scores = row_invariant_matmul(qf, kf[:, :, keys].transpose(-1, -2)) * scale
            scores = scores.masked_fill(~valid[..., keys], _MASKED)
            m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
            p = torch.exp(scores - m_new)
            acc = acc * torch.exp(m - m_new) + row_invariant_matmul(p, v1[:, :, keys])
            m = m_new
        out = acc[..., :d] / acc[..., d:]
    return out.view(b, h, s, d).to(q.dtype)


def straight_through(x: Tensor, roundtrip) -> Tensor:
    """``roundtrip(x)`` in the forward, the identity's gradient in the backward.

    For keys and values read as a quantized KV cache stores them (`ExactOps`' ``kv_roundtrip``): the
    rounding has a zero gradient almost everywhere, so the useful gradient is the attention's at the
    rounded point passed through to the unrounded keys, as the FP8 linears pass theirs to their inputs.
    ``x + (roundtrip(x) - x).detach()`` would round twice and change the forward's bits."""
    return _StraightThrough.apply(x, roundtrip)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, roundtrip) -> Tensor:
        ctx.dtype = x.dtype
        return roundtrip(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.dtype), None


def log_probs(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)`` over the last dim, ``logits`` in FP32.

    The one implementation of a recorded log-prob: the engine's sampler (on its warped scores, where
    the temperature warper has divided already) and the exact training forward (`token_logprobs`)
    both call it on the same FP32 logits row, so their results are the same bits."""
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """`log_probs` at ``tokens``: ``logits`` ``(..., V)``, ``tokens`` ``(...)``."""
    return log_probs(logits, temperature).gather(-1, tokens[..., None]).squeeze(-1)
