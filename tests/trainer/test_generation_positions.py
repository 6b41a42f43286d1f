"""The training forward numbers RoPE positions as `generate`, the engine and vLLM do.

TRL's log-prob forward passes no ``position_ids``, so transformers counts a left-padded row's pads
and its rotary angles are offset from the rollout's. In FP32 that is rounding noise; in BF16 it was
most of the rollout/training mismatch of a padded batch (measured below: ~1e-3 nats without, ~1e-8
with), so `AutoregressiveScorer` scopes `generation_positions` around every forward it makes.
"""

from __future__ import annotations

import pytest
import torch
from _trainer_utils import make_trainer, tiny_model, tokenizer, train
from datasets import Dataset

from jetrl_trainer.quant import PrecisionPhases, quantize_model
from jetrl_trainer.rollout import left_pad, position_ids_from_mask
from jetrl_trainer.rollout.engine import DecodeEngine
from jetrl_trainer.scoring import generation_positions
from jetrl_trainer.tiny import build_tiny_qwen3


def test_positions_count_from_the_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 3, 1]]


def test_the_hook_adds_positions_only_where_none_were_given():
    seen = []
    model = torch.nn.Module()
    model.forward = lambda **kwargs: seen.append(kwargs.get("position_ids"))
    mask, explicit = torch.tensor([[0, 1, 1]]), torch.tensor([[7, 8, 9]])
    with generation_positions(model):
        model(input_ids=mask, attention_mask=mask)
        model(input_ids=mask, attention_mask=mask, position_ids=explicit)
        model(input_ids=mask)  # no mask: nothing to number from
    model(input_ids=mask, attention_mask=mask)  # the hook is gone once the block closes
    assert seen[0].tolist() == [[1, 0, 1]] and seen[1] is explicit and seen[2] is None and seen[3] is None


def test_prefill_gives_the_training_forwards_kv_for_padded_prompts():
    # With the scorer's positions, a left-padded prompt's KV is the engine prefill's bit for bit.
    model = build_tiny_qwen3(tokenizer()).eval()
    quantize_model(model, train="fp8", rollout="fp8")
    prompts = [(5, 6), (9, 10, 11, 12, 13), (7, 8, 9)]
    ids, mask = left_pad(prompts, 0)
    with torch.no_grad(), PrecisionPhases(model).rollout():
        keys, values, _ = DecodeEngine(model).prefill(prompts, pad_token_id=0)
        with generation_positions(model):
            out = model(input_ids=ids, attention_mask=mask)
    for layer, (k, v) in enumerate(zip(keys, values)):
        live = mask.bool()[:, None, :, None].expand_as(k)  # pad slots hold no KV anyone reads
        assert torch.equal(k[live], out.past_key_values.layers[layer].keys[live])
        assert torch.equal(v[live], out.past_key_values.layers[layer].values[live])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_padded_bf16_batch_has_no_position_mismatch(tmp_path, precision):
    # 4 prompts of 1-10 characters in one generation batch, a BF16 model: before the scorer numbered
    # positions, this measured 8.4e-4 (bf16/bf16) and 3.6e-3 (fp8/fp8) mean |dlogp| on CPU. Eager
    # attention: on a CPU without AVX-512 (an AVX2 AMD EPYC, 2026-12-04), torch's BF16 SDPA sums a
    # masked one-query decode step in another order than the full forward (3e-4 here, positions
    # numbered or not), which would hide what this test measures.
    model = tiny_model().to(torch.bfloat16)
    model.config._attn_implementation = "eager"
    trainer = make_trainer(tmp_path, model=model, rollout_backend="hf",
                           train_precision=precision, rollout_precision=precision, max_completion_length=8,
                           per_device_train_batch_size=16)  # fmt: skip
    trainer.train_dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1" * (1 + 3 * i)}]
                                                          for i in range(4)]})  # fmt: skip
    logs, _ = train(trainer)
    assert logs["mismatch/logp_abs_diff_mean"] < 1e-6, logs["mismatch/logp_abs_diff_mean"]
