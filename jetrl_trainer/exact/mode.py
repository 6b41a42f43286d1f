"""`ExactOps`: while open, the model's linears, matmuls, attention and norms' means run the batch-invariant ops.

A torch function mode, so it reaches every module of the policy without replacing any: transformers'
decoder code, peft's LoRA adapters and the LM head call ``F.linear`` / ``matmul`` /
``F.scaled_dot_product_attention``, and the RMSNorms ``x.mean(-1, keepdim=True)``; the mode routes those
calls to `ops.py`. Our FP8 `QuantLinear` asks `ExactOps.active()` and runs a row-invariant FP8 product
(quant/linear.py), and so do the Llama / Qwen2 / Qwen3 RMSNorm modules and those models'
``apply_rotary_pos_emb``, which `entered` wraps to run one fused kernel each where Triton runs
(fused_modules.py). The engine, the scorer and the trainer open it around both phases, the rollout
and the training forward (and the backward, where gradient checkpointing recomputes the forward), so
both compute with one implementation per op; outside it nothing changes. Thread-local, as every torch function mode.

Float64 products pass through untouched (the FP8 emulation's exact group sums), and so do integer ones.

``kv_roundtrip``: how the rollout's KV cache stores keys and values, where it rounds them (the FP8
cache, `rollout/engine/kv_cache.py`). The attention then reads every key (after RoPE) and value as
the cache would return it, in the prefill, the training forward and its recomputation alike, so a
decode step over the cache computes what the training forward computes (on CUDA the kernel reads the
roundtrip's ``encode``: the cache's codes and scales); gradients pass straight through the rounding.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from jetrl_trainer._choices import FLOAT_DTYPES

from .fused_modules import install_fused_modules
from .ops import exact_attention, exact_linear, row_invariant_matmul, row_mean

__all__ = ["ExactOps", "KVRoundtrip", "exact_sdpa"]

# keys or values (..., head_dim) -> as a cache returns them; optionally with ``encode`` (codes, scales)
KVRoundtrip = Callable[[torch.Tensor], torch.Tensor]

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
            torch.Tensor.bmm}  # fmt: skip
_REDUCED_FLOATS = FLOAT_DTYPES  # float64 passes through
_MEANS = {torch.mean, torch.Tensor.mean}
_ROUTED = frozenset({F.linear, F.scaled_dot_product_attention, torch.Tensor.backward, *_MEANS, *_MATMULS})


def _last_dim_mean(args: tuple, kwargs: dict) -> bool:
    """``x.mean(-1, keepdim=True)`` of a float ``x`` (the RMSNorm's variance), the one mean the mode takes."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return (keepdim is True and isinstance(dim, int) and dim in (-1, x.dim() - 1) and x.dim() >= 1
            and x.dtype in _REDUCED_FLOATS and set(kwargs) <= {"dim", "keepdim"})  # fmt: skip


def exact_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
               *, kv_roundtrip: KVRoundtrip | None = None):  # fmt: skip
    """``F.scaled_dot_product_attention``'s contract (no dropout), computed by `exact_attention`; keys and
    values first pass through ``kv_roundtrip`` where one is given (`ExactOps`)."""
    if dropout_p:
        raise ValueError("exact log-probs need deterministic attention: set the model's attention_dropout to 0.")
    s, t = query.shape[-2], key.shape[-2]
    if attn_mask is None:
        valid = torch.ones(s, t, dtype=torch.bool, device=query.device)
        if is_causal:
            valid = valid.tril(t - s)
    elif attn_mask.dtype == torch.bool:
        valid = attn_mask
    else:  # additive: 0 where a key is read
        valid = attn_mask == 0
    valid = valid.expand(*query.shape[:-3], 1, s, t) if valid.dim() < 4 else valid
    if valid.shape[1] != 1:
        raise ValueError("exact attention takes one mask for all heads; got a per-head mask.")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return exact_attention(query, key, value, valid.expand(query.shape[0], 1, s, t)[:, 0], scale,
                           kv_roundtrip=kv_roundtrip)  # fmt: skip


_open = threading.local()  # how many `ExactOps.entered` blocks this thread is inside


def _backward_in_mode(mode: ExactOps, tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``tensor.backward(...)`` with a fresh `ExactOps` on the stack while autograd's engine runs.

    A mode is off inside its own handler, and gradient checkpointing recomputes the forward inside the
    backward: that recomputation must run the exact ops, or it saves other tensors than the forward
    did. So the engine is started here, below torch's function dispatch (``torch.autograd.backward``
    would hand the call back to the mode), as ``torch.autograd.backward`` itself starts it."""
    engine = getattr(torch.autograd.graph, "_engine_run_backward", None)
    make_grads = getattr(torch.autograd, "_make_grads", None)
    if engine is None or make_grads is None or inputs is not None:  # another torch: the plain backward
        return torch.Tensor.backward(tensor, gradient, retain_graph, create_graph, inputs=inputs)
    grads = make_grads((tensor,), (gradient,), is_grads_batched=False)
    with ExactOps(kv_roundtrip=mode.kv_roundtrip):
        engine((tensor,), grads, create_graph if retain_graph is None else retain_graph, create_graph, (),
               allow_unreachable=True, accumulate_grad=True)  # fmt: skip


class ExactOps(TorchFunctionMode):
    """Routes ``F.linear``, matmuls, ``F.scaled_dot_product_attention`` and the RMSNorm's mean of floats to
    the batch-invariant ops, and runs ``Tensor.backward`` with the mode kept (`_backward_in_mode`).
    ``kv_roundtrip``: see the module docstring."""

    def __init__(self, kv_roundtrip: KVRoundtrip | None = None) -> None:
        super().__init__()
        self.kv_roundtrip = kv_roundtrip

    @staticmethod
    @contextlib.contextmanager
    def entered(enabled: bool = True, kv_roundtrip: KVRoundtrip | None = None) -> Iterator[None]:
        """The mode for the block where ``enabled``, entered once however deeply the blocks nest (a mode
        inside itself would chunk its own chunked products again). A nested block asking for another
        ``kv_roundtrip`` than the open one is a bug that would break the contract: it raises."""
        depth = getattr(_open, "depth", 0)
        if enabled and depth and kv_roundtrip is not None and kv_roundtrip != _open.kv_roundtrip:
            raise RuntimeError(f"ExactOps is open with kv_roundtrip={_open.kv_roundtrip!r}; a block inside it asked "
                               f"for {kv_roundtrip!r}. Open the mode once, with the rollout cache's roundtrip.")  # fmt: skip
        if not enabled or depth:
            yield
            return
        install_fused_modules()  # the RMSNorms' and RoPE's one-launch forms inside the mode (fused_modules.py)
        _open.depth, _open.kv_roundtrip = 1, kv_roundtrip
        try:
            with ExactOps(kv_roundtrip):
                yield
        finally:
            _open.depth, _open.kv_roundtrip = 0, None

    @staticmethod
    def active() -> bool:
        """Whether this thread runs under the mode: inside an `entered` block, or with an `ExactOps` on its
        torch function mode stack. The second is how autograd's device threads see it: gradient
        checkpointing recomputes a layer's forward there during the backward, with the caller's mode
        stack (`_backward_in_mode` puts one on it) but not its thread-local ``entered`` count, and the
        recomputation must take the fused modules' and FP8 linears' branches the forward took, or it
        saves other tensors than the forward did (an H100 GRPO step failed so)."""
        if getattr(_open, "depth", 0):
            return True
        return any(isinstance(mode, ExactOps) for mode in _get_current_function_mode_stack())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _ROUTED:  # most calls: one set lookup
            return func(*args, **kwargs)
        if func is F.linear:
            x = args[0]
            if x.dtype in _REDUCED_FLOATS:
                return exact_linear(*args, **kwargs)
        elif func is F.scaled_dot_product_attention:
            return exact_sdpa(*args, **kwargs, kv_roundtrip=self.kv_roundtrip)
        elif func in _MEANS and _last_dim_mean(args, kwargs):
            return row_mean(args[0])
        elif func is torch.Tensor.backward:
            return _backward_in_mode(self, *args, **kwargs)
        elif func in _MATMULS and not kwargs:
            a, b = args
            if a.dtype in _REDUCED_FLOATS and a.dim() >= 2 and b.dim() >= 2:
                return row_invariant_matmul(a, b)
        return func(*args, **kwargs)

