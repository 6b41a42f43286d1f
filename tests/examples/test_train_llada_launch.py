"""examples/train_llada.py as users run it: `accelerate launch` on CPU, a local checkpoint with the
published layout (+ LoRA), the shipped YAML and accelerate configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_llada.py"
CONFIGS = sorted((ROOT / "examples" / "configs").glob("llada_*.yaml"))
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
CPU = ["--bf16", "false", "--use_cpu", "true"]


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _script_module():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_llada
    finally:
        sys.path.pop(0)
    return train_llada


def test_accelerate_launch_fast_tiny_run(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu", str(SCRIPT),
           "--fast", "--output_dir", str(out)]  # fmt: skip
    done = _run(cmd, tmp_path)
    assert "warm start: 10 steps" in done.stdout and "GRPO on countdown: train=fp8 rollout=fp8" in done.stdout
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["reward"] <= 1.0 and row["jetrl/skipped_steps"] == 0
        assert row["mismatch/logp_abs_diff_mean"] == 0.0  # the default is the unified FP8 flow
    assert (out / "model.safetensors").exists()


def test_two_processes_over_gloo(tmp_path):
    """DDP with a diffusion LM: one forward per backward, metrics gathered over both ranks, logged once."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "examples" / "configs" / "accelerate_cpu_2proc.yaml"), "--num_processes", "2",
           "--mixed_precision", "no", str(SCRIPT), "--fast", "--output_dir", str(out), "--ddp_backend", "gloo",
           "--train_precision", "bf16", "--rollout_precision", "fp8", "--corrector", "ais", *CPU]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **OFFLINE, **env}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("GRPO on countdown") == 1  # printed by rank 0 only
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["mismatch/logp_abs_diff_mean"] > 0 and 0 <= r["corrector/alpha"] <= 1 for r in rows)


def test_local_checkpoint_with_lora_and_a_corrector(tmp_path):
    from _trainer_utils import save_published_layout

    path = save_published_layout(tmp_path / "tiny")
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--model_name_or_path", path, "--dtype", "float32", "--fast", "--lora",
           "--lora_preset", "attention", "--train_precision", "bf16", "--rollout_precision", "fp8",
           "--corrector", "tis", "--output_dir", str(out), *CPU]  # fmt: skip
    done = _run(cmd, tmp_path)
    assert "corrector=tis lora=True" in done.stdout
    rows = _metrics(out)
    assert len(rows) == 2 and all(r["mismatch/logp_abs_diff_mean"] > 0 for r in rows)
    assert all("kl" in r and "corrector/weight_mean" in r for r in rows)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["target_modules"] == r"(.*\.)?blocks\.\d+\.(q_proj|k_proj|v_proj|attn_out)"


def test_help_lists_the_script_and_diffusion_options(tmp_path):
    done = _run([sys.executable, str(SCRIPT), "--help"], tmp_path)
    for flag in ("--model_name_or_path", "--lora", "--lora_preset", "--fast", "--task", "--diffusion_steps",
                 "--diffusion_block_length", "--p_mask_prompt", "--train_precision", "--corrector"):  # fmt: skip
        assert flag in done.stdout, flag


def test_one_config_per_strategy_and_each_parses(tmp_path):
    assert {c.stem for c in CONFIGS} >= {"llada_8b_unified_fp8", "llada_8b_bf16_fp8_ais", "llada_8b_lora_fp8"}
    module = _script_module()
    for config in CONFIGS:
        raw = yaml.safe_load(config.read_text())
        script, training = module.parse(["--config", str(config), "--output_dir", str(tmp_path), *CPU])
        assert script.model_name_or_path == "GSAI-ML/LLaDA-8B-Instruct" and script.lora is raw.get("lora", False)
        assert (training.train_precision, training.rollout_precision) == (raw["train_precision"],
                                                                          raw["rollout_precision"])  # fmt: skip
        assert training.corrector == raw["corrector"]
        assert (training.max_completion_length, training.diffusion_block_length, training.diffusion_steps) == (
            256, 32, 128)  # fmt: skip


def test_defaults_depend_on_the_model_and_flags_win(tmp_path):
    module = _script_module()
    _, tiny = module.parse(["--output_dir", str(tmp_path), *CPU])
    assert (tiny.max_completion_length, tiny.diffusion_steps, tiny.bf16) == (16, 8, False)
    _, real = module.parse(["--model_name_or_path", "x", "--output_dir", str(tmp_path), *CPU])
    assert (real.max_completion_length, real.diffusion_block_length, real.beta) == (256, 32, 0.04)
    _, override = module.parse(["--output_dir", str(tmp_path), "--max_completion_length", "32", "--diffusion_steps",
                                "16", *CPU])  # fmt: skip
    assert (override.max_completion_length, override.diffusion_steps) == (32, 16)
    with pytest.raises(SystemExit):
        module.parse(["--task", "gsm8k", *CPU])


def test_multigpu_accelerate_config_loads():
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "examples" / "configs" / "accelerate_multigpu.yaml"))
    assert config.distributed_type == "MULTI_GPU" and config.num_processes == 8 and not config.use_cpu
