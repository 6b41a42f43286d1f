"""The decode step's residual stream: each residual add fused into the RMSNorm that follows it.

A Llama-family layer adds the attention output, then the MLP output, to the residual stream, and
each add is followed by an RMSNorm (the next sub-layer's input norm, or the final norm). At decode
those adds are tiny launches, and so is the split-K reduction of the o / down projection that
produces them. Where the norm is a `FusedRMSNorm` on CUDA, `ResidualStream` hands it the pending
output, as a tensor or as the projection's unreduced `SplitSums`, and one kernel does the reduction,
the add, the norm and the FP8 quantization for the next GEMM (`FusedRMSNorm.add_forward`). The
bits are those of the unfused order (reduce, round, add, norm); anything else adds the usual way.
"""

from __future__ import annotations

from torch import Tensor, nn

from .projections import SplitSums

__all__ = ["ResidualStream"]


class ResidualStream:
    """``h``, with at most one pending addition that the next ``norm`` call may fuse."""

    def __init__(self, h: Tensor, fuse: bool) -> None:
        self.h = h
        self.fuse = fuse
        self._pending: Tensor | SplitSums | None = None

    def add(self, delta: Tensor | SplitSums) -> None:
        """``h = h + delta``, deferred to the next :meth:`norm` or :meth:`value`."""
        self._flush()
        self._pending = delta

    def norm(self, module: nn.Module) -> Tensor:
        """``module(h)`` after the pending add; one fused launch where ``module`` offers one."""
        delta = self._pending
        if delta is not None and self.fuse and hasattr(module, "add_forward") and delta.dtype == self.h.dtype:
            if isinstance(delta, SplitSums):
                fused = module.add_forward(self.h, parts=delta.parts, bias=delta.bias)
            else:
                fused = module.add_forward(self.h, delta)
            if fused is not None:
                self.h, y = fused
                self._pending = None
                return y
        self._flush()
        return module(self.h)

    def value(self) -> Tensor:
        """``h`` with every add applied."""
        self._flush()
        return self.h

    def _flush(self) -> None:
        if self._pending is not None:
            delta = self._pending.materialize() if isinstance(self._pending, SplitSums) else self._pending
            self.h = self.h + delta
            self._pending = None
