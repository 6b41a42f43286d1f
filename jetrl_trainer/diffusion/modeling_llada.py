"""LLaDA masked-diffusion transformer, loadable from the published checkpoints without remote code.

LLaDA is a Llama-shaped transformer with *bidirectional* attention: every position sees every
(non-padding) position, and the model predicts the original token under each ``[MASK]``. The
module tree and parameter names are the published ones, so ``GSAI-ML/LLaDA-8B-Instruct``'s
safetensors load as they are::

    model.transformer.wte                                  token embedding
    model.transformer.blocks.{i}.attn_norm / ff_norm       RMSNorm weights
    model.transformer.blocks.{i}.q_proj / k_proj / v_proj  attention input projections
    model.transformer.blocks.{i}.attn_out                  attention output projection
    model.transformer.blocks.{i}.ff_proj                   MLP gate:  act(ff_proj(x)) * up_proj(x)
    model.transformer.blocks.{i}.up_proj                   MLP up projection
    model.transformer.blocks.{i}.ff_out                    MLP down projection
    model.transformer.ln_f                                 final RMSNorm
    model.transformer.ff_out                               LM head (absent when weight_tying)

Note that the LM head and the MLP down projections share the suffix ``ff_out``: anything that
selects modules by suffix (LoRA targets, quantization filters) must use the full name
(see :mod:`jetrl_trainer.diffusion.lora`).

How we depart from the published ``modeling_llada.py``:

* One code path: the llama block, RoPE (fp32 by default, as ``rope_full_precision``), RMSNorm in
  fp32, attention through ``F.scaled_dot_product_attention`` (GQA via ``enable_gqa``, which
  repeats key/value heads exactly like the published ``repeat_interleave``). No KV cache, no ALiBi,
  no block groups, no FlashAttention switch — none is used by the released checkpoints.
* Every projection is a plain ``nn.Linear`` called as a module (the LM head too, unless weights are
  tied), so peft LoRA and our in-place ``nn.Linear`` swaps (FP8/NVFP4) see every GEMM.
* Gradient checkpointing is transformers' standard one (blocks are ``GradientCheckpointingLayer``).
* The gated activation ``act(ff_proj(h)) * up_proj(h)`` is a parameter-free sub-module
  (``LLaDAGatedActivation``), so on CUDA with FP8 it can hand ``ff_out`` its FP8 quantization from
  one fused kernel (bit-identical values).
* ``logits_to_keep`` (an int: last N positions, or a slice / index tensor) skips the LM head where
  logits are not needed; the published model only has ``last_logits_only``.
* Padding keys are masked with an additive ``finfo.min`` bias, as published; the mask is skipped
  when it has no zeros, as published, so unpadded batches keep the fastest SDPA kernel.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_llada import LLaDAConfig

__all__ = [
    "LLaDAModel",
    "LLaDAModelLM",
    "LLaDALlamaBlock",
    "LLaDARMSNorm",
    "LLaDAGatedActivation",
    "LLaDAPrefixCache",
    "rope_cos_sin",
]

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class LLaDARMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the affine weight, as published."""

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.eps = config.rms_norm_eps
        affine = config.layer_norm_with_affine
        with_bias = config.include_bias if config.bias_for_layer_norm is None else config.bias_for_layer_norm
        self.weight = nn.Parameter(torch.ones(config.d_model)) if affine else None
        self.bias = nn.Parameter(torch.zeros(config.d_model)) if affine and with_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        if self.weight is None:
            return x
        return self.weight * x if self.bias is None else self.weight * x + self.bias


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``(cos, sin)``, each ``(seq_len, head_dim)`` in fp32, half-split layout.

    Positions are absolute (0..T-1) as in the published model; with left padding a row's real
    tokens are shifted, which leaves attention scores unchanged up to rounding because RoPE only
    depends on relative offsets and padded keys are masked out.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], full_precision: bool):
    cos, sin = rope  # (T, hd), broadcast over (B, H, T, hd)
    work = torch.float32 if full_precision else q.dtype
    qf, kf = q.to(work), k.to(work)
    cos, sin = cos.to(work), sin.to(work)
    q_out = qf * cos + _rotate_half(qf) * sin
    k_out = kf * cos + _rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def _padding_bias(key_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``(B, 1, 1, T)`` additive bias from a boolean key mask; finite so all-padding rows stay NaN-free."""
    if key_mask is None:
        return None
    bias = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return bias.masked_fill_(~key_mask, torch.finfo(dtype).min)[:, None, None, :]


class LLaDAPrefixCache:
    """Keys and values of the first ``length`` positions of every layer (Fast-dLLM's prefix cache).

    An *approximation* for block-wise sampling: the first forward with an empty cache runs on the
    whole sequence and stores each layer's (RoPE-rotated) keys and values of positions
    ``[0, length)``; later forwards with the filled cache run only on positions ``[length, T)``
    and attend to the stored prefix. In a bidirectional model the prefix's keys and values depend
    on the rest of the sequence, so they go stale as the rest changes; that is the approximation.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.keys: list[torch.Tensor] = []  # per layer, (B, Hkv, length, hd)
        self.values: list[torch.Tensor] = []
        self.filled = False


class LLaDAGatedActivation(nn.Module):
    """``act(gate) * up``, LLaDA's inline SwiGLU, as a parameter-free module (state-dict keys unchanged).

    For SiLU on CUDA, when the block's ``ff_out`` is an FP8 ``QuantLinear`` in its phase, the
    product and its 1x128 FP8 quantization come from one fused kernel and the pair is handed to
    ``ff_out`` (:mod:`jetrl_trainer.diffusion._fused`); the values are bit-identical to the plain
    expression, so only the speed changes. ``fused = False`` turns that off.
    """

    def __init__(self, act, consumer: nn.Module | None = None) -> None:
        super().__init__()
        self.act = act
        self.fused = act is F.silu
        # The block, read at call time (its ff_out may be swapped for a QuantLinear or a LoRA layer
        # after construction); a weak link avoids a reference cycle block -> swiglu -> block.
        self._consumer = weakref.ref(consumer) if consumer is not None else (lambda: None)

    def extra_repr(self) -> str:
        return f"act={getattr(self.act, '__name__', self.act)}, fused_fp8_quant={self.fused}"

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.fused and gate.is_cuda:
            from ._fused import fused_swiglu  # lazy: quant/kernels are imported only when this can run

            block = self._consumer()
            h = fused_swiglu(gate, up, None if block is None else block.ff_out)
            if h is not None:
                return h
        return self.act(gate) * up


class LLaDALlamaBlock(GradientCheckpointingLayer):
    """``x + Attn(RMSNorm(x))`` then ``x + ff_out(act(ff_proj(h)) * up_proj(h))`` with ``h = RMSNorm(x)``."""

    def __init__(self, config: LLaDAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, hd, hidden = config.d_model, config.head_dim, config.effective_mlp_hidden_size
        qkv_bias = bool(config.include_bias or config.include_qkv_bias)
        self.attn_norm = LLaDARMSNorm(config)
        self.ff_norm = LLaDARMSNorm(config)
        self.q_proj = nn.Linear(d, config.n_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, config.effective_n_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, config.effective_n_kv_heads * hd, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=config.include_bias)
        self.ff_proj = nn.Linear(d, hidden, bias=config.include_bias)
        self.up_proj = nn.Linear(d, hidden, bias=config.include_bias)
        self.ff_out = nn.Linear(hidden, d, bias=config.include_bias)
        self.act = _ACTIVATIONS[config.activation_type]
        self.swiglu = LLaDAGatedActivation(self.act, consumer=self)
        self.dropout = nn.Dropout(config.residual_dropout)

    def attention(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        key_mask: torch.Tensor | None,
        cache: LLaDAPrefixCache | None = None,
    ) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, cfg.effective_n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, cfg.effective_n_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, k, rope, cfg.rope_full_precision)
        if cache is not None and cache.filled:  # x holds positions [length, T_full): prepend the stored prefix
            k = torch.cat([cache.keys[self.layer_idx], k], dim=2)
            v = torch.cat([cache.values[self.layer_idx], v], dim=2)
        elif cache is not None:
            cache.keys.append(k[:, :, : cache.length])
            cache.values.append(v[:, :, : cache.length])
        att = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=_padding_bias(key_mask, q.dtype),
            dropout_p=cfg.attention_dropout if self.training else 0.0,
            is_causal=False,  # bidirectional: a diffusion LM denoises all positions jointly
            enable_gqa=cfg.effective_n_kv_heads != cfg.n_heads,
        )
        return self.attn_out(att.transpose(1, 2).reshape(B, T, cfg.d_model))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        key_mask: torch.Tensor | None = None,
        cache: LLaDAPrefixCache | None = None,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attn_norm(x), rope, key_mask, cache))
        h = self.ff_norm(x)
        h = self.swiglu(self.ff_proj(h), self.up_proj(h))
        return x + self.dropout(self.ff_out(h))


class LLaDAModel(nn.Module):
    """The published ``LLaDAModel``: a ``transformer`` ModuleDict holding wte, blocks, ln_f, ff_out."""

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.config = config
        vocab = config.effective_embedding_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, config.d_model),
                emb_drop=nn.Dropout(config.embedding_dropout),
                ln_f=LLaDARMSNorm(config),
                blocks=nn.ModuleList(LLaDALlamaBlock(config, i) for i in range(config.n_layers)),
            )
        )
        if not config.weight_tying:
            self.transformer["ff_out"] = nn.Linear(config.d_model, vocab, bias=config.include_bias)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int | slice | torch.Tensor = 0,
        output_hidden_states: bool = False,
        prefix_cache: LLaDAPrefixCache | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        cfg, tr = self.config, self.transformer
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        x = tr.wte(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, d)
        if cfg.input_emb_norm:
            x = x * (cfg.d_model**0.5)
        x = tr.emb_drop(x)
        rope = rope_cos_sin(x.shape[1], cfg.head_dim, cfg.rope_theta, x.device)
        key_mask = _key_mask(attention_mask, x.shape[:2])
        keep = _keep_index(logits_to_keep)
        cached = prefix_cache is not None and prefix_cache.filled
        if cached:  # run positions [length, T) only; positions (RoPE) and kept logits stay absolute
            start = prefix_cache.length
            x, rope, keep = x[:, start:], (rope[0][start:], rope[1][start:]), _shift_keep(keep, start)
        hidden_states = [] if output_hidden_states else None
        for block in tr.blocks:
            if hidden_states is not None:
                hidden_states.append(x)
            x = block(x, rope, key_mask, prefix_cache)
        if prefix_cache is not None:
            prefix_cache.filled = True
        x = tr.ln_f(x[:, keep])
        if hidden_states is not None:
            hidden_states.append(x)
        # The tied head reads the embedding matrix directly, as published; untied, it is a module call so
        # that module swaps (quantization, LoRA) apply to it.
        logits = F.linear(x, tr.wte.weight) if cfg.weight_tying else tr.ff_out(x)
        if cfg.scale_logits:
            logits = logits * (1 / math.sqrt(cfg.d_model))
        return logits, tuple(hidden_states) if hidden_states is not None else None


def _key_mask(attention_mask: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if attention_mask.shape != shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {tuple(shape)} (B, T).")
    key_mask = attention_mask.bool()
    # Same shortcut as the published model: no padding -> no mask -> fastest SDPA kernel.
    return None if bool(key_mask.all()) else key_mask


def _shift_keep(keep: slice | torch.Tensor, start: int) -> slice | torch.Tensor:
    """``keep`` (absolute positions) for a forward that starts at position ``start``."""
    if isinstance(keep, torch.Tensor):
        return keep - start
    if keep.stop is None and (keep.start is None or keep.start < 0):  # every position / the last N: unchanged
        return keep
    if keep.step not in (None, 1) or keep.start is None or keep.start < start:
        raise ValueError(f"with a filled prefix cache of {start} positions, logits_to_keep must lie after it; got {keep}.")
    return slice(keep.start - start, None if keep.stop is None else keep.stop - start)


def _keep_index(logits_to_keep: int | slice | torch.Tensor) -> slice | torch.Tensor:
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep={logits_to_keep} must be >= 0 (0 keeps every position).")
        return slice(-logits_to_keep, None) if logits_to_keep > 0 else slice(None)
    return logits_to_keep


class LLaDAModelLM(PreTrainedModel):
    """LLaDA as a transformers model: ``model(input_ids, attention_mask).logits`` is ``(B, T, V)``.

    The class name, ``base_model_prefix`` and ``_no_split_modules`` follow the published remote code,
    so ``architectures: ["LLaDAModelLM"]`` in a checkpoint's ``config.json`` names this class.
    Logits are predictions for *every* position (no shift): read them at ``[MASK]`` positions.
    """

    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDALlamaBlock"]
    supports_gradient_checkpointing = True
    _supports_sdpa = True

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.model = LLaDAModel(config)
        if getattr(self, "generation_config", None) is None:
            # transformers gives one only to models that can_generate(); trainers (TRL's GRPO) read
            # pad / eos from it, so a LLaDA id loads and trains like any other model id.
            self.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.transformer.wte = value

    def get_output_embeddings(self) -> nn.Module:
        tr = self.model.transformer
        return tr.wte if self.config.weight_tying else tr.ff_out

    def set_output_embeddings(self, value: nn.Module) -> None:
        if self.config.weight_tying:
            raise ValueError("weight_tying=True: the output projection is the input embedding; set that instead.")
        self.model.transformer.ff_out = value

    @classmethod
    def can_generate(cls) -> bool:
        # transformers' autoregressive ``generate`` does not apply; see jetrl_trainer.diffusion.generate.
        return False

    def prepare_inputs_for_generation(self, *args, **kwargs):
        # Present because peft's CAUSAL_LM wrapper reads this attribute when it wraps a model.
        raise NotImplementedError(
            "LLaDA is not autoregressive; sample with jetrl_trainer.diffusion.generate(model, prompt_ids, ...)."
        )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | slice | torch.Tensor = 0,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: object | None = None,
        use_cache: bool | None = None,
        prefix_cache: LLaDAPrefixCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits for every kept position. ``use_cache`` is ignored (there is no KV cache to build).

        ``prefix_cache`` (a :class:`LLaDAPrefixCache`) is the sampler's opt-in, approximate prefix
        cache: an empty one is filled by this call, a filled one makes the call skip its positions.
        """
        if labels is not None:
            raise ValueError(
                "LLaDA does not compute a next-token loss from labels; score completions with "
                "jetrl_trainer.diffusion.likelihood instead."
            )
        if output_attentions:
            raise ValueError("output_attentions is not supported (attention runs in fused SDPA).")
        if past_key_values is not None:
            raise ValueError("LLaDA has no KV cache: every denoising step re-reads the whole sequence.")
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        logits, hidden_states = self.model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            logits_to_keep=logits_to_keep,
            output_hidden_states=bool(output_hidden_states),
            prefix_cache=prefix_cache,
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if not return_dict:
            return (logits,) if hidden_states is None else (logits, hidden_states)
        return CausalLMOutputWithPast(logits=logits, hidden_states=hidden_states)
