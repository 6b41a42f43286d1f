"""The TRL contracts JetGRPOTrainer's thin override layer relies on (trl 1.16; pyproject pins <1.17).

Each test names one override and fails loudly, with the contract in its message, if TRL changes it:

* ``_generate_single_turn`` -> ``(completion_ids, logprobs)``, padded by TRL into
  ``sampling_per_token_logps`` of the batch;
* ``_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)`` ->
  ``(logps, entropies, aux_loss)``, what TRL calls for the loss and the reference log-probs;
* ``_compute_loss`` multiplies the per-token loss by ``inputs["importance_sampling_ratio"]`` under
  ``use_vllm and vllm_importance_sampling_correction``, flags that guard nothing else there;
* ``_generate_and_score_completions`` returns ``old_per_token_logps`` only when the steps are
  misaligned (else we compute it; with exact log-probs we lower ``num_iterations`` around it to skip
  that forward, and ``num_iterations`` decides nothing else there), and ``_prepare_inputs`` shuffles and splits every batch tensor
  along dim 0 (our per-slice tensors ride along);
* ``_step``, ``num_iterations`` and ``steps_per_generation`` say which inner iteration a loss is.
"""

from __future__ import annotations

import inspect
import re

import torch
from _trainer_utils import make_trainer, tiny_model, train
from trl import GRPOTrainer
from trl.trainer import grpo_trainer
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from jetrl_trainer import JetGRPOTrainer
from jetrl_trainer.rollout import Rollout, RolloutBackend


def _source(name: str) -> str:
    return inspect.getsource(getattr(GRPOTrainer, name))


def _params(name: str) -> list[str]:
    return list(inspect.signature(getattr(GRPOTrainer, name)).parameters)


def test_every_private_override_exists_in_trl_with_our_signature():
    for name in ("_generate_single_turn", "_generate_and_score_completions", "_get_per_token_logps_and_entropies",
                 "_compute_loss"):  # fmt: skip
        assert name in GRPOTrainer.__dict__, f"TRL no longer defines GRPOTrainer.{name}; our override is dead"
    assert _params("_generate_single_turn") == [
        "self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images",
    ]  # fmt: skip
    assert _params("_get_per_token_logps_and_entropies")[:8] == [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
        "compute_aux_loss",
    ]  # fmt: skip
    assert _params("_compute_loss") == ["self", "model", "inputs"]
    assert _params("_generate_and_score_completions") == ["self", "inputs"]


class _FixedBackend(RolloutBackend):
    name = "fixed"

    def generate(self, model, prompt_ids, sampling):
        n = len(prompt_ids)
        return Rollout([[40, 41, 42]] * n, [[-0.5, -1.5, -2.5]] * n)


def test_single_turn_logprobs_become_the_batch_sampling_logprobs(tmp_path):
    trainer = make_trainer(tmp_path, train_precision="bf16", rollout_precision="bf16", log_mismatch=False)
    trainer.rollout_backend = _FixedBackend()
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": [{"role": "user", "content": "1+2="}]}] * 4)
    assert torch.equal(batch["completion_ids"], torch.tensor([[40, 41, 42]] * 4)), "TRL changed how completions pad"
    assert torch.equal(batch["sampling_per_token_logps"], torch.tensor([[-0.5, -1.5, -2.5]] * 4)), (
        "TRL no longer pads _generate_single_turn's logprobs into batch['sampling_per_token_logps']"
    )
    assert "old_per_token_logps" not in batch, "TRL now computes old log-probs for aligned steps; drop our forward"


def test_trl_asks_for_loss_and_reference_logprobs_through_the_override(tmp_path, monkeypatch):
    calls = []
    original = JetGRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, *args, **kwargs):
        calls.append((model is self.ref_model, torch.is_grad_enabled(), kwargs.get("compute_entropy", False)))
        out = original(self, model, *args, **kwargs)
        assert isinstance(out, tuple) and len(out) == 3, "the contract is (logps, entropies, aux_loss)"
        return out

    monkeypatch.setattr(JetGRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    tiny_model().save_pretrained(tmp_path / "tiny")  # TRL loads the reference by path
    trainer = make_trainer(tmp_path, str(tmp_path / "tiny"), train_precision="bf16", rollout_precision="bf16",
                           beta=0.1, model_init_kwargs={"dtype": "float32"})  # fmt: skip
    train(trainer)
    assert (True, False, False) in calls, "TRL no longer scores the reference through _get_per_token_logps_and_entropies"
    assert (False, True, True) in calls, "TRL's loss no longer calls _get_per_token_logps_and_entropies with entropy"


def test_the_importance_sampling_slot_is_guarded_by_two_flags_that_guard_nothing_else():
    source = _source("_compute_loss")
    slot = re.search(
        r"if self\.use_vllm and self\.vllm_importance_sampling_correction and self\.loss_type != \"vespo\":\n"
        r"\s+per_token_loss = per_token_loss \* inputs\[\"importance_sampling_ratio\"\]",
        source,
    )
    assert slot, "TRL moved the importance-sampling multiply in _compute_loss; JetGRPOTrainer._compute_loss raises " \
                 "use_vllm / vllm_importance_sampling_correction to reach it"  # fmt: skip
    assert source.count("self.use_vllm") == 1 and source.count("self.vllm_importance_sampling_correction") == 1, (
        "use_vllm / vllm_importance_sampling_correction now guard more of _compute_loss than the IS multiply"
    )
    assert 'importance_sampling_ratio=inputs.get("importance_sampling_ratio")' in source, "VESPO's gamma slot moved"
    kl = source.index("per_token_loss = per_token_loss + self.beta * per_token_kl")
    assert slot.start() < kl, "the IS weights must multiply the surrogate before the KL term is added"


def test_old_logprobs_are_computed_by_trl_only_for_misaligned_steps():
    source = _source("_generate_and_score_completions")
    assert re.search(
        r"if self\.args\.gradient_accumulation_steps % generate_every != 0 or \(\s*"
        r"self\.use_vllm and self\.vllm_importance_sampling_correction\s*\):",
        source,
    ), "TRL changed when it computes old_per_token_logps"
    assert 'output["old_per_token_logps"] = old_per_token_logps' in source
    assert 'output["sampling_per_token_logps"] = sampling_per_token_logps' in source
    # exact_logprobs lowers num_iterations to 1 around this call to skip that forward: it must decide nothing else
    assert source.count("self.num_iterations") == 1, "num_iterations now does more in _generate_and_score_completions"
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in source


def test_batch_tensors_are_shuffled_and_split_along_rows():
    source = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "shuffle_sequence_dict(generation_batch)" in source and "split_tensor_dict(" in source
    rows = torch.arange(6)
    batch = {
        "completion_ids": rows[:, None].expand(6, 3).clone(),
        "old_per_token_logps": rows[:, None, None].expand(6, 2, 3).float(),  # (B, K, T) per-slice tensor
        "mask_seeds": rows[:, None].expand(6, 2).clone(),
    }
    torch.manual_seed(0)
    for part in split_tensor_dict(shuffle_sequence_dict(batch), 2):
        order = part["completion_ids"][:, 0]
        assert torch.equal(part["old_per_token_logps"][:, 0, 0].long(), order), "per-slice tensors lost their rows"
        assert torch.equal(part["mask_seeds"][:, 0], order)


def test_inner_iteration_bookkeeping_is_where_we_read_it():
    source = inspect.getsource(grpo_trainer.GRPOTrainer)
    assert "self._step += 1" in source or "self._step +=" in source, "TRL no longer counts micro-steps in _step"
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in _source("_prepare_inputs")
