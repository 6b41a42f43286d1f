"""GRPO for LLaDA (masked-diffusion LM) with JetGRPOTrainer: FP8 rollouts, any corrector, LoRA or full.

    # CPU, offline: a tiny LLaDA, a short masked-diffusion warm start, then GRPO on countdown
    accelerate launch examples/train_llada.py
    accelerate launch --num_processes 1 --cpu examples/train_llada.py --fast        # ~1 minute smoke run

    # GPUs: LLaDA-8B-Instruct (one YAML per strategy in examples/configs/llada_8b_*.yaml)
    accelerate launch --config_file examples/configs/accelerate_multigpu.yaml examples/train_llada.py \\
        --config examples/configs/llada_8b_unified_fp8.yaml
    accelerate launch --config_file examples/configs/accelerate_multigpu.yaml examples/train_llada.py \\
        --model_name_or_path GSAI-ML/LLaDA-8B-Instruct --lora --train_precision bf16 --rollout_precision fp8 \\
        --corrector ais

Every option is a flag or a YAML key (TrlParser): `JetGRPOConfig` (TRL's GRPOConfig, the
precision/corrector knobs, and the diffusion knobs ``diffusion_steps``, ``diffusion_block_length``,
``diffusion_remasking``, ``p_mask_prompt``) plus the script options below (``--help`` lists them).
Without ``--model_name_or_path`` the run uses a tiny LLaDA built locally and CPU-sized defaults;
with it, LLaDA-8B-sized defaults (d1's sampler: 256 tokens, blocks of 32, 128 steps). Command-line
flags override the YAML, which overrides those defaults.

The tiny model is warm-started with LLaDA's SFT objective (mask each completion token with
probability t ~ U(0, 1), cross-entropy on the masked tokens weighted by 1/t), because GRPO learns
nothing from groups whose rewards are all equal, as they are for an untrained model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback
from trl import TrlParser

from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer, exit_process
from jetrl_trainer.diffusion import diffusion_warm_start
from jetrl_trainer.tasks import get_task

TASKS = ("countdown", "sudoku", "arithmetic")

# Defaults per mode; YAML keys and flags override them. "tiny" = no --model_name_or_path.
REAL = dict(
    output_dir="runs/llada-8b", train_precision="fp8", rollout_precision="fp8", corrector="none",
    max_completion_length=256, diffusion_block_length=32, diffusion_steps=128, p_mask_prompt=0.3,
    num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=2, num_iterations=2,
    learning_rate=3e-6, beta=0.04, temperature=0.9, max_steps=500, bf16=True, gradient_checkpointing=True,
    logging_steps=1, save_steps=100, report_to="none", prompt_style="instruct", warm_start_steps=0,
)  # fmt: skip
TINY = dict(
    output_dir="runs/llada-tiny", train_precision="fp8", rollout_precision="fp8", corrector="none",
    max_completion_length=16, diffusion_steps=8, num_generations=8, per_device_train_batch_size=16,
    learning_rate=1e-3, lr_scheduler_type="constant", beta=0.0, max_steps=30, bf16=False,
    gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none",
    prompt_style="short", warm_start_steps=500, num_train_samples=1024,
)  # fmt: skip
FAST = dict(
    max_completion_length=8, diffusion_block_length=None, diffusion_steps=4, num_generations=4,
    per_device_train_batch_size=4, max_steps=2, warm_start_steps=10, num_train_samples=16,
)  # fmt: skip
LOGGED = ("reward", "reward_std", "loss", "kl", "entropy", "mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max",
          "mismatch/kl_k3", "corrector/weight_mean", "corrector/alpha", "jetrl/skipped_steps")  # fmt: skip


@dataclass
class LLaDAScriptArguments:
    """Options of this script (everything else is a `JetGRPOConfig` field)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "LLaDA checkpoint (e.g. GSAI-ML/LLaDA-8B-Instruct) or directory; unset = tiny CPU run."},
    )
    dtype: str = field(default="bfloat16", metadata={"help": "Dtype of the loaded checkpoint's master weights."})
    task: str = field(default="countdown", metadata={"help": f"Built-in task: one of {', '.join(TASKS)}."})
    prompt_style: str = field(default="short", metadata={"help": "'short' (tiny models) or 'instruct' prompts."})
    num_train_samples: int = field(default=20000, metadata={"help": "Prompts generated for training."})
    lora: bool = field(default=False, metadata={"help": "Train LoRA adapters on a frozen (quantized) base."})
    lora_preset: str = field(
        default="all_linear",
        metadata={"help": "LoRA targets: all_linear, attention, mlp or d1 (never the LM head)."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    warm_start_steps: int = field(
        default=0, metadata={"help": "Masked-diffusion SFT steps on the task's answers before GRPO (tiny model)."}
    )
    fast: bool = field(default=False, metadata={"help": "A ~1 minute smoke run (tests): tiny sizes, 2 steps."})


# ---------------------------------------------------------------------------------- arguments


def preset_for(argv: list[str]) -> dict:
    """The defaults for this invocation: tiny or real (model given on the command line or in the YAML)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--model_name_or_path")
    pre.add_argument("--fast", nargs="?", const="true", default=None)
    known, _ = pre.parse_known_args(argv)
    from_yaml = {}
    if known.config:
        import yaml

        with open(known.config) as f:
            from_yaml = yaml.safe_load(f) or {}
    model = known.model_name_or_path or from_yaml.get("model_name_or_path")
    fast = known.fast if known.fast is not None else str(from_yaml.get("fast", False))  # the flag wins
    preset = dict(REAL if model else TINY)
    if fast.lower() in ("true", "1", "yes"):
        preset.update(FAST)
        preset.pop("gradient_accumulation_steps", None)
        preset.update(num_iterations=1, warm_start_steps=FAST["warm_start_steps"] if not model else 0)
    return preset


def parse(argv: list[str] | None = None) -> tuple[LLaDAScriptArguments, JetGRPOConfig]:
    argv = sys.argv[1:] if argv is None else argv
    parser = TrlParser((LLaDAScriptArguments, JetGRPOConfig))
    parser.set_defaults(**preset_for(argv))
    script, training = parser.parse_args_and_config(argv)
    if script.task not in TASKS:
        parser.error(f"--task must be one of {', '.join(TASKS)}; got {script.task!r}.")
    return script, training


# ---------------------------------------------------------------------------------- model


def load_model(script: LLaDAScriptArguments):
    """(model, tokenizer): a checkpoint through the Auto classes (no remote code), or a tiny local LLaDA."""
    if script.model_name_or_path is None:
        from jetrl_trainer.diffusion import build_tiny_llada
        from jetrl_trainer.tiny import END_OF_TURN, build_tiny_tokenizer

        tok = build_tiny_tokenizer()
        model = build_tiny_llada(
            vocab_size=len(tok), mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.convert_tokens_to_ids(END_OF_TURN),
        )  # fmt: skip
        return model, tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import jetrl_trainer.diffusion  # noqa: F401  (registers model_type "llada" with the Auto classes)

    dtype = getattr(torch, script.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtype must be a torch dtype name such as bfloat16 or float32; got {script.dtype!r}.")
    tok = AutoTokenizer.from_pretrained(script.model_name_or_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, dtype=dtype)
    if getattr(model.config, "model_type", None) != "llada":
        raise SystemExit(f"{script.model_name_or_path} is a {model.config.model_type!r} model, not LLaDA; use "
                         "examples/train_gsm8k.py for autoregressive models.")  # fmt: skip
    return model, tok


# ---------------------------------------------------------------------------------- training


class MetricsFile(TrainerCallback):
    """One JSON line per logged step in ``<output_dir>/metrics.jsonl`` (reward, mismatch, corrector)."""

    def __init__(self, path: str):
        self.path, self.rows = path, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        row = {"step": state.global_step, **{k: logs[k] for k in LOGGED if k in logs}}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def lora_config(script: LLaDAScriptArguments):
    if not script.lora:
        return None
    from peft import LoraConfig

    # A preset name: JetGRPOTrainer turns it into a regex that never matches the LM head.
    return LoraConfig(r=script.lora_r, lora_alpha=script.lora_alpha, lora_dropout=script.lora_dropout,
                      target_modules=script.lora_preset, task_type="CAUSAL_LM")  # fmt: skip


def main(script: LLaDAScriptArguments, training: JetGRPOConfig) -> int:
    start = time.perf_counter()
    task = get_task(script.task)
    model, tok = load_model(script)
    if script.warm_start_steps > 0:
        loss = diffusion_warm_start(model, tok, task, steps=script.warm_start_steps,
                                    gen_length=training.max_completion_length, seed=training.seed)  # fmt: skip
        print(f"warm start: {script.warm_start_steps} steps, final loss {loss:.3f}")
    dataset = task.make_dataset(script.num_train_samples, seed=training.seed, prompt_style=script.prompt_style)
    trainer = JetGRPOTrainer(model, task.reward_fn, args=training, train_dataset=dataset, processing_class=tok,
                             peft_config=lora_config(script))  # fmt: skip
    os.makedirs(training.output_dir, exist_ok=True)
    metrics = MetricsFile(os.path.join(training.output_dir, "metrics.jsonl"))
    open(metrics.path, "w").close()
    trainer.add_callback(metrics)
    s = trainer.rollout_sampling  # the DiffusionSampling the diffusion backend runs with
    if trainer.is_world_process_zero():
        print(f"GRPO on {task.name}: train={training.train_precision} rollout={training.rollout_precision} "
              f"corrector={training.corrector_name} lora={script.lora} | sampler: {s.gen_length} tokens, blocks "
              f"of {s.block_length}, {s.steps} steps, {s.remasking}")  # fmt: skip
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    trainer.save_model(training.output_dir)
    rows = metrics.rows
    if rows and trainer.is_world_process_zero():
        dlogp = [r["mismatch/logp_abs_diff_mean"] for r in rows if "mismatch/logp_abs_diff_mean" in r]
        print(f"reward: first step {rows[0]['reward']:.3f}, last step {rows[-1]['reward']:.3f}; mean |logp_train - "
              f"logp_rollout| {sum(dlogp) / max(1, len(dlogp)):.2e}; {time.perf_counter() - start:.0f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    exit_process(main(*parse()))  # a gloo (CPU) launch ends without a race at exit
