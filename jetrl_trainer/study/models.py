"""Model builders: ``builder(seed=, task=, max_completion_length=, sft_dataset=) -> (model, tokenizer)``.

The study calls a builder once per seed and deep-copies the result for each strategy, so every
strategy of a seed starts from the same weights. `TinyModel` builds a tiny local model and warm-
starts it on the task (a plain SFT for autoregressive models, LLaDA's masked-diffusion SFT for
LLaDA); `PretrainedModel` loads a checkpoint as it is. Both are frozen dataclasses, so a study can
record exactly which model its runs came from, and resume refuses runs of another model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Protocol

from jetrl_trainer._choices import TINY_ARCHS, check_choice

__all__ = ["TINY_ARCHS", "ModelBuilder", "PretrainedModel", "TinyModel", "describe_builder"]


class ModelBuilder(Protocol):
    def __call__(self, *, seed: int, task: Any, max_completion_length: int, sft_dataset: Any) -> tuple[Any, Any]: ...


@dataclass(frozen=True)
class TinyModel:
    """A tiny model from `jetrl_trainer.tiny`, warm-started on the study's warm-start prompts.

    ``warm_start_steps=0`` skips the warm start (GRPO then sees all-equal rewards and learns nothing).
    ``config_overrides`` are config fields of the tiny builder as ``(name, value)`` pairs (a larger
    local model, e.g. ``(("hidden_size", 1024), ("num_hidden_layers", 24))``); ``device`` is where it
    is built and warm-started.
    """

    arch: str = "qwen3"
    warm_start_steps: int = 60
    warm_start_lr: float = 3e-3
    warm_start_batch_size: int = 32
    dtype: str = "float32"
    config_overrides: tuple[tuple[str, Any], ...] = ()
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_choice("arch", self.arch, TINY_ARCHS)
        if self.warm_start_steps < 0:
            raise ValueError(f"warm_start_steps must be >= 0; got {self.warm_start_steps}.")

    def __call__(self, *, seed: int, task: Any, max_completion_length: int, sft_dataset: Any) -> tuple[Any, Any]:
        from jetrl_trainer import tiny

        tokenizer = tiny.build_tiny_tokenizer()
        if self.arch == "llada":
            return self._llada(tokenizer, seed, task, max_completion_length, sft_dataset), tokenizer
        model = getattr(tiny, f"build_tiny_{self.arch}")(tokenizer, seed=seed, dtype=self.dtype,
                                                         **dict(self.config_overrides)).to(self.device)  # fmt: skip
        if self.warm_start_steps:
            tiny.warm_start(model, tokenizer, task, steps=self.warm_start_steps, lr=self.warm_start_lr,
                            batch_size=self.warm_start_batch_size, seed=seed, dataset=sft_dataset)  # fmt: skip
        return model.eval(), tokenizer

    def _llada(self, tokenizer, seed: int, task: Any, gen_length: int, sft_dataset: Any):
        import torch

        from jetrl_trainer.diffusion import build_tiny_llada, diffusion_warm_start
        from jetrl_trainer.tiny import END_OF_TURN

        model = build_tiny_llada(
            vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TURN), seed=seed, dtype=getattr(torch, self.dtype),
            **dict(self.config_overrides),
        ).to(self.device)  # fmt: skip  (end of turn as EOS, as examples/train_llada.py builds it)
        if self.warm_start_steps:
            diffusion_warm_start(model, tokenizer, task, steps=self.warm_start_steps, gen_length=gen_length, seed=seed,
                                 batch_size=self.warm_start_batch_size, lr=self.warm_start_lr,
                                 dataset=sft_dataset)  # fmt: skip
        return model.eval()


@dataclass(frozen=True)
class PretrainedModel:
    """A checkpoint (Hub id or folder) loaded with the Auto classes; LLaDA ids load too. No warm start."""

    model_id: str
    dtype: str = "bfloat16"

    def __call__(self, *, seed: int, task: Any, max_completion_length: int, sft_dataset: Any) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import jetrl_trainer.diffusion  # noqa: F401  (registers model_type "llada")

        tokenizer = AutoTokenizer.from_pretrained(self.model_id, padding_side="left")
        return AutoModelForCausalLM.from_pretrained(self.model_id, dtype=self.dtype).eval(), tokenizer


def describe_builder(builder: Any) -> dict[str, Any]:
    """A JSON-able identity of ``builder``: its fields for a dataclass, else its qualified name."""
    kind = f"{type(builder).__module__}.{type(builder).__qualname__}"
    if is_dataclass(builder):
        return {"builder": kind, **asdict(builder)}
    return {"builder": getattr(builder, "__qualname__", kind)}
