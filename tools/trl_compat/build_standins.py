"""Build offline stand-ins for the Hub assets that TRL's GRPO tests load.

Writes a Hugging Face cache (``<cache>/hf_home/hub``, the ``models--org--name/snapshots/<hash>`` +
``refs/main`` layout) holding tiny random models under the ``trl-internal-testing/...`` ids, and the
``zen`` prompt data sets as parquet files (``<cache>/datasets/zen/<config>/<split>.parquet``; the
pytest plugin maps ``load_dataset("trl-internal-testing/zen", ...)`` onto them). Nothing is
downloaded from a model hub.

Tokenizers. Several GRPO tests hard-code real Qwen token ids (``151657`` = ``<tool_call>``, ``151645``
= ``<|im_end|>``, ...), so the Qwen stand-ins need the real Qwen byte-level BPE vocabulary. It comes
from ``qwen.tiktoken``, the Qwen BPE rank file that the ``dashscope`` package ships on PyPI
(fetched with ``pip download dashscope --no-deps`` unless ``--qwen-vocab`` points at the file);
the merges are derived from the ranks, and the special/added tokens are placed at the ids the Qwen2.5
and Qwen3 tokenizers use (checked at build time against ids the tests hard-code). The other families
(Llama 3.2, Mistral, Gemma2, Cohere2, GLM-4-MoE, GPT-OSS, Nemotron-H) have no vocabulary on PyPI:
their stand-ins reuse the Qwen BPE with the family's own special tokens appended after it, its
bos/eos/pad roles, BOS insertion where the family adds one, and its chat template where TRL ships
it. Their token ids therefore differ from the real tokenizers (no GRPO test hard-codes those).

Models follow the shapes of TRL's tiny test models (hidden 8 or 16, 2 layers, bfloat16, xavier
init of the linear layers). Two hub folders are built:

* ``hf_home/hub_full``: vocabularies as in TRL's tiny models (151,665 tokens for Qwen2.5, 151,669 /
  151,936 for Qwen3, ...). Faithful, and what the tests that hard-code Qwen token ids need; slow on a
  small CPU, since most GRPO ops (lm_head, softmax, sampling, log-probs) scale with the vocabulary.
* ``hf_home/hub`` (compact): the same models, tokenizers cut to the first ``COMPACT_VOCAB`` BPE ranks
  (every byte is among them, so any text still encodes) plus the same special tokens, and
  ``vocab_size = len(tokenizer)``. Special-token ids therefore differ from the real ones.

The plugin sends the tests whose source hard-codes Qwen special-token ids to ``hub_full`` and the
others to ``hub`` (``TRL_COMPAT_VOCAB=compact``, the default), or every test to ``hub_full``
(``TRL_COMPAT_VOCAB=full``).

Usage: ``python build_standins.py --cache DIR [--qwen-vocab PATH] [--force]``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

BUILD_VERSION = "6"  # bump when the stand-ins change; run.py rebuilds when the stamp differs
ORG = "trl-internal-testing"
DASHSCOPE = "dashscope==2.0.2"
COMPACT_VOCAB = 4096  # regular BPE tokens kept in the compact variant (the first ranks; all 256 bytes are among them)
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN25_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # ids 151643..151656, special
QWEN25_ADDED = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]  # ids 151657..151664, not special
QWEN3_ADDED = ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # ids 151665..151668

# Ids the GRPO tests hard-code (their comments give the text); the build fails if these drift.
QWEN_ID_CHECKS = {
    '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>': [
        151657, 198, 4913, 606, 788, 330, 64648, 22785, 497, 330, 16370, 788, 5212, 64, 788, 220, 18, 11, 330,
        65, 788, 220, 19, 11248, 151658, 151645],
    "I don't know any tool<|im_end|>": [40, 1513, 944, 1414, 894, 5392, 151645],
    "Done!<|im_end|>": [17453, 0, 151645],
}


# ---------------------------------------------------------------- data


# The standard prompts are the first N words of each line of the Zen of Python, with TRL's N per line:
# test_prepare_input_called_with_correct_data compares the prompts it is fed against these texts.
PROMPT_WORDS = [4, 2, 3, 1, 4, 3, 1, 4, 3, 3, 2, 6, 6, 11, 2, 4, 7, 5, 5]


def zen_rows() -> tuple[list[str], list[list[dict]]]:
    """19 prompt-only rows from the Zen of Python (``import this``), as TRL's zen set has."""
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # the text is this.s, rot13-encoded

    lines = [ln.strip() for ln in codecs.decode(this.s, "rot13").splitlines()[2:] if ln.strip()]
    assert len(lines) == 19, len(lines)
    standard, conversational = [], []
    for line, n in zip(lines, PROMPT_WORDS):
        standard.append(" ".join(line.split()[:n]))
        conversational.append([{"role": "user", "content": f"How does this line of the Zen of Python end? {standard[-1]}"}])
    return standard, conversational


def build_zen(out: Path) -> None:
    from datasets import Dataset

    standard, conversational = zen_rows()
    for config, column in (("standard_prompt_only", standard), ("conversational_prompt_only", conversational)):
        # TRL's zen: train_test_split(test_size=0.1, shuffle=False) of 19 rows -> 17 train, 2 test
        split = Dataset.from_dict({"prompt": column}).train_test_split(test_size=0.1, shuffle=False)
        for name, ds in split.items():
            path = out / config / f"{name}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            ds.to_parquet(str(path))


# ---------------------------------------------------------------- tokenizers


def fetch_qwen_vocab(cache: Path) -> Path:
    target = cache / "qwen.tiktoken"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", DASHSCOPE, "--no-deps", "-q", "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("dashscope-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            target.write_bytes(zf.read("dashscope/resources/qwen.tiktoken"))
    return target


def load_bpe(vocab_file: Path, limit: int | None = None):
    """(vocab, merges) in the byte-level alphabet, from a tiktoken rank file.

    One merge per multi-byte token, the last one tiktoken's byte-pair algorithm makes on the way to that
    token (the "recover merges" construction), so the list has one entry per token as real Qwen
    tokenizer.json files do (transformers' TikTokenConverter keeps every possible split instead).
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks: dict[bytes, int] = {}
    for line in vocab_file.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            if limit is None or int(rank) < limit:  # a token's merge parts rank below it: a prefix is closed
                ranks[base64.b64decode(token)] = int(rank)
    enc = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(enc[c] for c in b)

    def last_merge(token: bytes, max_rank: int) -> tuple[bytes, bytes]:
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best, best_rank = None, None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < max_rank and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise ValueError(f"cannot recover the merge of token {token!r}")
        return parts[0], parts[1]

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            a, b = last_merge(token, rank)
            merges.append((to_str(a), to_str(b)))
    return {to_str(k): v for k, v in ranks.items()}, merges


_BPE_CACHE: dict[tuple, tuple] = {}


def make_tokenizer(vocab_file: Path, *, special: list[str], added: list[str] = (), bos=None, eos, pad=None,
                   unk=None, add_bos=False, chat_template=None, model_max_length=131072, vocab_limit=None):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    key = (str(vocab_file), vocab_limit)
    if key not in _BPE_CACHE:
        _BPE_CACHE[key] = load_bpe(vocab_file, vocab_limit)
    vocab, merges = _BPE_CACHE[key]
    backend = Tokenizer(models.BPE(dict(vocab), list(merges), fuse_unk=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if added:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk,
        chat_template=chat_template, model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


# A minimal [INST] template: TRL ships none for Mistral 0.2; the tests that load it use plain prompts.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def tokenizer_specs() -> dict[str, dict]:
    qwen25 = dict(special=QWEN25_SPECIAL, added=QWEN25_ADDED, eos="<|im_end|>", pad="<|endoftext|>")
    qwen3 = dict(special=QWEN25_SPECIAL, added=QWEN25_ADDED + QWEN3_ADDED, eos="<|im_end|>", pad="<|endoftext|>")
    return {
        "qwen2_5": dict(qwen25, chat_template=trl_template("qwen2_5"), model_max_length=131072),
        "qwen3": dict(qwen3, chat_template=trl_template("qwen3"), model_max_length=131072),
        "llama3_2": dict(
            special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                     "<|eot_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"],
            bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True, chat_template=trl_template("llama3_2"),
        ),
        "mistral": dict(special=["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", unk="<unk>", add_bos=True,
                        chat_template=MISTRAL_TEMPLATE, model_max_length=32768),
        "gemma": dict(special=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>",
                      eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True, chat_template=trl_template("gemma"),
                      model_max_length=8192),
        "cohere2": dict(
            special=["<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
                     "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"],
            bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", unk="<UNK>", add_bos=True,
            chat_template=trl_template("cohere2"),
        ),
        "glm4moe": dict(
            special=["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                     "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                     "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
            eos="<|endoftext|>", pad="<|endoftext|>", chat_template=trl_template("glm4moe"),
        ),
        "gptoss": dict(
            special=["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                     "<|end|>", "<|message|>", "<|call|>"],
            bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>", chat_template=trl_template("gptoss"),
        ),
        "nemotron_3_nano": dict(
            special=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                     "</tool_call>", "<tool_response>", "</tool_response>", "<SPECIAL_PAD>"],
            bos="<s>", eos="<|im_end|>", pad="<SPECIAL_PAD>", unk="<unk>",
            chat_template=trl_template("nemotron_3_nano"),
        ),
    }


def check_qwen_ids(tok) -> None:
    for text, ids in QWEN_ID_CHECKS.items():
        got = tok(text, add_special_tokens=False)["input_ids"]
        if got != ids:
            raise RuntimeError(f"Qwen stand-in tokenizer drifted: {text!r} -> {got}, the tests expect {ids}")


# ---------------------------------------------------------------- models


def _ids(tok, *tokens):
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def model_specs(tok: dict, full: bool) -> dict[str, dict]:
    """repo name -> (tokenizer family, transformers class name, config, generation-config kwargs).

    ``full``: vocabulary sizes as in TRL's tiny models; otherwise every model's vocabulary is its
    (compact) tokenizer's length.
    """
    import transformers as tf

    q25, q3, ll, gem = tok["qwen2_5"], tok["qwen3"], tok["llama3_2"], tok["gemma"]

    def vocab(real: int, tokenizer) -> int:
        return real if full else len(tokenizer)

    eot, eos, pad = _ids(q25, "<|im_end|>", "<|endoftext|>", "<|endoftext|>")
    small = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
    reward = dict(small, hidden_size=16, num_labels=1)
    # Qwen: bos 151643, pad 151643, eos [151645, 151643] in the full vocabulary (same ids in Qwen2.5 and Qwen3)
    qwen25_gen = dict(bos_token_id=eos, pad_token_id=pad, eos_token_id=[eot, eos], do_sample=True,
                      repetition_penalty=1.05, temperature=0.7, top_p=0.8, top_k=20)
    qwen3_gen = dict(bos_token_id=eos, pad_token_id=pad, eos_token_id=[eot, eos], do_sample=True,
                     temperature=0.6, top_k=20, top_p=0.95)
    llama_gen = dict(bos_token_id=ll.bos_token_id, eos_token_id=_ids(ll, "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
                     do_sample=True, temperature=0.6, top_p=0.9)
    specs = {
        "tiny-Qwen2ForCausalLM-2.5": ("qwen2_5", "Qwen2ForCausalLM", tf.Qwen2Config(vocab_size=len(q25), **small),
                                      qwen25_gen),
        "tiny-Qwen2ForSequenceClassification-2.5": (
            "qwen2_5", "Qwen2ForSequenceClassification",
            tf.Qwen2Config(vocab_size=vocab(152064, q25), bos_token_id=eos, eos_token_id=eot, tie_word_embeddings=False,
                           **reward), qwen25_gen),
        "tiny-Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM", tf.Qwen3Config(vocab_size=len(q3), **small), qwen3_gen),
        "tiny-Qwen3ForSequenceClassification": (
            "qwen3", "Qwen3ForSequenceClassification",
            tf.Qwen3Config(vocab_size=vocab(151936, q3), bos_token_id=eos, eos_token_id=eot, tie_word_embeddings=True,
                           **reward), qwen3_gen),
        "tiny-Qwen3MoeForCausalLM": (
            "qwen3", "Qwen3MoeForCausalLM",
            tf.Qwen3MoeConfig(vocab_size=vocab(151936, q3), num_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=40960, norm_topk_prob=True, bos_token_id=eos, eos_token_id=eot,
                              head_dim=128, **small),
            qwen3_gen),
        "tiny-LlamaForCausalLM-3.2": ("llama3_2", "LlamaForCausalLM",
                                      tf.LlamaConfig(vocab_size=len(ll), bos_token_id=ll.bos_token_id,
                                                     eos_token_id=llama_gen["eos_token_id"], **small), llama_gen),
        "tiny-LlamaForSequenceClassification-3.2": (
            "llama3_2", "LlamaForSequenceClassification",
            tf.LlamaConfig(vocab_size=len(ll), bos_token_id=ll.bos_token_id, eos_token_id=llama_gen["eos_token_id"],
                           tie_word_embeddings=True, **reward), llama_gen),
        "tiny-MistralForCausalLM-0.2": (
            "mistral", "MistralForCausalLM",
            tf.MistralConfig(vocab_size=len(tok["mistral"]), bos_token_id=tok["mistral"].bos_token_id,
                             eos_token_id=tok["mistral"].eos_token_id, **small),
            dict(bos_token_id=tok["mistral"].bos_token_id, eos_token_id=tok["mistral"].eos_token_id)),
        "tiny-Gemma2ForCausalLM": (
            "gemma", "Gemma2ForCausalLM",
            tf.Gemma2Config(vocab_size=len(gem), bos_token_id=gem.bos_token_id, eos_token_id=gem.eos_token_id,
                            pad_token_id=gem.pad_token_id, **small),
            dict(bos_token_id=gem.bos_token_id, eos_token_id=_ids(gem, "<eos>", "<end_of_turn>"),
                 pad_token_id=gem.pad_token_id, cache_implementation="hybrid")),
        "tiny-Cohere2ForCausalLM": (
            "cohere2", "Cohere2ForCausalLM",
            tf.Cohere2Config(vocab_size=len(tok["cohere2"]), logit_scale=1.0, bos_token_id=tok["cohere2"].bos_token_id,
                             eos_token_id=tok["cohere2"].eos_token_id, pad_token_id=tok["cohere2"].pad_token_id,
                             **small),
            dict(bos_token_id=tok["cohere2"].bos_token_id, eos_token_id=tok["cohere2"].eos_token_id,
                 pad_token_id=tok["cohere2"].pad_token_id)),
        "tiny-Glm4MoeForCausalLM": (
            "glm4moe", "Glm4MoeForCausalLM",
            tf.Glm4MoeConfig(vocab_size=len(tok["glm4moe"]), moe_intermediate_size=32, head_dim=2, n_routed_experts=4,
                             num_experts_per_tok=2, attention_bias=True, routed_scaling_factor=2.5, use_qk_norm=True,
                             eos_token_id=_ids(tok["glm4moe"], "<|endoftext|>", "<|user|>", "<|observation|>"),
                             pad_token_id=tok["glm4moe"].pad_token_id, **small),
            dict(eos_token_id=_ids(tok["glm4moe"], "<|endoftext|>", "<|user|>", "<|observation|>"),
                 pad_token_id=tok["glm4moe"].pad_token_id, do_sample=True, temperature=0.6, top_p=0.95)),
        "tiny-GptOssForCausalLM": (
            "gptoss", "GptOssForCausalLM",
            tf.GptOssConfig(vocab_size=len(tok["gptoss"]), num_local_experts=4, num_experts_per_tok=2,
                            eos_token_id=tok["gptoss"].eos_token_id, pad_token_id=tok["gptoss"].pad_token_id, **small),
            dict(bos_token_id=tok["gptoss"].bos_token_id, pad_token_id=tok["gptoss"].pad_token_id,
                 eos_token_id=_ids(tok["gptoss"], "<|return|>", "<|endoftext|>", "<|call|>"))),
        "tiny-NemotronHForCausalLM-nano": (
            "nemotron_3_nano", "NemotronHForCausalLM",
            tf.NemotronHConfig(
                vocab_size=len(tok["nemotron_3_nano"]), hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=32, layers_block_type=["mamba", "attention", "moe"], mamba_num_heads=8,
                mamba_head_dim=4, n_groups=1, ssm_state_size=16, conv_kernel=4, expand=2, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                use_mamba_kernels=False, bos_token_id=tok["nemotron_3_nano"].bos_token_id,
                eos_token_id=tok["nemotron_3_nano"].eos_token_id, pad_token_id=tok["nemotron_3_nano"].pad_token_id),
            dict(bos_token_id=tok["nemotron_3_nano"].bos_token_id, eos_token_id=tok["nemotron_3_nano"].eos_token_id,
                 pad_token_id=tok["nemotron_3_nano"].pad_token_id)),
    }
    return specs


REMOTE_CONFIG = '''from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    """A Llama config under its own model_type, so that only the remote-code path can load it."""

    model_type = "remote"
'''

REMOTE_MODELING = '''from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel

from .configuration_remote import RemoteConfig


class RemoteModel(LlamaModel):
    config_class = RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteConfig
'''


def init_tiny(model) -> None:
    import torch
    from torch import nn

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)


def snapshot_dir(hub: Path, kind: str, repo_id: str) -> Path:
    """Create ``<hub>/<kind>s--org--name`` with ``refs/main`` and return its (empty) snapshot folder."""
    commit = hashlib.sha1(f"trl-compat-standin/{BUILD_VERSION}/{hub.name}/{repo_id}".encode()).hexdigest()
    root = hub / f"{kind}s--{repo_id.replace('/', '--')}"
    if root.exists():
        shutil.rmtree(root)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    return snap


def save_model(hub: Path, name: str, tokenizer, cls_name: str, config, gen_kwargs: dict, *, seed: int) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = getattr(tf, cls_name)(config).to(torch.bfloat16)
    init_tiny(model)
    if cls_name.startswith("NemotronH"):  # the upstream model keeps these Mamba parameters in float32
        for layer in model.model.layers:
            mixer = getattr(layer, "mixer", None)
            if hasattr(mixer, "A_log"):
                mixer.A_log.data, mixer.D.data = mixer.A_log.data.float(), mixer.D.data.float()
    snap = snapshot_dir(hub, "model", f"{ORG}/{name}")
    model.save_pretrained(snap)
    tokenizer.save_pretrained(snap)
    if "SequenceClassification" not in cls_name:
        tf.GenerationConfig(**gen_kwargs).save_pretrained(snap)
    (snap / "README.md").write_text(f"Offline stand-in for {ORG}/{name}, built by tools/trl_compat/build_standins.py\n")
    return snap


def build_hub(hub: Path, vocab: Path, full: bool) -> None:
    """All model stand-ins into one hub cache folder: full (real-size) or compact vocabularies."""
    import transformers as tf

    limit = None if full else COMPACT_VOCAB
    tokenizers = {family: make_tokenizer(vocab, vocab_limit=limit, **spec) for family, spec in tokenizer_specs().items()}
    if full:
        check_qwen_ids(tokenizers["qwen2_5"])
        check_qwen_ids(tokenizers["qwen3"])
        assert len(tokenizers["qwen2_5"]) == 151665 and len(tokenizers["qwen3"]) == 151669

    for seed, (name, (family, cls_name, config, gen)) in enumerate(model_specs(tokenizers, full).items()):
        save_model(hub, name, tokenizers[family], cls_name, config, gen, seed=seed)
        print(f"built {hub.name}/{name} (vocab {config.vocab_size})")

    # tiny-RemoteForCausalLM: Llama weights under model_type "remote", loadable only with trust_remote_code
    ll = tokenizers["llama3_2"]
    cfg = tf.LlamaConfig(vocab_size=len(ll), bos_token_id=ll.bos_token_id, eos_token_id=ll.eos_token_id,
                         hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         intermediate_size=32)
    snap = save_model(hub, "tiny-RemoteForCausalLM", ll, "LlamaForCausalLM", cfg,
                      dict(bos_token_id=ll.bos_token_id, eos_token_id=ll.eos_token_id), seed=99)
    (snap / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (snap / "modeling_remote.py").write_text(REMOTE_MODELING)
    config = json.loads((snap / "config.json").read_text())
    config.update(model_type="remote", architectures=["RemoteForCausalLM"], auto_map={
        "AutoConfig": "configuration_remote.RemoteConfig",
        "AutoModel": "modeling_remote.RemoteModel",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
    })
    (snap / "config.json").write_text(json.dumps(config, indent=2))
    print(f"built {hub.name}/tiny-RemoteForCausalLM")


def build(cache: Path, qwen_vocab: Path | None, force: bool = False) -> None:
    """``<cache>/hf_home/hub_full`` (vocabularies as TRL's tiny models), ``<cache>/hf_home/hub`` (compact), zen."""
    stamp = cache / "STAMP"
    if stamp.exists() and stamp.read_text().strip() == BUILD_VERSION and not force:
        print(f"stand-ins up to date in {cache}")
        return
    cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    vocab = qwen_vocab or fetch_qwen_vocab(cache)
    for folder, full in (("hub_full", True), ("hub", False)):
        hub = cache / "hf_home" / folder
        if hub.exists():
            shutil.rmtree(hub)
        hub.mkdir(parents=True)
        build_hub(hub, vocab, full)
    build_zen(cache / "datasets" / "zen")
    print("built zen (standard_prompt_only, conversational_prompt_only)")
    stamp.write_text(BUILD_VERSION + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="output folder (outside the repo)")
    parser.add_argument("--qwen-vocab", type=Path, default=None, help="a qwen.tiktoken rank file (default: from dashscope)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the stamp is current")
    args = parser.parse_args()
    build(args.cache.resolve(), args.qwen_vocab, args.force)


if __name__ == "__main__":
    main()
