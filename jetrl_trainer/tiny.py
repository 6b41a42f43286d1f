"""Offline tiny tokenizer and models, for the tests and the quickstart. Nothing here downloads.

* `build_tiny_tokenizer` — character-level: one token per byte (every ASCII character is one
  token; other text falls back to its UTF-8 bytes, so ``decode(encode(s)) == s`` for any string),
  five special tokens and a Qwen-style chat template. Left padding, as GRPO generation needs.
* `build_tiny_qwen3` / `build_tiny_llama` — a few hundred thousand parameters, seeded init.
* `warm_start` — a short supervised fine-tune on a task's reference answers, so that a model
  sampled at temperature 1.0 already earns non-zero reward before RL (GRPO learns nothing from a
  group whose rewards are all equal, e.g. all zero).
* `sample_completions` / `evaluate_reward` — reward before/after, the way GRPO will see it.

How this departs from a real Qwen3 setup: the ``<|endoftext|>`` eos and ``<|im_end|>`` end of
turn are the same pair Qwen3 uses (the model's generation config stops on both), but there is no
system-prompt default and no thinking block, to keep prompts short (each character costs a token).
The default sizes (hidden 128, intermediate 256, ~0.36M parameters) are multiples of 128, so FP8
quantization sees full 128-wide activation groups; only the K/V projections (2 heads x 32 = 64
outputs) fill a partial 128x128 weight block. Pass other sizes (e.g. ``hidden_size=96``) as
overrides to exercise ragged groups. They were picked for speed: `warm_start` with its defaults
takes ~9 s of single-thread CPU time.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
from typing import Any, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "CHAT_TEMPLATE",
    "END_OF_TURN",
    "build_tiny_llada",
    "build_tiny_llama",
    "build_tiny_qwen2",
    "build_tiny_qwen3",
    "build_tiny_tokenizer",
    "deterministic_algorithms",
    "evaluate_reward",
    "sample_completions",
    "warm_start",
]

PAD, EOS, IM_START, END_OF_TURN, MASK = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mdm_mask|>"
_SPECIALS = (PAD, EOS, IM_START, END_OF_TURN, MASK)  # ids 0..4, in this order
_ROLE_WORDS = ("system", "user", "assistant")  # ids 5..7, then the 256 byte symbols

# Qwen's ChatML layout, reduced to what the tiny models need. Content may be a string or a list of
# {"type": "text"} blocks (TRL's multimodal normalisation produces the latter).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_MODEL_DEFAULTS: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA, as in the real models
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


# ---------------------------------------------------------------- tokenizer


def build_tiny_tokenizer(*, model_max_length: int = 512):
    """A character-level `PreTrainedTokenizerFast` with a chat template, built locally.

    Vocabulary: the five special tokens (``<|pad|>`` pad, ``<|endoftext|>`` eos, ``<|im_start|>``,
    ``<|im_end|>``, ``<|mdm_mask|>`` = ``mask_token``, LLaDA's mask) then the 256 byte symbols.
    Departs from the usual ASCII-only character vocab by using byte symbols, so that text outside
    ASCII still round-trips (as several tokens) instead of becoming ``<unk>``.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    vocab = {token: i for i, token in enumerate([*_SPECIALS, *_ROLE_WORDS, *byte_symbols])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))  # unreachable: every byte is in vocab
    # Role names as single (non-special) tokens: the chat scaffold of a one-turn prompt costs 9
    # tokens instead of 22; decoding still returns the same text.
    backend.add_tokens([AddedToken(word, special=False, normalized=False) for word in _ROLE_WORDS])
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # text -> byte symbols
        pre_tokenizers.Split(Regex("."), behavior="isolated"),  # one token per symbol
    ])
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        mask_token=MASK,
        extra_special_tokens=[IM_START, END_OF_TURN],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


# ---------------------------------------------------------------- models


def _tiny_config(config_cls, tokenizer, overrides: dict[str, Any]):
    allowed = set(inspect.signature(config_cls.__init__).parameters) - {"self"}
    unknown = set(overrides) - allowed - {"attn_implementation", "rope_theta"}
    if unknown:  # transformers would silently store a typo as an attribute
        raise ValueError(
            f"unknown {config_cls.__name__} fields {sorted(unknown)}; pass its fields, 'seed' or 'dtype'"
        )
    fields = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        # Qwen3 has no BOS and reuses <|endoftext|> as bos_token_id; we do the same
        "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        **_MODEL_DEFAULTS,
        **overrides,
    }
    return config_cls(**fields)


def _build(model_cls, config_cls, tokenizer, overrides: dict[str, Any]):
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    seed, dtype = overrides.pop("seed", 0), overrides.pop("dtype", torch.float32)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype or its name, e.g. 'bfloat16'; got {dtype!r}")
    config = _tiny_config(config_cls, tokenizer, overrides)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype).eval()  # eval mode, as from_pretrained returns it
    model.config.dtype = dtype
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    # stop on end of turn first, like Qwen3's generation_config ([<|im_end|>, <|endoftext|>])
    model.generation_config.eos_token_id = [end_of_turn, tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tiny_qwen3(tokenizer=None, **overrides: Any):
    """A tiny `Qwen3ForCausalLM` (QK-norm, GQA); ``overrides`` are `Qwen3Config` fields plus ``seed`` and ``dtype``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _build(Qwen3ForCausalLM, Qwen3Config, tokenizer, dict(overrides))


def build_tiny_llama(tokenizer=None, **overrides: Any):
    """A tiny `LlamaForCausalLM` (GQA); ``overrides`` are `LlamaConfig` fields plus ``seed`` and ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(LlamaForCausalLM, LlamaConfig, tokenizer, dict(overrides))


def build_tiny_qwen2(tokenizer=None, **overrides: Any):
    """A tiny `Qwen2ForCausalLM` (q/k/v biases, GQA); ``overrides`` are `Qwen2Config` fields plus ``seed`` and ``dtype``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _build(Qwen2ForCausalLM, Qwen2Config, tokenizer, dict(overrides))


def build_tiny_llada(tokenizer=None, **overrides: Any):
    """A tiny LLaDA (bidirectional masked-diffusion LM) sized to ``tokenizer``'s vocabulary and mask token.

    ``overrides`` are `LLaDAConfig` fields plus ``seed`` and ``dtype``; see `jetrl_trainer.diffusion.tiny`.
    """
    from jetrl_trainer.diffusion.tiny import build_tiny_llada as _build_llada

    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    ids = dict(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return _build_llada(**{**ids, **overrides})


# ---------------------------------------------------------------- sampling and evaluation


def _end_of_turn_id(tokenizer) -> int:
    token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    return token_id if token_id is not None and token_id != tokenizer.unk_token_id else tokenizer.eos_token_id


@torch.no_grad()
def sample_completions(
    model,
    tokenizer,
    prompts: Sequence[Any],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    batch_size: int = 64,
    seed: int | None = None,
) -> list[str]:
    """Sample one completion per prompt with `generate`, decoded the way TRL's GRPOTrainer decodes them.

    Conversational prompts go through the chat template with ``add_generation_prompt=True``;
    plain strings are used as they are. ``temperature=0`` is greedy. No top-k/top-p, like
    TRL's defaults.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not prompts:
        return []
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    if temperature > 0:
        sampling: dict[str, Any] = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        sampling = dict(do_sample=False)
    texts: list[str] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if seed is not None:
            torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            batch = _encode_prompts(tokenizer, prompts[start:start + batch_size]).to(device)
            out = model.generate(**batch, max_new_tokens=max_new_tokens, eos_token_id=_stop_ids(model, tokenizer),
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
            texts += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return texts


def _stop_ids(model, tokenizer) -> list[int]:
    # the union TRL's GRPOTrainer stops on, plus end of turn for models not built here
    configured = model.generation_config.eos_token_id
    configured = [configured] if isinstance(configured, int) else list(configured or [])
    return list(dict.fromkeys([_end_of_turn_id(tokenizer), tokenizer.eos_token_id, *configured]))


def _encode_prompts(tokenizer, prompts: Sequence[Any]):
    if isinstance(prompts[0], str):
        return tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
    return tokenizer.apply_chat_template(
        list(prompts), add_generation_prompt=True, tokenize=True, return_dict=True,
        return_tensors="pt", padding=True, padding_side="left",
    )


def evaluate_reward(
    model,
    tokenizer,
    task,
    dataset,
    *,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    num_generations: int = 1,
    batch_size: int = 64,
    seed: int = 0,
) -> float:
    """Mean ``task.reward_fn`` over ``num_generations`` sampled completions per row of ``dataset``."""
    rows = [row for row in dataset for _ in range(num_generations)]
    prompts = [row["prompt"] for row in rows]
    texts = sample_completions(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens or task.max_completion_length,
        temperature=temperature, batch_size=batch_size, seed=seed,
    )
    completions = [[{"role": "assistant", "content": t}] for t in texts]  # TRL's conversational form
    columns = {key: [row[key] for row in rows] for key in dataset.column_names if key != "prompt"}
    rewards = task.reward_fn(prompts=prompts, completions=completions, **columns)
    return float(sum(rewards) / len(rewards))


# ---------------------------------------------------------------- SFT warm start


def _sft_examples(tokenizer, task, dataset) -> list[tuple[list[int], list[int]]]:
    """(prompt ids exactly as GRPO renders them, answer ids + end of turn) per row."""
    prompt_ids = tokenizer.apply_chat_template(list(dataset["prompt"]), add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    answers = [task.reference_answer(row) for row in dataset]
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    stop = _end_of_turn_id(tokenizer)
    return [(list(p), list(a) + [stop]) for p, a in zip(prompt_ids, answer_ids)]


def _collate(examples, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Right padding: every real token then sees only real tokens before it (no fully masked rows),
    # and RoPE makes the scores depend on relative positions only, so this trains the same
    # function that left-padded generation runs.
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (p, a) in enumerate(examples):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p):n] = torch.tensor(a)
        mask[i, :n] = 1
    return ids.to(device), mask.to(device), labels.to(device)


def _lr_factor(step: int, steps: int) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))  # cosine down to 10%


def warm_start(
    model,
    tokenizer,
    task,
    *,
    steps: int = 300,
    lr: float = 3e-3,
    batch_size: int = 32,
    seed: int = 0,
    progress: bool = True,
    num_examples: int = 4096,
    dataset=None,
    **difficulty: Any,
) -> dict[str, float]:
    """Supervised fine-tune on ``task``'s reference answers; returns timing and loss figures.

    Prompts are rendered with the chat template exactly as GRPO generation renders them, and the
    loss covers only the answer tokens plus the end-of-turn token (so the model learns to stop).
    ``num_examples`` problems are generated with ``task.make_dataset(num_examples, seed, **difficulty)``
    (or ``dataset`` is used as given) and sampled with replacement. AdamW, 5% warmup then cosine
    to 10% of ``lr``; no weight decay (a few hundred steps on a tiny model do not need it).

    The defaults, on `build_tiny_qwen3` and default arithmetic, take ~9 s of single-thread CPU
    time and lift the mean reward at temperature 1.0 from 0.0 to ~0.5 (docs/tasks.md).

    On CUDA the steps run under `deterministic_algorithms`, so a seed's start has the same bits in
    every process on the same GPU and software: a study can then spread one seed's runs over
    separate device calls (each rebuilds the start) and still compare them from one start.
    """
    from tqdm.auto import tqdm

    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need steps >= 1, batch_size >= 1, lr > 0; got {steps}, {batch_size}, {lr}")
    start_time = time.perf_counter()
    if dataset is None:
        dataset = task.make_dataset(num_examples, seed=seed, **difficulty)
    examples = _sft_examples(tokenizer, task, dataset)
    device, was_training = next(model.parameters()).device, model.training
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps))
    model.train()
    bar = tqdm(range(steps), desc=f"warm start ({task.name})", disable=not progress)
    with deterministic_algorithms(device):
        losses = _sft_steps(model, tokenizer, examples, bar, optimizer, scheduler, batch_size, seed, device)
    model.train(was_training)
    tail = losses[-min(10, len(losses)):]
    return {
        "steps": float(steps),
        "seconds": time.perf_counter() - start_time,
        "loss_start": losses[0],
        "loss_end": sum(tail) / len(tail),
        "num_examples": float(len(examples)),
    }


def _sft_steps(model, tokenizer, examples, bar, optimizer, scheduler, batch_size: int, seed: int, device) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    for _ in bar:
        picks = torch.randint(len(examples), (batch_size,), generator=generator).tolist()
        ids, mask, labels = _collate([examples[i] for i in picks], tokenizer.pad_token_id, device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # (B, T-1, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    return losses


@contextlib.contextmanager
def deterministic_algorithms(device):
    """Torch's deterministic kernels for the block, on CUDA (a no-op elsewhere: CPU kernels already are).

    Strict, not ``warn_only``: with ``warn_only`` the flash and memory-efficient attention backwards
    keep their atomic (run-to-run varying) accumulation and only warn; strict mode switches them to
    their deterministic variants. cuBLAS needs a fixed workspace for repeatable sums
    (``CUBLAS_WORKSPACE_CONFIG``). Both settings are restored afterwards, so the GRPO runs that
    follow keep torch's faster defaults.
    """
    if torch.device(device).type != "cuda":
        yield
        return
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
