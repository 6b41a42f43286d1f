"""jetrl_trainer/_choices.py: each set of allowed values defined once, validated by one helper."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from jetrl_trainer import _choices
from jetrl_trainer._choices import check_choice

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("jetrl_trainer", "quant", "kernels", "correctors")


def test_check_choice_strict_by_default():
    assert check_choice("scale_format", "ue8m0", _choices.SCALE_FORMATS) == "ue8m0"
    with pytest.raises(ValueError, match="scale_format must be one of fp32, ue8m0; got 'UE8M0'"):
        check_choice("scale_format", "UE8M0", _choices.SCALE_FORMATS)


def test_check_choice_normalize_for_user_configs():
    assert check_choice("train_precision", " FP8 ", _choices.PRECISIONS, normalize=True) == "fp8"
    with pytest.raises(ValueError, match="train_precision must be one of bf16, fp8, nvfp4; got 'fp16'"):
        check_choice("train_precision", "fp16", _choices.PRECISIONS, normalize=True)
    with pytest.raises(ValueError, match="got None"):
        check_choice("train_precision", None, _choices.PRECISIONS, normalize=True)


def test_check_choice_dtypes():
    assert check_choice("x dtype", torch.bfloat16, _choices.FLOAT_DTYPES) is torch.bfloat16
    with pytest.raises(ValueError, match="x dtype must be one of float32, bfloat16, float16; got int8"):
        check_choice("x dtype", torch.int8, _choices.FLOAT_DTYPES)


def test_every_consumer_reads_the_one_definition():
    from jetrl_trainer import config
    from jetrl_trainer.diffusion import sampler
    from jetrl_trainer.kernels import gemm
    from jetrl_trainer.quant import fp8, nvfp4, phase, recipe

    assert config.PRECISIONS is recipe.PRECISIONS is _choices.PRECISIONS
    assert fp8.SCALE_FORMATS is _choices.SCALE_FORMATS
    assert recipe.NVFP4_BACKWARDS is _choices.NVFP4_BACKWARDS
    assert nvfp4.NVFP4_OUTERS is _choices.NVFP4_OUTERS
    assert phase.PHASES is _choices.PHASES
    assert sampler.REMASKING is _choices.REMASKINGS
    assert gemm.GRANULARITIES is _choices.GRANULARITIES
    assert tuple(recipe._REGISTRY) == _choices.PRECISIONS  # one recipe class per precision name
    fields = {f.name: f for f in dataclasses.fields(config.JetGRPOConfig)}
    for name, allowed in (
        ("train_precision", _choices.PRECISIONS),
        ("rollout_precision", _choices.PRECISIONS),
        ("fp8_scale_format", _choices.SCALE_FORMATS),
        ("nvfp4_backward", _choices.NVFP4_BACKWARDS),
        ("diffusion_remasking", _choices.REMASKINGS),
    ):
        assert fields[name].metadata["choices"] == list(allowed), name  # what --help lists


@pytest.mark.parametrize(
    "name",
    ["PRECISIONS", "PHASES", "SCALE_FORMATS", "NVFP4_BACKWARDS", "NVFP4_OUTERS", "REMASKINGS", "GRANULARITIES",
     "STUDY_STRATEGIES", "STUDY_STRATEGIES_NVFP4", "TINY_ARCHS"],
)
def test_no_module_spells_out_its_own_copy(name):
    values = getattr(_choices, name)
    literal = ", ".join(f'"{v}"' for v in values)  # e.g. '"fp32", "ue8m0"'
    copies = [
        str(path.relative_to(ROOT))
        for folder in PACKAGE_DIRS
        for path in (ROOT / folder).rglob("*.py")
        if path.name != "_choices.py" and literal in path.read_text()
    ]
    assert copies == [], f"{name} is spelled out again in {copies}; import it from jetrl_trainer._choices"


def test_no_module_spells_out_the_float_dtypes():
    spellings = ("torch.float32, torch.bfloat16, torch.float16", "torch.bfloat16, torch.float16, torch.float32")
    copies = [
        str(path.relative_to(ROOT))
        for folder in PACKAGE_DIRS
        for path in (ROOT / folder).rglob("*.py")
        if path.name != "_choices.py" and any(s in path.read_text() for s in spellings)
    ]
    assert copies == []
