"""GRPO on GSM8K for real models (e.g. Qwen/Qwen3-8B-Base) with JetGRPOTrainer.

Every option is a command-line flag or a YAML key (TrlParser): `JetGRPOConfig` (all of TRL's
GRPOConfig plus the precision/corrector knobs), TRL's `ModelConfig` (model id, dtype, LoRA) and the
dataset options below. One config per strategy lives in ``examples/configs/``:

    accelerate launch examples/train_gsm8k.py --config examples/configs/gsm8k_unified_fp8.yaml
    accelerate launch --num_processes 8 examples/train_gsm8k.py \\
        --config examples/configs/gsm8k_bf16_fp8_ais.yaml --output_dir runs/qwen3-8b-ais

    # any key can be overridden on the command line
    python examples/train_gsm8k.py --config examples/configs/gsm8k_unified_fp8.yaml \\
        --model_name_or_path Qwen/Qwen3-0.6B-Base --max_steps 10

The dataset is ``openai/gsm8k`` (config ``main``) by default, or a local copy: ``--dataset_name``
may be a ``.jsonl``/``.json``/``.parquet``/``.csv`` file or a directory with ``question`` and
``answer`` columns (answers ending in ``#### <number>``). Reward: 1 when the final number matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, TrlParser, get_peft_config

from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
from jetrl_trainer.tasks import get_task, load_gsm8k
from jetrl_trainer.tasks.gsm8k import DEFAULT_INSTRUCTION


@dataclass
class GSM8KArguments:
    """Dataset options for this script."""

    dataset_name: str = field(
        default="openai/gsm8k",
        metadata={"help": "Hub dataset id, or a local .jsonl/.json/.parquet/.csv file or directory."},
    )
    dataset_config: str | None = field(default="main", metadata={"help": "Hub dataset config name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on (e.g. 'test'); None disables evaluation."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep a seeded random subset of this many training problems."}
    )
    max_eval_samples: int | None = field(default=256, metadata={"help": "Subset size of the evaluation split."})
    instruction: str = field(
        default=DEFAULT_INSTRUCTION,
        metadata={"help": "Appended to every question on a new line (empty string: bare questions)."},
    )


def load_split(args: GSM8KArguments, split: str, n: int | None, seed: int):
    return load_gsm8k(
        split, args.dataset_name, args.dataset_config, instruction=args.instruction or None, n=n, seed=seed
    )


def main(script_args: GSM8KArguments, training_args: JetGRPOConfig, model_args: ModelConfig) -> None:
    if training_args.model_init_kwargs is None:  # from the ModelConfig flags, as TRL's own scripts do
        training_args.model_init_kwargs = {
            key: value
            for key, value in (
                ("dtype", model_args.dtype),
                ("attn_implementation", model_args.attn_implementation),
                ("revision", model_args.model_revision),
            )
            if value is not None
        }
    train_dataset = load_split(
        script_args, script_args.dataset_train_split, script_args.max_train_samples, training_args.seed
    )
    eval_dataset = None
    if script_args.dataset_test_split:
        eval_dataset = load_split(
            script_args, script_args.dataset_test_split, script_args.max_eval_samples, training_args.seed
        )
    trainer = JetGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=get_task("gsm8k").reward_fn,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    parser = TrlParser((GSM8KArguments, JetGRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())
