"""The exact contract on the GPU at Qwen3-8B's shapes, through a whole GRPO step (``gpu``).

A random Qwen3 with the 8B layer shapes (hidden 4096, 32/8 heads of 128, MLP 12288, vocab 151,936),
BF16 master weights, ``exact_logprobs=True``, the engine, 8 ragged prompts of 40-256 tokens x 8
completions of 512 tokens, one step: every completion token's recorded log-prob equals the training
forward's (``mismatch/logp_abs_diff_max == 0``) and the loss's ratios are all 1. LoRA r=16 on all 36
layers, and full fine-tuning on 8 layers (what fits beside AdamW's state on one GPU). And the FP8
KV cache in the unified FP8 flow over 4,096 new tokens (one prompt x 8, LoRA on 8 layers).
"""

from __future__ import annotations

import pytest
import torch

SHAPE_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, tie_word_embeddings=False)  # fmt: skip


def _step(tmp_path, precision: str, layers: int, lora: bool, *, new_tokens: int = 512, distinct: int = 8,
          micro: int = 16, **overrides) -> dict:  # fmt: skip
    from datasets import Dataset
    from peft import LoraConfig

    from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
    from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(model_max_length=8192)
    model = build_tiny_qwen3(tokenizer, num_hidden_layers=layers, max_position_embeddings=8192, seed=0,
                             dtype=torch.bfloat16, **SHAPE_8B).cuda()  # fmt: skip
    # 8 distinct prompts from about 40 to 256 tokens once templated
    words = [" ".join(str(i) for i in range(n)) for n in (12, 30, 50, 70, 90, 110, 130, 150)[:distinct]]
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": w}] for w in words] * 8})
    config = JetGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=min(micro, 8 * distinct),
        gradient_accumulation_steps=max(1, 8 * distinct // micro), num_generations=8, max_completion_length=new_tokens,
        max_steps=1, logging_steps=1, learning_rate=1e-6, report_to="none", bf16=True,
        save_strategy="no", disable_tqdm=True, seed=0, train_precision=precision, rollout_precision=precision,
        rollout_backend="engine", exact_logprobs=True, exact_check_every=1, **overrides,
    )  # fmt: skip
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    trainer = JetGRPOTrainer(model, lambda completions, **kw: [float(len(c[0]["content"])) for c in completions],
                             args=config, train_dataset=prompts, processing_class=tokenizer,
                             peft_config=peft if lora else None)  # fmt: skip
    trainer.train()
    return next(r for r in trainer.state.log_history if "loss" in r)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize(("layers", "lora"), [(36, True), (8, False)], ids=["lora-36-layers", "full-8-layers"])
def test_a_grpo_step_at_8b_shapes_is_exactly_on_policy(tmp_path, precision, layers, lora):
    logs = _step(tmp_path, precision, layers, lora)
    assert logs["mismatch/logp_abs_diff_max"] == 0.0
    assert logs["mismatch/logp_bits_equal_share"] == 1.0
    assert logs["clip_ratio/region_mean"] == 0.0


@pytest.mark.gpu
def test_the_fp8_kv_cache_at_8b_shapes_over_4096_new_tokens(tmp_path):
    """The FP8 cache in the unified FP8 flow, one prompt x 8 completions of 4,096 tokens, LoRA on 8 layers,
    micro-batches of 2 (8 rows' FP32 logits over 151,936 tokens would take 18.6 GiB)."""
    logs = _step(tmp_path, "fp8", 8, True, new_tokens=4096, distinct=1, micro=2, rollout_kv_cache_dtype="fp8")
    assert logs["mismatch/logp_abs_diff_max"] == 0.0
    assert logs["mismatch/logp_bits_equal_share"] == 1.0
    assert logs["clip_ratio/region_mean"] == 0.0
