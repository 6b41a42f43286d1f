"""Worker for tests/trainer/test_distributed.py: a few JetGRPOTrainer steps under ``accelerate launch``.

Not a test module (pytest collects ``test_*.py`` only). Each process trains the tiny model saved by
the test, for every ``--strategy`` in turn, and writes ``<out>/<strategy>/rank<r>.json`` with, per
optimizer step:

* ``param_sha256`` — a hash of every parameter's bytes after the update (ZeRO-3 shards are gathered
  first), so the test can compare ranks;
* ``quantizations`` — each `QuantLinear`'s ``weight_quantizations`` counter at the start and at the
  end of the step, and ``stale_after_update`` — whether every cached quantized weight was out of
  date right after the optimizer step (the cache invalidated on this rank);
* the logged metrics (``logs``), and the *local* corrector sums of every corrector call on this
  rank before any all-reduce (``sums``: value and dtype per key), from which the test recomputes
  the figure over all ranks' tokens and each rank's local-only figure.

After the last record it leaves without interpreter finalization (`jetrl_trainer.exit_process`), and
if finalization ever starts it writes ``<out>/rank<r>.finalized.json`` with the gloo threads
still alive then, which the test requires to be none.

Usage (what the test runs; 2 processes over gloo on a CPU-only machine)::

    accelerate launch --config_file examples/configs/accelerate_cpu_2proc.yaml tests/trainer/dist_worker.py \\
        --model DIR --out DIR --steps 2 --strategy fp8:fp8:ais --strategy bf16:fp8:tis
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer, exit_process
from jetrl_trainer.quant import QuantLinear

__all__: list[str] = []


def byte_reward(completions, **kwargs) -> list[float]:
    """Mean byte value of the completion text: continuous, so GRPO advantages are never all zero."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(t.encode()) / (255 * max(1, len(t.encode()))) for t in texts]


def prompts(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i}+{2 * i}="}] for i in range(n)]})


class RecordingCorrector:
    """Wraps the trainer's corrector and keeps the local sums of every call (before any reduction),
    plus the sum of the training log-probs of the completion tokens (which data this rank saw)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[dict[str, list]] = []
        self.train_logp_sums: list[float] = []

    def __call__(self, train_logps, rollout_logps, mask, advantages):
        correction = self.inner(train_logps, rollout_logps, mask, advantages)
        self.calls.append({k: [v.item(), str(v.dtype).removeprefix("torch.")] for k, v in correction.sums.items()})
        self.train_logp_sums.append(float(torch.where(mask.bool(), train_logps.double(), 0.0).sum()))
        return correction


def _gathered(params: list[torch.nn.Parameter]):
    """ZeRO-3 keeps a shard per rank: gather the full parameters (a collective) to hash them."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def param_sha256(model: torch.nn.Module) -> str:
    named = sorted(model.named_parameters())
    digest = hashlib.sha256()
    with _gathered([p for _, p in named]):
        for name, p in named:
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _cache_is_stale(layer: QuantLinear) -> bool:
    # White-box: every cached entry's state key must differ from the layer's current key.
    key = layer._state_key()
    return all(state != key for state, _ in layer._weight_cache.values())


class Recorder(TrainerCallback):
    """Per-step parameter hash, quantization counters and cache staleness; logged metrics."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        self.initial_sha256 = ""
        self.steps: list[dict[str, Any]] = []
        self.logs: list[dict[str, float]] = []
        self._begin: dict[str, int] = {}

    def _counts(self) -> dict[str, int]:
        return {n: m.weight_quantizations for n, m in self.layers.items()}

    def on_train_begin(self, args, state, control, **kwargs):
        self.initial_sha256 = param_sha256(self.model)  # after the engine has wrapped/sharded the model

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = self._counts()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({
            "step": state.global_step,
            "param_sha256": param_sha256(self.model),
            "quantizations_begin": self._begin,
            "quantizations_end": self._counts(),
            "stale_after_update": all(_cache_is_stale(m) for m in self.layers.values()),
        })  # fmt: skip

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})


def run(model_dir: str, out: Path, strategy: str, steps: int, deepspeed: bool) -> None:
    train_precision, rollout_precision, corrector = strategy.split(":")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = JetGRPOConfig(
        output_dir=str(out / "trainer"),
        train_precision=train_precision,
        rollout_precision=rollout_precision,
        corrector=corrector,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=steps,
        logging_steps=1,
        learning_rate=1e-2,
        report_to="none",
        bf16=False,
        # DeepSpeed is skipped by accelerate when use_cpu=True; on a CPU box it runs over gloo instead.
        use_cpu=not deepspeed,
        ddp_backend="gloo",
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = JetGRPOTrainer(
        model, byte_reward, args=args, train_dataset=prompts(16), processing_class=tokenizer
    )
    recording = RecordingCorrector(trainer.corrector)
    trainer.corrector = recording
    recorder = Recorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    state = trainer.accelerator.state
    record = {
        "rank": state.process_index,
        "world_size": state.num_processes,
        "distributed_type": str(state.distributed_type),
        "zero_stage": trainer.accelerator.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None,
        "n_quant_linear": len(recorder.layers),
        "initial_sha256": recorder.initial_sha256,
        "steps": recorder.steps,
        "logs": recorder.logs,
        "sums": recording.calls,
        "train_logp_sums": recording.train_logp_sums,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{state.process_index}.json").write_text(json.dumps(record, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="directory with the saved tiny model + tokenizer")
    parser.add_argument("--out", required=True, help="directory for <strategy>/rank<r>.json")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--strategy", action="append", required=True, help="train:rollout:corrector")
    parser.add_argument("--deepspeed", action="store_true", help="launched with --use_deepspeed")
    a = parser.parse_args()
    atexit.register(record_finalization, Path(a.out) / f"rank{os.environ.get('RANK', '0')}.finalized.json")
    for strategy in a.strategy:
        run(a.model, Path(a.out) / strategy.replace(":", "-"), strategy, a.steps, a.deepspeed)
    exit_process(0)  # no interpreter finalization: it races gloo's threads (jetrl_trainer.exit_process)


def gloo_threads() -> list[str]:
    """Names of this process's live gloo threads (Linux; empty elsewhere)."""
    names = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
    return sorted(n for n in names if "gloo" in n)


def record_finalization(path: Path) -> None:
    # atexit runs just before finalization: record the threads that finalization would race.
    path.write_text(json.dumps({"gloo_threads": gloo_threads()}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
