"""Shared set-up for the JetGRPOTrainer tests: tiny offline models (Qwen3, LLaDA), prompts and a reward with spread.

Kept small on purpose: 4 prompts x 4 generations x 4 new tokens, one optimizer step. The reward
(mean byte value of the completion text, in [0, 1]) is continuous, so it differs between any two
samples of an untrained model: GRPO advantages, and hence gradients, are non-zero from the first step.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from datasets import Dataset

from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
from jetrl_trainer.quant import count_quant_gemms
from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

FAST = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=4,
    max_steps=1,
    logging_steps=1,
    learning_rate=1e-2,
    report_to="none",
    bf16=False,
    use_cpu=True,
    gradient_checkpointing=False,
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
)


@functools.cache
def tokenizer():
    return build_tiny_tokenizer()


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_tiny_qwen3(tokenizer())


def prompts(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i}+{2 * i}="}] for i in range(n)]})


def byte_reward(completions, **kwargs) -> list[float]:
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(t.encode()) / (255 * max(1, len(t.encode()))) for t in texts]


def make_args(tmp_path, **overrides: Any) -> JetGRPOConfig:
    return JetGRPOConfig(output_dir=str(tmp_path), **{**FAST, **overrides})


def make_trainer(tmp_path, model=None, trainer_cls=JetGRPOTrainer, trainer_kwargs=None, **overrides):
    return trainer_cls(
        tiny_model() if model is None else model,
        byte_reward,
        args=make_args(tmp_path, **overrides),
        train_dataset=prompts(),
        processing_class=tokenizer(),
        **(trainer_kwargs or {}),
    )


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(model, before: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]


def train(trainer, **train_kwargs):
    """Train; return (first step's logs, Counter of (phase, recipe) GEMM calls)."""
    with count_quant_gemms() as counts:
        trainer.train(**train_kwargs)
    steps = [log for log in trainer.state.log_history if "loss" in log]
    return (steps[0] if steps else {}), counts


def strategy_runs(tmp_path_factory, make):
    """``get((train, rollout, corrector))`` trains one step per strategy once and caches the run
    (trainer, first-step logs, GEMM counts, changed parameter names) for a module's tests."""
    cache = {}

    def get(strategy):
        if strategy not in cache:
            tp, rp, corrector = strategy
            trainer = make(tmp_path_factory.mktemp("run"), train_precision=tp, rollout_precision=rp, corrector=corrector)
            before = snapshot(trainer.model)
            logs, counts = train(trainer)
            cache[strategy] = dict(trainer=trainer, logs=logs, counts=counts, changed=changed(trainer.model, before))
        return cache[strategy]

    return get


AUTO_MAP = {  # the published config.json carries it (and TRL reads it when it loads a reference model by path)
    "AutoConfig": "configuration_llada.LLaDAConfig",
    "AutoModel": "modeling_llada.LLaDAModelLM",
    "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
}


def tiny_llada(seed: int = 0):
    from jetrl_trainer.diffusion import build_tiny_llada  # only the LLaDA tests import diffusion

    tok = tokenizer()
    return build_tiny_llada(
        vocab_size=len(tok), mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, seed=seed,
    )  # fmt: skip


def save_published_layout(path) -> str:
    """A tiny checkpoint as the Hub has LLaDA: config keys, weight names and the remote-code auto_map."""
    tiny_llada().save_pretrained(path)
    tokenizer().save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "auto_map": AUTO_MAP}))
    return str(path)
