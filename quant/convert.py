"""Swap the ``nn.Linear`` layers of a model for :class:`QuantLinear` in place, and back.

The swap API is keyword-only, like torchao's ``convert``; the new modules reuse the original
Parameters, so ``state_dict()`` (names, dtypes, storage) is that of the original model and
checkpoints stay ordinary HF checkpoints.

What stays BF16 (plain ``nn.Linear``):

* the output head — ``model.get_output_embeddings()`` when the model has it, and any module with a
  ``lm_head`` name component; embeddings are not ``nn.Linear`` and are never touched;
* with ``keep_last_n_layers=n``, the last ``n`` entries of the decoder layer list: the longest
  ``nn.ModuleList`` whose name ends in ``layers``, ``blocks`` or ``h`` (``model.layers`` in HF
  Llama/Qwen, ``model.transformer.blocks`` in LLaDA, ``transformer.h`` in GPT-2);
* modules matched by ``keep_modules``: a glob (``fnmatch``) matches a Linear when it matches the
  dotted path of any run of consecutive name components (``"shared_expert"``,
  ``"mlp.shared_expert"``, ``"model.layers.0.*"``); a pattern starting with ``re:`` is a regular
  expression searched in the full name. A pattern that matches no Linear is refused with the
  closest names (a typo would otherwise quantize what it meant to keep);
* modules for which ``module_filter_fn(module, fqn)`` returns False (it can only exclude more).

Names are matched after removing peft's ``base_model.model.`` prefix and ``base_layer``
components, so the same patterns work with and without LoRA. With a peft LoRA model only the
frozen ``base_layer`` of each ``lora.Linear`` is swapped; the adapters stay ``nn.Linear``.
Only exact ``nn.Linear`` instances are swapped (subclasses such as bitsandbytes layers are left).

Calling ``quantize_model`` again is harmless: the result is as if it was called once, with the
latest arguments (recipes updated; layers now excluded turn back into ``nn.Linear``).
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Optional, Union

from torch import nn

from jetrl_trainer.quant.fused import fuse_norm_and_swiglu, should_fuse, unfuse_norm_and_swiglu
from jetrl_trainer.quant.linear import QuantLinear
from jetrl_trainer.quant.recipe import RecipeLike, phase_recipes

__all__ = ["dequantize_model", "quantize_model"]

_log = logging.getLogger(__name__)
_LAYER_LIST_NAMES = ("layers", "blocks", "h")
_PEFT_PREFIX = "base_model.model."

ModuleFilter = Callable[[nn.Module, str], bool]


def quantize_model(
    model: nn.Module,
    *,
    train: RecipeLike = "fp8",
    rollout: RecipeLike = "fp8",
    keep_last_n_layers: int = 0,
    keep_modules: Union[str, Iterable[str]] = (),
    scale_format: str = "fp32",
    nvfp4_backward: str = "dequantized",
    module_filter_fn: Optional[ModuleFilter] = None,
    fuse_norms: Optional[bool] = None,
) -> nn.Module:
    """Swap ``model``'s Linear layers for ``QuantLinear`` (in place) and return ``model``.

    Args:
        train, rollout: recipe per phase: ``"bf16"``, ``"fp8"``, ``"nvfp4"`` or a ``Recipe``.
        keep_last_n_layers: keep the last N decoder layers in BF16.
        keep_modules: name patterns kept in BF16 (see the module docstring).
        scale_format: FP8 scale format for recipes given by name (``"fp32"`` or ``"ue8m0"``).
        nvfp4_backward: NVFP4 backward for recipes given by name (``"dequantized"``, ``"high_precision"``).
        module_filter_fn: ``(module, fqn) -> bool``; False keeps that Linear in BF16.
        fuse_norms: swap Qwen3/Llama/LLaDA RMSNorms (and Qwen3/Llama SwiGLU MLPs) for versions that
            hand their output's FP8 quantization to the next ``QuantLinear`` in the same kernel
            (``quant/fused.py``). ``None`` (default) fuses only on CUDA with Triton and an FP8 phase;
            elsewhere the modules stay as they are. Other architectures are left untouched.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantize_model expects an nn.Module; got {type(model).__name__}.")
    recipes = phase_recipes(train, rollout, scale_format=scale_format, nvfp4_backward=nvfp4_backward)
    patterns = _check_patterns(keep_modules)
    slots = list(_linear_slots(model))
    _check_patterns_match(model, patterns, [_logical_name(fqn) for *_, fqn in slots])
    kept_layers = _last_layer_prefixes(model, keep_last_n_layers)
    heads = _output_head_ids(model)
    converted = kept = 0
    swapped: dict[int, nn.Module] = {}  # a Linear shared under two names stays shared
    for parent, attr, linear, fqn in slots:
        if id(linear) in swapped:
            setattr(parent, attr, swapped[id(linear)])
            continue
        name = _logical_name(fqn)
        keep = (
            id(linear) in heads
            or "lm_head" in name.split(".")
            or any(name == p or name.startswith(p + ".") for p in kept_layers)
            or _matches_any(name, patterns)
            or (module_filter_fn is not None and not module_filter_fn(linear, fqn))
        )
        if keep:
            new = linear.to_linear() if isinstance(linear, QuantLinear) else linear
            kept += 1
        elif isinstance(linear, QuantLinear):
            linear.set_recipes(**recipes)
            new = linear
            converted += 1
        else:
            new = QuantLinear.from_linear(linear, recipes)
            converted += 1
        swapped[id(linear)] = new
        setattr(parent, attr, new)
    if fuse_norms if fuse_norms is not None else should_fuse(recipes):
        fuse_norm_and_swiglu(model)
    _log.info(
        "quantize_model: %d Linear layers -> QuantLinear(train=%s, rollout=%s); %d kept in BF16",
        converted, recipes["train"], recipes["rollout"], kept,
    )
    return model


def dequantize_model(model: nn.Module) -> nn.Module:
    """Turn every ``QuantLinear`` back into a plain ``nn.Linear`` and every fused norm/MLP back into
    the original module, with the same Parameters (in place)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"dequantize_model expects an nn.Module; got {type(model).__name__}.")
    unfuse_norm_and_swiglu(model)
    swapped: dict[int, nn.Module] = {}
    for parent, attr, linear, _ in list(_linear_slots(model)):
        if isinstance(linear, QuantLinear):
            swapped.setdefault(id(linear), linear.to_linear())
            setattr(parent, attr, swapped[id(linear)])
    _log.info("dequantize_model: %d QuantLinear layers -> nn.Linear", len(swapped))
    return model


# ---------------------------------------------------------------------------------------------


def _is_lora_wrapper(module: nn.Module) -> bool:
    # peft's lora.Linear (and its variants): a frozen `base_layer` plus `lora_A` / `lora_B` adapters.
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def _linear_slots(module: nn.Module, prefix: str = "") -> Iterator[tuple[nn.Module, str, nn.Module, str]]:
    """``(parent, attribute, linear, fqn)`` for every swappable Linear; LoRA: the base layer only."""
    for attr, child in module.named_children():
        fqn = f"{prefix}{attr}"
        if _is_lora_wrapper(child):
            base = child.base_layer
            if type(base) in (nn.Linear, QuantLinear):
                yield child, "base_layer", base, f"{fqn}.base_layer"
            elif isinstance(base, nn.Module):
                yield from _linear_slots(base, f"{fqn}.base_layer.")
        elif type(child) in (nn.Linear, QuantLinear):
            yield module, attr, child, fqn
        else:
            yield from _linear_slots(child, f"{fqn}.")


def _logical_name(fqn: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer`` -> ``model.layers.0.q_proj``."""
    if fqn.startswith(_PEFT_PREFIX):
        fqn = fqn[len(_PEFT_PREFIX):]
    return ".".join(part for part in fqn.split(".") if part != "base_layer")


def _output_head_ids(model: nn.Module) -> set[int]:
    head = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            head = None
    ids: set[int] = set()
    if isinstance(head, nn.Module):
        ids.add(id(head))
        base = getattr(head, "base_layer", None)  # the head itself wrapped by LoRA
        if isinstance(base, nn.Module):
            ids.add(id(base))
    return ids


def _last_layer_prefixes(model: nn.Module, n: int) -> tuple[str, ...]:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"keep_last_n_layers must be an int >= 0; got {n!r}.")
    if n == 0:
        return ()
    lists = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and fqn.rsplit(".", 1)[-1] in _LAYER_LIST_NAMES
    ]
    if not lists:
        raise ValueError(
            f"keep_last_n_layers={n}, but no decoder layer list (an nn.ModuleList named "
            f"{', '.join(repr(s) for s in _LAYER_LIST_NAMES)}) was found; use keep_modules=[...] instead."
        )
    fqn, layers = max(lists, key=lambda item: len(item[1]))
    if n > len(layers):
        raise ValueError(
            f"keep_last_n_layers={n} exceeds the {len(layers)} layers in {fqn!r}; allowed: 0..{len(layers)}."
        )
    base = _logical_name(fqn)
    return tuple(f"{base}.{i}" for i in range(len(layers) - n, len(layers)))


def _check_patterns(keep_modules: Union[str, Iterable[str]]) -> tuple[str, ...]:
    patterns = (keep_modules,) if isinstance(keep_modules, str) else tuple(keep_modules)
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"keep_modules must be non-empty name patterns (strings); got {p!r}.")
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as exc:
                raise ValueError(f"keep_modules pattern {p!r} is not a valid regular expression: {exc}.") from exc
    return patterns


def _check_patterns_match(model: nn.Module, patterns: tuple[str, ...], names: list[str]) -> None:
    """Refuse a pattern that keeps no Linear of ``model``, naming the closest module names."""
    for p in patterns:
        if any(_matches_any(name, (p,)) for name in names):
            continue
        pattern = p.removeprefix("re:")
        width = pattern.count(".") + 1  # compare with runs of as many name components
        runs = {
            ".".join(parts[i : i + width])
            for parts in (name.split(".") for name in names)
            for i in range(len(parts) - width + 1)
        }
        close = difflib.get_close_matches(pattern, sorted(runs), n=4, cutoff=0.6)
        hint = f"close names: {', '.join(close)}" if close else f"Linear names look like {names[0]!r}" if names else ""
        raise ValueError(
            f"keep_modules (keep_bf16_modules) pattern {p!r} matches no Linear layer of {type(model).__name__}"
            + (f"; {hint}." if hint else "; it has none.")
        )


def _matches_any(name: str, patterns: tuple[str, ...]) -> bool:
    if not patterns:
        return False
    parts = name.split(".")
    runs = [".".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
    for p in patterns:
        if p.startswith("re:"):
            if re.search(p[3:], name):
                return True
        elif any(fnmatch.fnmatchcase(run, p) for run in runs):
            return True
    return False
