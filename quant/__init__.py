"""FP8 / NVFP4 quantization: the numerics contract, QuantLinear and model conversion.

Two objects carry the state of a converted model, and whoever trains it owns them (``JetGRPOTrainer``
does): :class:`PrecisionPhases` switches the model between its ``train`` and ``rollout`` recipes,
and :class:`WeightCacheRefresh` makes every optimizer step re-quantize the weights. Nothing is
switched or registered at import.
"""

from jetrl_trainer.quant.convert import dequantize_model, quantize_model
from jetrl_trainer.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    fp8_scale_from_amax,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)
from jetrl_trainer.quant.linear import QuantLinear, invalidate_weight_caches
from jetrl_trainer.quant.nvfp4 import E2M1_GRID, NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4, round_to_e2m1
from jetrl_trainer.quant.phase import PHASES, PrecisionPhases
from jetrl_trainer.quant.recipe import BF16Recipe, FP8Recipe, NVFP4Recipe, Recipe, get_recipe, phase_recipes
from jetrl_trainer.quant.refresh import WeightCacheRefresh
from jetrl_trainer.quant.stats import count_quant_gemms

__all__ = [
    "E2M1_GRID",
    "FP8_DTYPE",
    "FP8_MAX",
    "PHASES",
    "BF16Recipe",
    "FP8Recipe",
    "NVFP4Recipe",
    "NVFP4Tensor",
    "PrecisionPhases",
    "QuantLinear",
    "Recipe",
    "WeightCacheRefresh",
    "count_quant_gemms",
    "dequantize_fp8_blocks",
    "dequantize_fp8_groups",
    "dequantize_model",
    "dequantize_nvfp4",
    "fp8_scale_from_amax",
    "get_recipe",
    "invalidate_weight_caches",
    "phase_recipes",
    "quantize_fp8_blocks",
    "quantize_fp8_groups",
    "quantize_model",
    "quantize_nvfp4",
    "round_to_e2m1",
]
