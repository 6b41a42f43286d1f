"""_inputs.py: bad data and fields that do not apply to the model are refused when the trainer is built."""

from __future__ import annotations

import pytest
from _trainer_utils import byte_reward, make_args, prompts, tiny_model, tokenizer
from datasets import Dataset, IterableDataset

from jetrl_trainer import JetGRPOTrainer


def _build(tmp_path, train_dataset, eval_dataset=None, **overrides):
    return JetGRPOTrainer(
        tiny_model(), byte_reward, args=make_args(tmp_path, **overrides), train_dataset=train_dataset,
        eval_dataset=eval_dataset, processing_class=tokenizer(),
    )  # fmt: skip


def _first_line(err) -> str:
    return str(err.value).splitlines()[0]


def test_an_empty_dataset_is_refused(tmp_path):
    empty = Dataset.from_dict({"prompt": []})
    for overrides in ({}, {"max_steps": -1}):  # before: 0 steps in silence / "max_steps must be set to a positive value"
        with pytest.raises(ValueError) as err:
            _build(tmp_path, empty, **overrides)
        assert _first_line(err) == (
            "train_dataset is empty (0 rows): there is no prompt to train on. Check the split, filter or slice that "
            "built it."
        )
    with pytest.raises(ValueError, match=r"^eval_dataset\['dev'\] is empty"):
        _build(tmp_path, prompts(), eval_dataset={"dev": empty})


def test_a_dataset_without_a_prompt_column_lists_what_it_has(tmp_path):
    data = Dataset.from_dict({"question": ["1+1="] * 8, "answer": ["2"] * 8})
    with pytest.raises(ValueError) as err:
        _build(tmp_path, data)
    assert _first_line(err) == "train_dataset has no 'prompt' column (found: question, answer)."
    assert "dataset.rename_column('question', 'prompt')" in str(err.value)


def test_an_iterable_dataset_of_unknown_columns_is_left_to_the_first_step(tmp_path):
    stream = IterableDataset.from_generator(lambda: iter([{"prompt": "1+1="}] * 8))
    assert _build(tmp_path, stream).train_dataset is not None


@pytest.mark.parametrize(
    "fields, first_line",
    [
        (dict(diffusion_steps=4), "diffusion_steps applies to diffusion LMs (LLaDA) only, and Qwen3ForCausalLM is "
                                  "autoregressive; unset it."),
        (dict(p_mask_prompt=0.15, diffusion_remasking="random"),
         "diffusion_remasking, p_mask_prompt apply to diffusion LMs (LLaDA) only, and Qwen3ForCausalLM is "
         "autoregressive; unset them."),
    ],
)
def test_diffusion_fields_on_an_autoregressive_model_are_refused(tmp_path, fields, first_line):
    with pytest.raises(ValueError) as err:
        _build(tmp_path, prompts(), **fields)
    assert _first_line(err) == first_line


def test_a_keep_bf16_modules_typo_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError) as err:
        _build(tmp_path, prompts(), keep_bf16_modules=["q_projj"])
    assert _first_line(err) == (
        "keep_modules (keep_bf16_modules) pattern 'q_projj' matches no Linear layer of Qwen3ForCausalLM; close names: "
        "q_proj, v_proj, o_proj, k_proj."
    )
