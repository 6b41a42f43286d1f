"""An opt-in ``torch.compile`` of the policy's decoder stack for the trainer's log-prob forwards.

The loss forward (and the old / reference log-probs in the train phase) runs the decoder layers,
not the LM head: TRL computes the head and the log-softmax itself. Compiling those layers cuts the
launches and elementwise work around each quantized linear (the FP8 quant ops are registered custom
ops, so they stay single calls in the graph); on an 8B-shaped actor update it measured faster in
BF16 and in FP8 alike (docs/performance.md). ``mode="reduce-overhead"``
replays the compiled forward and backward as CUDA graphs (inductor's cudagraph trees); they read the
parameters in place, so an optimizer step needs no re-capture.

Only the scorer's train-phase forwards of the policy go through the compiled code: rollouts
(``generate``, the engine's prefill) and rollout-phase rescoring call the module's own forward, so
the decode loop never traces. Sequences are right-padded to a multiple of ``length_multiple`` so
that a few static shapes cover a run; a completion's log-probs do not depend on what follows it
(causal attention), and the padded positions are dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jetrl_trainer.quant.phase import PrecisionPhases

__all__ = ["CompiledBackbone", "compile_unavailable_reason"]


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under DDP / peft wrappers."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def compile_unavailable_reason(model: nn.Module, gradient_checkpointing: bool) -> str | None:
    """Why the policy's forward cannot be compiled here, or None."""
    if gradient_checkpointing:
        return "gradient checkpointing recomputes each layer in the backward, outside one compiled graph"
    backbone = getattr(_base_model(model), "model", None)
    if not isinstance(backbone, nn.Module) or not hasattr(backbone, "layers"):
        return f"{type(_base_model(model)).__name__} has no decoder stack at .model.layers"
    if any(hasattr(p, "ds_id") for p in backbone.parameters()):
        return "DeepSpeed ZeRO-3 gathers each weight in hooks that a compiled graph would bypass"
    return None


class CompiledBackbone:
    """The policy's ``model.model`` compiled once, used only inside :meth:`active`."""

    def __init__(self, model: nn.Module, *, length_multiple: int, backend: str = "inductor",
                 mode: str | None = None) -> None:  # fmt: skip
        if length_multiple < 1:
            raise ValueError(f"length_multiple must be >= 1; got {length_multiple}.")
        self.base = _base_model(model)
        self.backbone: nn.Module = self.base.model
        self.length_multiple = length_multiple
        self.backend = backend
        self.mode = mode
        self._compiled = None

    def applies_to(self, model: nn.Module) -> bool:
        """The policy (not a reference model), in the train phase (the one the graph was traced in)."""
        return _base_model(model) is self.base and PrecisionPhases(self.base).phase == "train"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """While open, the backbone's forward is the compiled one."""
        if self._compiled is None:
            from jetrl_trainer.kernels import resolve_dispatch

            device = next(self.backbone.parameters()).device
            resolve_dispatch(device)  # dispatch caches filled now, not inside the trace
            self._compiled = torch.compile(self.backbone.forward, backend=self.backend, mode=self.mode, dynamic=False)
        if self.mode == "reduce-overhead":
            # A new CUDA-graph step per scorer call: the previous call's outputs are consumed (its backward
            # has run), so their graph memory may be reused; the chunks of one call keep theirs.
            torch.compiler.cudagraph_mark_step_begin()
        had, previous = "forward" in self.backbone.__dict__, self.backbone.__dict__.get("forward")
        self.backbone.forward = self._compiled
        try:
            yield
        finally:
            if had:
                self.backbone.forward = previous
            else:
                del self.backbone.forward  # back to the class's forward

    def pad(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, int]:
        """``input_ids`` and ``attention_mask`` right-padded to the length multiple, and the pad width."""
        pad = -input_ids.size(1) % self.length_multiple
        if pad == 0:
            return input_ids, attention_mask, 0
        return F.pad(input_ids, (0, pad), value=0), F.pad(attention_mask, (0, pad), value=0), pad
