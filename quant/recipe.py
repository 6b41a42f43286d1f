"""Quantization recipes: small frozen dataclasses, built by name with :func:`get_recipe`.

A ``QuantLinear`` holds one recipe per precision phase (``train`` / ``rollout``). Equal recipes in
both phases is the unified precision flow; ``train=bf16, rollout=fp8`` is the common baseline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Union

from jetrl_trainer._choices import NVFP4_BACKWARDS, PHASES, PRECISIONS, SCALE_FORMATS, check_choice
from jetrl_trainer.kernels.settings import DecodeGemmSettings, QuantKernelSettings

__all__ = [
    "NVFP4_BACKWARDS",
    "PRECISIONS",
    "BF16Recipe",
    "FP8Recipe",
    "NVFP4Recipe",
    "Recipe",
    "RecipeLike",
    "get_recipe",
    "phase_recipes",
]


@dataclass(frozen=True)
class Recipe:
    """Base class; ``name`` is the registry name, ``str(recipe)`` the short form shown in ``repr``."""

    name: ClassVar[str] = ""

    @property
    def quantized(self) -> bool:
        return True


@dataclass(frozen=True)
class BF16Recipe(Recipe):
    """No quantization: the layer computes exactly ``F.linear(x, weight, bias)``."""

    name: ClassVar[str] = "bf16"

    @property
    def quantized(self) -> bool:
        return False

    def __str__(self) -> str:
        return "bf16"


@dataclass(frozen=True)
class FP8Recipe(Recipe):
    """FP8 E4M3: activations 1×128 groups, weights 128×128 blocks, FP8 dgrad/wgrad.

    The format, and what forward and backward compute: docs/architecture.md#the-fp8-linear.

    Parameters:
        scale_format: ``"fp32"`` scales, or ``"ue8m0"`` (power-of-two scales, rounded up).
        kernels: launch settings of the quantization kernels this recipe's layers run.
        decode_gemm: launch settings of the split-K decode GEMM (rollouts at decode-sized M).
    """

    name: ClassVar[str] = "fp8"
    scale_format: str = "fp32"
    kernels: QuantKernelSettings = QuantKernelSettings()
    decode_gemm: DecodeGemmSettings = DecodeGemmSettings()

    def __post_init__(self) -> None:
        check_choice("FP8 scale_format", self.scale_format, SCALE_FORMATS)

    def __str__(self) -> str:
        suffix = "" if self.scale_format == "fp32" else f",{self.scale_format}"
        return f"fp8(e4m3,1x128/128x128{suffix})"


@dataclass(frozen=True)
class NVFP4Recipe(Recipe):
    """Emulated NVFP4: E2M1 in 1×16 blocks, E4M3 block scales, per-token / per-tensor FP32 outer.

    Parameters:
        backward: ``"dequantized"`` — the gradient of the quantized op that actually ran
            (dX = dY·deq(W_q), dW = dYᵀ·deq(X_q), FP32 matmuls); ``"high_precision"`` — the
            BF16 operands (X and W as given; X is then saved in its own dtype).
        four_over_six: per block, keep the better of "max → 6" and "max → 4" (smaller squared error).
    """

    name: ClassVar[str] = "nvfp4"
    backward: str = "dequantized"
    four_over_six: bool = True

    def __post_init__(self) -> None:
        check_choice("NVFP4 backward", self.backward, NVFP4_BACKWARDS)
        if not isinstance(self.four_over_six, bool):
            raise ValueError(f"four_over_six must be True or False; got {self.four_over_six!r}.")

    def __str__(self) -> str:
        fos = ",4/6" if self.four_over_six else ""
        return f"nvfp4(e2m1,1x16{fos},bwd={self.backward})"


_REGISTRY: dict[str, type[Recipe]] = {cls.name: cls for cls in (BF16Recipe, FP8Recipe, NVFP4Recipe)}
RecipeLike = Union[str, Recipe]


def get_recipe(name_or_recipe: RecipeLike, **kwargs: object) -> Recipe:
    """Build a recipe by name (``"bf16"``, ``"fp8"``, ``"nvfp4"``) with field overrides.

    A :class:`Recipe` instance is returned as is, or copied with ``kwargs`` replaced.
    """
    if isinstance(name_or_recipe, Recipe):
        cls, base = type(name_or_recipe), name_or_recipe
    elif isinstance(name_or_recipe, str):
        cls, base = _REGISTRY[check_choice("recipe", name_or_recipe, PRECISIONS, normalize=True)], None
    else:
        names = ", ".join(PRECISIONS)
        raise ValueError(f"recipe must be a name ({names}) or a Recipe instance; got {name_or_recipe!r}.")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        allowed = ", ".join(sorted(fields)) or "none"
        raise ValueError(f"Recipe {cls.name!r} has no option(s) {', '.join(unknown)}; allowed: {allowed}.")
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def _named_options(name: str, scale_format: str, nvfp4_backward: str) -> dict[str, object]:
    # Only the options that belong to the named recipe, so "bf16" ignores the FP8 / NVFP4 knobs.
    key = name.strip().lower()
    return {"fp8": {"scale_format": scale_format}, "nvfp4": {"backward": nvfp4_backward}}.get(key, {})


def phase_recipes(
    train: RecipeLike = "fp8",
    rollout: RecipeLike = "fp8",
    *,
    scale_format: str = "fp32",
    nvfp4_backward: str = "dequantized",
) -> dict[str, Recipe]:
    """``{"train": Recipe, "rollout": Recipe}``. Names get the option that applies to them
    (``scale_format`` for fp8, ``nvfp4_backward`` for nvfp4); Recipe instances are used as given."""
    recipes: dict[str, Recipe] = {}
    for phase, spec in zip(PHASES, (train, rollout)):
        if isinstance(spec, str):
            recipes[phase] = get_recipe(spec, **_named_options(spec, scale_format, nvfp4_backward))
        else:
            recipes[phase] = get_recipe(spec)
    return recipes
