"""examples/train_gsm8k.py: every strategy config parses and validates; the script runs offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("gsm8k_*.yaml"))
CPU = ["--bf16", "false", "--use_cpu", "true", "--report_to", "none"]


def _parse(config: Path, *extra: str):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_gsm8k
    finally:
        sys.path.pop(0)
    from trl import ModelConfig, TrlParser

    from jetrl_trainer import JetGRPOConfig

    parser = TrlParser((train_gsm8k.GSM8KArguments, JetGRPOConfig, ModelConfig))
    return parser.parse_args_and_config(["--config", str(config), *CPU, *extra])


def test_one_config_per_strategy():
    names = {c.stem for c in CONFIGS}
    assert {"gsm8k_unified_fp8", "gsm8k_unified_nvfp4", "gsm8k_bf16_fp8_tis", "gsm8k_bf16_fp8_mis",
            "gsm8k_bf16_fp8_ais"} <= names  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_into_the_strategy_it_names(config, tmp_path):
    script, training, model = _parse(config, "--output_dir", str(tmp_path))
    raw = yaml.safe_load(config.read_text())
    assert (training.train_precision, training.rollout_precision) == (raw["train_precision"], raw["rollout_precision"])
    assert training.corrector == raw["corrector"]
    assert model.model_name_or_path == "Qwen/Qwen3-8B-Base" and model.dtype == "bfloat16"
    assert script.dataset_name == "openai/gsm8k"
    unified = "unified" in config.stem
    assert (training.train_precision == training.rollout_precision) is unified


def test_script_trains_a_local_model_on_local_data(tmp_path):
    from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    build_tiny_qwen3(tok).save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"} for i in range(8)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cmd = [
        sys.executable, str(ROOT / "examples" / "train_gsm8k.py"),
        "--config", str(ROOT / "examples" / "configs" / "gsm8k_bf16_fp8_tis.yaml"), *CPU,
        "--model_name_or_path", str(tmp_path / "tiny"), "--dtype", "float32",
        "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
        "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--gradient_accumulation_steps", "1", "--max_completion_length", "8", "--warmup_steps", "0",
        "--gradient_checkpointing", "false", "--logging_steps", "1",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists()
    card = (out / "README.md").read_text()
    assert "jetrl" in card and "corrector: tis" in card
