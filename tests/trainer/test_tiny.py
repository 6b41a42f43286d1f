"""jetrl_trainer.tiny: offline tokenizer, tiny models, sampling helpers and the SFT warm start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from jetrl_trainer.tasks import get_task
from jetrl_trainer.tiny import (
    CHAT_TEMPLATE,
    build_tiny_llama,
    build_tiny_qwen3,
    build_tiny_tokenizer,
    deterministic_algorithms,
    evaluate_reward,
    sample_completions,
    warm_start,
)
from jetrl_trainer.tiny import _collate, _sft_examples

PROMPT = [{"role": "user", "content": "12+7="}]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text", ["12+7=", "", " a  b\n\n\tc ", "users assistant system!", "naïve €5 — 日本", "<|im_end|>x"]
)
def test_tokenizer_round_trips_any_text(tok, text):
    assert tok.decode(tok(text)["input_ids"]) == text


def test_tokenizer_is_character_level_with_the_special_ids(tok):
    assert tok("12 +\n")["input_ids"] == [tok.convert_tokens_to_ids(c) for c in ["1", "2", "Ġ", "+", "Ċ"]]
    assert len(tok("hello world, 42!")["input_ids"]) == 16  # one token per ASCII character
    assert (tok.pad_token, tok.pad_token_id) == ("<|pad|>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", 1)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]
    assert (tok.mask_token, tok.mask_token_id) == ("<|mdm_mask|>", 4)
    assert tok.bos_token is None  # like Qwen3
    assert len(tok) == 5 + 3 + 256
    assert tok.padding_side == "left"


def test_chat_template_renders_qwen_style(tok):
    text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tok.apply_chat_template(PROMPT, add_generation_prompt=False, tokenize=False)
    assert no_gen == "<|im_start|>user\n12+7=<|im_end|>\n"
    convo = PROMPT + [{"role": "assistant", "content": "19"}]
    assert tok.apply_chat_template(convo, tokenize=False) == no_gen + "<|im_start|>assistant\n19<|im_end|>\n"
    blocks = [{"role": "user", "content": [{"type": "text", "text": "12+"}, {"type": "text", "text": "7="}]}]
    assert tok.apply_chat_template(blocks, add_generation_prompt=True, tokenize=False) == text
    # the whole scaffold costs 8 tokens: role names are single tokens
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert len(ids) == 8 + len("12+7=")


def test_chat_template_batches_with_left_padding(tok):
    batch = tok.apply_chat_template([PROMPT, [{"role": "user", "content": "1+1="}]], add_generation_prompt=True,
                                    tokenize=True, return_dict=True, return_tensors="pt", padding=True)
    assert batch["input_ids"].shape == (2, 13)
    assert batch["attention_mask"][1].tolist() == [0] + [1] * 12
    assert batch["input_ids"][1, 0].item() == tok.pad_token_id


def test_tokenizer_save_and_reload_offline(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "users: 12+7=19\n€"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.decode(again(text)["input_ids"]) == text
    assert (again.mask_token_id, again.pad_token_id, again.eos_token_id) == (4, 0, 1)
    assert again.padding_side == "left"
    assert again.chat_template == CHAT_TEMPLATE
    assert again.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False) == (
        tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False))


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("build", [build_tiny_qwen3, build_tiny_llama])
def test_tiny_model_config_forward_and_generate(tok, build):
    model = build(tok)
    cfg = model.config
    assert (cfg.vocab_size, cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (len(tok), 0, 1, 1)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 4, 2)
    assert cfg.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == [3, 1]  # <|im_end|> then <|endoftext|>
    batch = tok(["12+7=", "3"], return_tensors="pt", padding=True)
    assert model(**batch).logits.shape == (2, 5, len(tok))
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 2 and 5 < out.shape[1] <= 9


def test_tiny_model_init_is_seeded_and_private(tok):
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_tiny_qwen3(tok, seed=1), build_tiny_qwen3(tok, seed=1), build_tiny_qwen3(tok, seed=2)
    assert torch.rand(1) == expected  # building a model did not consume the caller's RNG
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_tiny_model_overrides_and_bad_input(tok):
    model = build_tiny_llama(
        tok, hidden_size=96, intermediate_size=200, num_hidden_layers=3, head_dim=24, dtype="bfloat16"
    )
    assert model.model.layers[0].mlp.up_proj.weight.shape == (200, 96)
    assert len(model.model.layers) == 3 and model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown Qwen3Config fields"):
        build_tiny_qwen3(tok, hiden_size=64)
    with pytest.raises(ValueError, match="dtype"):
        build_tiny_qwen3(tok, dtype="int8")


# ---------------------------------------------------------------- sampling, warm start


def test_sft_examples_supervise_only_the_answer_and_end_of_turn(tok):
    task = get_task("arithmetic")
    ds = task.make_dataset(2, seed=0)
    examples = _sft_examples(tok, task, ds)
    for (prompt_ids, answer_ids), row in zip(examples, ds):
        assert prompt_ids == tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
        assert answer_ids == tok(str(row["answer"]))["input_ids"] + [3]
    ids, mask, labels = _collate(examples, tok.pad_token_id, "cpu")
    for i, (p, a) in enumerate(examples):
        n = len(p) + len(a)
        assert ids[i, :n].tolist() == p + a and mask[i].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        assert labels[i].tolist() == [-100] * len(p) + a + [-100] * (ids.shape[1] - n)


def test_sample_completions_greedy_and_seeded(tok):
    model = build_tiny_qwen3(tok)
    prompts = [PROMPT, [{"role": "user", "content": "3+4="}]]
    greedy = sample_completions(model, tok, prompts, max_new_tokens=5, temperature=0)
    assert greedy == sample_completions(model, tok, prompts, max_new_tokens=5, temperature=0)
    assert len(greedy) == 2 and all(isinstance(t, str) for t in greedy)
    s1 = sample_completions(model, tok, prompts * 4, max_new_tokens=5, seed=7)
    assert s1 == sample_completions(model, tok, prompts * 4, max_new_tokens=5, seed=7)
    assert s1 != sample_completions(model, tok, prompts * 4, max_new_tokens=5, seed=8)
    with pytest.raises(ValueError, match="temperature"):
        sample_completions(model, tok, prompts, max_new_tokens=2, temperature=-1)


def test_warm_start_takes_reward_from_zero_to_clearly_positive(tok, one_thread):
    # A small version of the quickstart's warm start (see docs/tasks.md for the full-size figures).
    task = get_task("arithmetic")
    difficulty = dict(max_operand=9, ops="+")
    model = build_tiny_qwen3(tok)
    held_out = task.make_dataset(64, seed=999, **difficulty)
    before = evaluate_reward(model, tok, task, held_out, temperature=1.0, seed=0)
    params_before = [p.detach().clone() for p in model.parameters()]
    assert not model.training  # built in eval mode, like from_pretrained
    info = warm_start(model, tok, task, steps=120, lr=3e-3, batch_size=32, seed=0, progress=False,
                      num_examples=1024, **difficulty)
    after = evaluate_reward(model, tok, task, held_out, temperature=1.0, seed=0)
    assert before < 0.05  # random bytes almost never form a number followed by <|im_end|>
    assert after >= 0.3, (before, after, info)
    assert info["loss_end"] < 0.5 * info["loss_start"]
    assert set(info) == {"steps", "seconds", "loss_start", "loss_end", "num_examples"}
    assert all(not torch.equal(p, q) for p, q in zip(params_before, model.parameters()))
    assert not model.training  # the caller's mode is restored


def test_warm_start_bad_arguments(tok):
    with pytest.raises(ValueError, match="steps"):
        warm_start(build_tiny_qwen3(tok), tok, get_task("arithmetic"), steps=0, progress=False)


@pytest.mark.parametrize("workspace", [None, ":16:8"])
def test_deterministic_algorithms_switch_torch_to_strict_mode_on_cuda_and_restore_it(monkeypatch, workspace):
    # torch.device("cuda") needs no GPU: the settings are process-wide flags and a variable.
    if workspace is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", workspace)
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms("cuda"):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn_only keeps attention's atomics
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == workspace


def test_deterministic_algorithms_leave_cpu_runs_and_errors_alone(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with deterministic_algorithms(torch.device("cpu")):
        assert not torch.are_deterministic_algorithms_enabled()
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with pytest.raises(RuntimeError, match="inside"), deterministic_algorithms("cuda"):
        raise RuntimeError("inside")
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


_WARM_START_FINGERPRINT = """
from jetrl_trainer.study.runner import weights_fingerprint
from jetrl_trainer.tasks import get_task
from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer, warm_start
tok = build_tiny_tokenizer()
model = build_tiny_qwen3(tok, seed=3, hidden_size=256, intermediate_size=768, num_hidden_layers=4).cuda()
print("start", weights_fingerprint(model))
warm_start(model, tok, get_task("arithmetic"), steps=40, batch_size=32, seed=3, progress=False, num_examples=512)
print("warm", weights_fingerprint(model))
"""


@pytest.mark.gpu
def test_a_cuda_warm_start_gives_the_same_bits_in_another_process():
    # What lets a study split one seed's strategies over device calls: each call rebuilds the seed's
    # start, and every run must begin from the same weights (the runs' start_fingerprint).
    def fingerprints() -> dict[str, str]:
        out = subprocess.run([sys.executable, "-c", _WARM_START_FINGERPRINT], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return dict(line.split() for line in out.stdout.splitlines() if line.startswith(("start", "warm")))

    first, second = fingerprints(), fingerprints()
    assert first["start"] != first["warm"]  # the warm start moved the weights
    assert first == second


def test_trl_grpo_trainer_uses_the_template_and_task_columns(tok, tmp_path):
    # One GRPO step through TRL itself: prompts rendered with our template, columns passed as kwargs,
    # <|im_end|> recognised as the end of a completion.
    from trl import GRPOConfig, GRPOTrainer

    task = get_task("arithmetic")
    seen = {}

    def spy_reward(prompts, completions, **kwargs):
        seen.update(completions=completions, kwargs=kwargs)
        return task.reward_fn(prompts, completions, **kwargs)

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=1, report_to=[], use_cpu=True, save_strategy="no", bf16=False, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=build_tiny_qwen3(tok), processing_class=tok, reward_funcs=spy_reward, args=args,
                          train_dataset=task.make_dataset(8, seed=0))
    trainer.train()
    assert {"answer", "expression"} <= set(seen["kwargs"])
    assert all(c[0]["role"] == "assistant" for c in seen["completions"])
    assert 3 in trainer.eos_token_ids and 1 in trainer.eos_token_ids


def test_build_tiny_llada_matches_tokenizer():
    from jetrl_trainer.diffusion import is_diffusion_model
    from jetrl_trainer.tiny import build_tiny_llada

    tok = build_tiny_tokenizer()
    model = build_tiny_llada(tok, n_layers=1)
    assert is_diffusion_model(model)
    assert model.config.mask_token_id == tok.mask_token_id
    assert model.config.n_layers == 1
    ids = torch.tensor([tok.encode("12+7=")])
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.embedding_size)
