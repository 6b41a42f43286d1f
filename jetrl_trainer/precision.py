"""The two phases of a GRPO step (``train`` / ``rollout``) and which recipe each uses.

Thin on purpose: precision names map to recipes (:func:`phase_recipes`), and the phase context
manager lives in :mod:`jetrl_trainer.quant.phase`. Equal precisions = the unified flow (Jet-RL);
``train="bf16", rollout="fp8"`` = the common baseline.
"""

from __future__ import annotations

from jetrl_trainer.quant.phase import PHASES, current_phase, precision_phase
from jetrl_trainer.quant.recipe import RECIPE_NAMES, Recipe, RecipeLike, phase_recipes

__all__ = ["PHASES", "PRECISIONS", "current_phase", "is_unified", "phase_recipes", "precision_phase"]

PRECISIONS: tuple[str, ...] = RECIPE_NAMES  # ("bf16", "fp8", "nvfp4")


def is_unified(train: RecipeLike, rollout: RecipeLike, **options: str) -> bool:
    """True when both phases run the same recipe, so rollout and training agree bit for bit."""
    recipes: dict[str, Recipe] = phase_recipes(train, rollout, **options)
    return recipes["train"] == recipes["rollout"]
