"""LLaDA configuration, field-for-field compatible with the published ``config.json``.

The field names and defaults are those of ``GSAI-ML/LLaDA-8B-Instruct``'s ``config.json``, so
``LLaDAConfig()`` describes that model and the published file loads unchanged. Keys we do not
declare (anything a future checkpoint adds) are kept on the config as plain attributes, as
transformers does for every config.

How we depart from the published ``configuration_llada.py``:

* It is a transformers 5 dataclass config with no remote code; ``auto_map`` (if present in a
  ``config.json``) is kept as metadata but never used by us.
* Only the architecture the released checkpoints use is implemented: ``block_type="llama"``,
  ``rope=True``, ``alibi=False``, ``block_group_size=1``, ``layer_norm_type="rms"``, no QK layer
  norm, and an activation in {silu, gelu, relu} gating ``up_proj``. Other values raise a
  ``ValueError`` when the config is built, instead of failing deep inside the model.
* ``init_device``, ``init_fn``, ``init_cutoff_factor``, ``flash_attention`` and ``precision`` are
  accepted for compatibility and ignored: weights are created on the device transformers chooses,
  initialised with ``normal(0, init_std)``, and attention always goes through
  ``torch.nn.functional.scaled_dot_product_attention``.
* The standard transformers names (``hidden_size``, ``num_attention_heads``, ``num_hidden_layers``,
  ``num_key_value_heads``, ``intermediate_size``, ``max_position_embeddings``,
  ``tie_word_embeddings``) are aliases of the LLaDA names, so generic tooling (TRL, peft,
  accelerate, DeepSpeed) can read them.
"""

from __future__ import annotations

from typing import ClassVar

from transformers import PreTrainedConfig

__all__ = ["LLaDAConfig"]

_SUPPORTED_ACTIVATIONS = ("silu", "gelu", "relu")
_SUPPORTED_NORMS = ("rms",)


class LLaDAConfig(PreTrainedConfig):
    r"""Configuration of a LLaDA masked-diffusion language model.

    Parameters (only those that change the computation; every other published key is accepted):
        d_model: hidden size.
        n_layers: number of transformer blocks.
        n_heads: number of query heads; ``d_model`` must be divisible by it.
        n_kv_heads: number of key/value heads (GQA when smaller than ``n_heads``); ``None`` means
            ``n_heads`` (or 1 when ``multi_query_attention`` is true).
        mlp_hidden_size: inner size of the SwiGLU MLP; ``None`` means ``mlp_ratio * d_model``.
        activation_type: activation applied to ``ff_proj`` before it gates ``up_proj``
            (``"silu"`` gives SwiGLU).
        vocab_size, embedding_size: tokenizer size and number of embedding rows / logits
            (``embedding_size`` defaults to ``vocab_size``).
        mask_token_id: id of the ``[MASK]`` token.
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
        include_bias, include_qkv_bias: biases on the linears.
        weight_tying: reuse ``wte`` as the output projection (no ``ff_out`` head).
        attention_dropout, residual_dropout, embedding_dropout: dropout probabilities (0 in LLaDA).
        scale_logits, input_emb_norm: the published logit / embedding scalings.
        init_std: standard deviation of the normal initialisation.
    """

    model_type: ClassVar[str] = "llada"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]
    # Read (not required) by tools that look for remote code, e.g. TRL's reference-model loader reads
    # `config.auto_map`; a checkpoint we save has none, and our class is registered instead.
    auto_map: ClassVar[dict] = {}
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
        "num_key_value_heads": "n_kv_heads",
        "intermediate_size": "mlp_hidden_size",
        "max_position_embeddings": "max_sequence_length",
        "tie_word_embeddings": "weight_tying",
    }

    # Defaults below are GSAI-ML/LLaDA-8B-Instruct's config.json, key for key.
    activation_type: str = "silu"
    alibi: bool = False
    alibi_bias_max: float = 8.0
    attention_dropout: float = 0.0
    attention_layer_norm: bool = False
    attention_layer_norm_with_affine: bool = True
    bias_for_layer_norm: bool | None = False
    block_group_size: int = 1
    block_type: str = "llama"
    d_model: int = 4096
    embedding_dropout: float = 0.0
    embedding_size: int | None = 126464
    eos_token_id: int | None = 126081
    flash_attention: bool = False
    include_bias: bool = False
    include_qkv_bias: bool | None = False
    init_cutoff_factor: float | None = None
    init_device: str | None = "meta"
    init_fn: str = "mitchell"
    init_std: float = 0.02
    input_emb_norm: bool = False
    layer_norm_type: str = "rms"
    layer_norm_with_affine: bool = True
    mask_token_id: int | None = 126336
    max_sequence_length: int = 4096
    mlp_hidden_size: int | None = 12288
    mlp_ratio: int = 4
    multi_query_attention: bool | None = None
    n_heads: int = 32
    n_kv_heads: int | None = 32
    n_layers: int = 32
    pad_token_id: int | None = 126081
    precision: str | None = "amp_bf16"
    residual_dropout: float = 0.0
    rms_norm_eps: float = 1e-05
    rope: bool = True
    rope_full_precision: bool = True
    rope_theta: float = 500000.0
    scale_logits: bool = False
    use_cache: bool = False
    vocab_size: int = 126464
    weight_tying: bool = False

    def __post_init__(self, **kwargs):
        if self.architectures is None:
            self.architectures = ["LLaDAModelLM"]
        super().__post_init__(**kwargs)
        self._validate()

    # -- derived sizes (same rules as the published ModelConfig) -------------------------------

    @property
    def effective_n_kv_heads(self) -> int:
        """Key/value heads actually used: ``n_kv_heads``, else 1 for MQA, else ``n_heads``."""
        if self.n_kv_heads is not None:
            return self.n_kv_heads
        return 1 if self.multi_query_attention else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def effective_mlp_hidden_size(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model

    @property
    def effective_embedding_size(self) -> int:
        return self.embedding_size if self.embedding_size is not None else self.vocab_size

    # -- validation -----------------------------------------------------------------------------

    def _validate(self) -> None:
        unsupported = {
            "block_type": (self.block_type, "llama"),
            "rope": (self.rope, True),
            "alibi": (self.alibi, False),
            "block_group_size": (self.block_group_size, 1),
            "attention_layer_norm": (self.attention_layer_norm, False),
        }
        for name, (value, wanted) in unsupported.items():
            if value != wanted:
                raise ValueError(
                    f"LLaDAConfig.{name}={value!r} is not supported; the released LLaDA checkpoints use "
                    f"{name}={wanted!r}, which is the only architecture implemented here."
                )
        if self.activation_type not in _SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"LLaDAConfig.activation_type={self.activation_type!r} is not supported with the llama block; "
                f"use one of {_SUPPORTED_ACTIVATIONS} (the published 'swiglu' halves the MLP width and does not "
                "fit the separate ff_proj/up_proj weights)."
            )
        if self.layer_norm_type not in _SUPPORTED_NORMS:
            raise ValueError(f"LLaDAConfig.layer_norm_type={self.layer_norm_type!r}; use one of {_SUPPORTED_NORMS}.")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}.")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head dimension d_model/n_heads={self.head_dim} must be even for RoPE.")
        if self.multi_query_attention is not None and self.n_kv_heads is not None:
            implied = 1 if self.multi_query_attention else self.n_heads
            if implied != self.n_kv_heads:
                raise ValueError(
                    f"multi_query_attention={self.multi_query_attention} contradicts n_kv_heads={self.n_kv_heads}; "
                    "set only one of them."
                )
        if self.n_heads % self.effective_n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.effective_n_kv_heads} (GQA)."
            )
        if self.effective_embedding_size < self.vocab_size:
            raise ValueError(
                f"embedding_size={self.embedding_size} must be at least vocab_size={self.vocab_size} (or None)."
            )
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            token = getattr(self, name)
            if isinstance(token, int) and not 0 <= token < self.effective_embedding_size:
                raise ValueError(
                    f"{name}={token} is outside the embedding table of size {self.effective_embedding_size}; "
                    "pass a token id of your tokenizer."
                )
