"""The decode step's GPU kernels on CPU: each emulated launch logs itself and computes its reference.

`emulate_kernels(monkeypatch)` replaces the kernels the engine's kernel path launches (RMSNorm and
SwiGLU + FP8 quant, the act quant, the split-K decode GEMMs and their partial sums, RoPE + KV append,
the decode attention) with pure-torch stand-ins, and makes the checks that pick them (``x.is_cuda``,
a loaded kernel module) say yes. Each stand-in follows its kernel's documented contract with the
arithmetic of the CPU path it replaces (the emulated GEMM backend, ``rmsnorm_reference``, HF's RoPE
formula, the engine's SDPA decode attention), so a kernel-path step computes the plain-torch step's
bits, and the log (kernel name, operand shapes / strides / dtypes / contents, other arguments) says
which launches ran, in which order, on which operands.

Split-K partial sums come as ``splits`` equal halves of the FP32 product (exact: ``y / 2 + y / 2 == y``),
so reducing them anywhere gives the GEMM's own result.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from jetrl_trainer import kernels
from jetrl_trainer.kernels import triton_decode_attention, triton_rope_append
from jetrl_trainer.quant import _dispatch, fused, linear
from jetrl_trainer.quant.fp8 import dequantize_fp8_groups, quantize_fp8_groups
from jetrl_trainer.quant.reference import rmsnorm_reference, swiglu_reference


def describe(value, digests: bool = True):
    """A comparable, hashable description of a kernel argument: tensors by layout, and by contents
    with ``digests``."""
    if isinstance(value, torch.Tensor):
        layout = ("tensor", tuple(value.shape), tuple(value.stride()), str(value.dtype))
        if not digests:
            return layout
        data = torch.empty(value.numel(), dtype=value.dtype).copy_(value.detach().reshape(-1))  # unit stride
        return (*layout, hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:12])
    if isinstance(value, (list, tuple)):
        return tuple(describe(v, digests) for v in value)
    if isinstance(value, float):
        return float.hex(value)
    return value if isinstance(value, (int, str, bool, type(None), torch.dtype)) else type(value).__name__


class KernelLog(list):
    """``(kernel, described args, described kwargs)`` per emulated launch, in launch order; operand
    contents hashed with ``digests`` (slower: every launch hashes the KV cache it is given)."""

    def __init__(self, digests: bool = False) -> None:
        super().__init__()
        self.digests = digests

    def record(self, name: str, args: tuple, kwargs: dict) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k != "settings"}  # launch settings: not yet read by the kernels
        described = tuple(sorted((k, describe(v, self.digests)) for k, v in kwargs.items()))
        self.append((name, describe(args, self.digests), described))

    def names(self) -> list[str]:
        return [entry[0] for entry in self]


def _gemm(x_q, x_s, w_q, w_s, bias, out_dtype):
    """``QuantLinear``'s CPU FP8 product: the emulated block GEMM, the bias added in FP32, rounded once."""
    y = kernels.fp8_gemm_nt((x_q, x_s), (w_q, w_s), b_granularity="block",
                            out_dtype=torch.float32 if bias is not None else out_dtype)  # fmt: skip
    return (y + bias.float()).to(out_dtype) if bias is not None else y.to(out_dtype)


def _split_sum(parts):
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    return acc


def _rope(x, cos, sin):
    """HF's ``apply_rotary_pos_emb`` for one position: ``x (B, H, D)``, ``cos`` / ``sin`` ``(B, D)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None]) + (rotated * sin[:, None])


def _store(cache, scales, slots, positions, x):
    if scales is None:
        cache[slots, :, positions] = x
        return
    q, s = quantize_fp8_groups(x, x.shape[-1])
    cache[slots, :, positions] = q
    scales[slots, :, positions] = s[..., 0]


class _Emulation:
    def __init__(self, log: KernelLog, splits: int) -> None:
        self.log, self.splits = log, splits
        self.decode_gemm = SimpleNamespace(
            planned_splits=lambda m, widths, k, device, settings: splits,
            **{name: self._logged(name, getattr(self, name)) for name in (
                "fp8_decode_gemm_nt", "fp8_decode_gemm_grouped", "fp8_decode_gemm_partials",
                "fp8_decode_gemm_grouped_partials")},
        )  # fmt: skip
        self.norm = SimpleNamespace(rmsnorm_quant_fp8=self._logged("rmsnorm_quant_fp8", self.rmsnorm_quant_fp8),
                                    add_rmsnorm_quant_fp8=self._logged("add_rmsnorm_quant_fp8", self.add_rmsnorm_quant_fp8))
        self.swiglu = SimpleNamespace(swiglu_quant_fp8=self._logged("swiglu_quant_fp8", self.swiglu_quant_fp8))
        self.quant = SimpleNamespace(act_quant_fp8=self._logged("act_quant_fp8", self.act_quant_fp8))

    def _logged(self, name, fn):
        def launch(*args, **kwargs):
            self.log.record(name, args, kwargs)
            return fn(*args, **kwargs)

        return launch

    # -- triton_norm / triton_swiglu / triton_quant ------------------------------------------------

    @staticmethod
    def rmsnorm_quant_fp8(x, weight, eps, *, scale_format="fp32", quantize=True):
        y = rmsnorm_reference(x, weight, eps)
        if not quantize:
            return y, y.new_empty((0, y.shape[1]), dtype=torch.float8_e4m3fn), y.new_empty((0, 1), dtype=torch.float32)
        return (y, *quantize_fp8_groups(y, 128, scale_format=scale_format))

    def add_rmsnorm_quant_fp8(self, residual, delta, weight, eps, *, bias=None, scale_format="fp32", num_warps=None):
        if delta.dim() == 3:  # split-K partial sums: reduced in split order, + bias, rounded once
            delta = _split_sum(delta)
            delta = (delta + bias.float() if bias is not None else delta).to(residual.dtype)
        h = residual + delta
        return (h, *self.rmsnorm_quant_fp8(h, weight, eps, scale_format=scale_format))

    @staticmethod
    def swiglu_quant_fp8(gate, up, *, scale_format="fp32"):
        h = swiglu_reference(gate, up)
        return (h, *quantize_fp8_groups(h, 128, scale_format=scale_format))

    @staticmethod
    def act_quant_fp8(x2d, scale_format="fp32", *, settings=None):
        return quantize_fp8_groups(x2d.contiguous(), 128, scale_format=scale_format)

    # -- triton_decode_gemm ----------------------------------------------------------------------

    @staticmethod
    def fp8_decode_gemm_nt(x_q, x_s, w_q, w_s, bias=None, *, out_dtype=torch.bfloat16, settings=None):
        return _gemm(x_q, x_s, w_q, w_s, bias, out_dtype)

    @staticmethod
    def fp8_decode_gemm_grouped(x_q, x_s, weights, biases=(), *, out_dtype=torch.bfloat16, settings=None):
        biases = list(biases) or [None] * len(weights)
        return [_gemm(x_q, x_s, w_q, w_s, b, out_dtype) for (w_q, w_s), b in zip(weights, biases)]

    def fp8_decode_gemm_partials(self, x_q, x_s, w_q, w_s, *, settings=None):
        y = _gemm(x_q, x_s, w_q, w_s, None, torch.float32)
        return torch.stack([y / self.splits] * self.splits) if self.splits > 1 else y[None]

    def fp8_decode_gemm_grouped_partials(self, x_q, x_s, weights, *, settings=None):
        return torch.cat([self.fp8_decode_gemm_partials(x_q, x_s, *w) for w in weights], dim=-1)

    def decode_gemm_module(self, x2d, max_m):
        return self.decode_gemm if 0 < x2d.shape[0] <= max_m else None

    # -- triton_rope_append / triton_decode_attention ------------------------------------------------

    @staticmethod
    def rope_append(q, k, v, cos, sin, k_cache, v_cache, slots, positions, *, k_scale=None, v_scale=None,
                    qk_norms=None):  # fmt: skip
        if qk_norms is not None:
            q_w, k_w, q_eps, k_eps = qk_norms
            q, k = rmsnorm_reference(q, q_w, q_eps), rmsnorm_reference(k, k_w, k_eps)
        _store(k_cache, k_scale, slots, positions, _rope(k, cos, sin))
        _store(v_cache, v_scale, slots, positions, v)
        return _rope(q, cos, sin)

    def rope_append_from_partials(self, parts, heads, cos, sin, k_cache, v_cache, slots, positions, *, biases=None,
                                  **kwargs):  # fmt: skip
        D, kv_heads = cos.shape[-1], k_cache.shape[1]
        outs = _split_sum(parts).split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
        if biases is not None:
            outs = [o + b.float() for o, b in zip(outs, biases)]
        q, k, v = (o.to(cos.dtype).unflatten(-1, (-1, D)) for o in outs)
        return self.rope_append(q, k, v, cos, sin, k_cache, v_cache, slots, positions, **kwargs)

    @staticmethod
    def decode_attention(q, k_cache, v_cache, slots, lengths, scale, *, splits=None, k_scale=None, v_scale=None,
                         block_n=64, flash_order=True, quantize_output=None, pads=None, settings=None):  # fmt: skip
        from jetrl_trainer.rollout.engine.attention import decode_attention

        k, v = k_cache[slots], v_cache[slots]
        if k_scale is not None:
            k, v = (dequantize_fp8_groups(x, s[slots][..., None], x.shape[-1], q.dtype) for x, s in ((k, k_scale), (v, v_scale)))
        out = decode_attention(q, k, v, lengths, scale)
        if quantize_output is None:
            return out
        return (out, *quantize_fp8_groups(out.reshape(out.shape[0], -1), 128, scale_format=quantize_output))


def emulate_kernels(monkeypatch, *, splits: int = 2, digests: bool = False) -> KernelLog:
    """Install the emulated kernels for the test (``monkeypatch`` undoes it); their launch log."""
    log = KernelLog(digests)
    emu = _Emulation(log, splits)
    modules = {"triton_norm": emu.norm, "triton_swiglu": emu.swiglu, "triton_quant": emu.quant,
               "triton_decode_gemm": emu.decode_gemm, "triton_rope_append": triton_rope_append}  # fmt: skip
    monkeypatch.setattr(kernels, "optional_module", modules.get)
    monkeypatch.setattr(kernels, "triton_enabled", lambda: True)
    monkeypatch.setattr(fused, "_use_kernels", lambda x, module: module in modules)
    monkeypatch.setattr(_dispatch, "_kernel", lambda name, x: getattr(emu.quant, name, None))
    monkeypatch.setattr(_dispatch, "decode_gemm_module", emu.decode_gemm_module)
    monkeypatch.setattr(linear, "fp8_gemm_nt", emu._logged("fp8_gemm_nt", linear.fp8_gemm_nt))  # above decode M
    from jetrl_trainer.rollout.engine import projections

    monkeypatch.setattr(projections, "decode_gemm_module", emu.decode_gemm_module)
    for name in ("rope_append", "rope_append_from_partials"):
        monkeypatch.setattr(triton_rope_append, name, emu._logged(name, getattr(emu, name)))
    monkeypatch.setattr(triton_decode_attention, "decode_attention", emu._logged("decode_attention", emu.decode_attention))
    return log

