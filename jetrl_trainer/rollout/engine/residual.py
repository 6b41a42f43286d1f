"""The decode step's residual stream, and the RMSNorm launches the engine makes on it.

A Llama-family layer adds the attention output, then the MLP output, to the residual stream, and
each add is followed by an RMSNorm (the next sub-layer's input norm, or the final norm). At decode
those adds are tiny launches, and so is the split-K reduction of the o / down projection that
produces them. On the kernel path a `FusedRMSNorm` (whose math, ``rmsnorm_reference``, is what
``kernels/triton_norm`` computes) runs as the engine's own launch: one kernel writes the normalized
activation and its 1×128 FP8 quantization for the projection that reads it, handed over as an
`Activation`. After the first layer's input norm, that launch also takes the pending add, as a tensor
or as the projection's unreduced `SplitSums`: the reduction, the add, the norm and the quantization in one
kernel (``add_rmsnorm_quant_fp8``), with the bits of the unfused order (reduce, round, add, norm).
Anything else runs the module after a separate add.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from jetrl_trainer import kernels

from .projections import Activation, SplitSums

__all__ = ["ResidualStream"]


class ResidualStream:
    """``h``, with at most one pending addition that the next ``norm`` call may take into its launch."""

    def __init__(self, h: Tensor) -> None:
        self.h = h
        self._pending: Tensor | SplitSums | None = None

    def add(self, delta: Tensor | SplitSums) -> None:
        """``h = h + delta``, deferred to the next :meth:`norm` or :meth:`value`."""
        self._flush()
        self._pending = delta

    def norm(self, module: nn.Module, mode: str, fp8_format: Optional[str] = None) -> Activation:
        """``module(h)`` after the pending add, as the layer plan's ``mode`` says (`plan.LayerPlan`):
        ``"module"`` calls it; ``"kernel"`` launches the RMSNorm with its FP8 quantization in
        ``fp8_format`` (None: no FP8 consumer, the output alone); ``"kernel+add"`` also takes the
        pending add into that launch."""
        delta = self._pending
        if mode == "kernel+add" and delta is not None and _fusable(delta, self.h):
            self._pending = None
            return self._add_norm(module, delta, fp8_format)
        self._flush()
        if mode == "module":
            return Activation(module(self.h))
        h2d = self.h.reshape(-1, self.h.shape[-1])
        y, q, s = kernels.optional_module("triton_norm").rmsnorm_quant_fp8(
            h2d, module.weight, module.variance_epsilon, scale_format=fp8_format or "fp32",
            quantize=fp8_format is not None,
        )  # fmt: skip
        return _quantized(y.view(*self.h.shape[:-1], y.shape[-1]), q, s, fp8_format)

    def _add_norm(self, module: nn.Module, delta: Tensor | SplitSums, fp8_format: Optional[str]) -> Activation:
        """``h = h + delta`` and ``module(h)`` in one launch (``delta``'s split sums reduced in it)."""
        shape = self.h.shape
        r2d = self.h.reshape(-1, shape[-1])
        d = delta.parts if isinstance(delta, SplitSums) else delta.reshape(-1, delta.shape[-1])
        bias = delta.bias if isinstance(delta, SplitSums) else None
        h, y, q, s = kernels.optional_module("triton_norm").add_rmsnorm_quant_fp8(
            r2d, d, module.weight, module.variance_epsilon, bias=bias, scale_format=fp8_format or "fp32"
        )  # fmt: skip
        self.h = h.view(shape)
        return _quantized(y.view(*shape[:-1], y.shape[-1]), q, s, fp8_format)

    def _flush(self) -> None:
        if self._pending is not None:
            delta = self._pending.materialize() if isinstance(self._pending, SplitSums) else self._pending
            self.h = self.h + delta
            self._pending = None


def _fusable(delta: Tensor | SplitSums, h: Tensor) -> bool:
    """The add kernel takes a delta in ``h``'s dtype, a tensor of ``h``'s shape or split sums."""
    return delta.dtype == h.dtype and (isinstance(delta, SplitSums) or delta.shape == h.shape)


def _quantized(y: Tensor, q: Tensor, s: Tensor, fp8_format: Optional[str]) -> Activation:
    return Activation(y, (q, s), fp8_format) if fp8_format is not None else Activation(y)
