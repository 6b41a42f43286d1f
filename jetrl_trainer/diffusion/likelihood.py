"""Per-token log-likelihood estimators for LLaDA completions (what GRPO's ratios are built from).

A masked-diffusion LM has no exact per-token log-probability; GRPO needs one. The default
estimator is d1 / diffu-GRPO's one-step mean-field estimate: mask the *whole* completion, mask
each prompt token with probability ``p_mask_prompt``, run one forward pass, and read
``log p(completion_t | masked input)`` at every completion position.

The random prompt mask acts as regularisation across the GRPO inner iterations, so it must be
*identical* wherever a ratio is formed: the old, rollout (sampling-precision) and current
log-probs of one inner iteration use one mask seed, and each inner iteration uses a new one
(:func:`mask_seeds_for_step`). Evaluate the estimator under each precision phase on that same
mask to get the rollout log-probs for the correctors.

How we depart from d1:

* The mask is a pure function of ``(mask_seed, row content, position counted from the prompt's
  end)`` — a counter-based hash, not a global ``set_seed`` followed by ``torch.rand(B, L)``. TRL
  shuffles and re-splits the rollout batch before the training forward passes, so a mask that
  depended on a row's place in the batch would differ between the old and the current log-probs.
  The hash gives the same mask for the same sequence in any batch, chunking, padding or device.
* Padding is attended to by nothing (the prompt's attention mask is passed to the model; d1
  passes none) and is never counted as a masked prompt token.
* Logits are divided by ``temperature`` before the log-softmax, as TRL does for AR models
  (d1 does not scale them).
* Estimators are pluggable: register another (e.g. a multi-sample ELBO) with
  :func:`register_estimator` and select it by name with :func:`get_estimator`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from jetrl_trainer._hashing import M32 as _M32
from jetrl_trainer._hashing import mix32 as _mix32
from jetrl_trainer._hashing import mix_ints as _mix_int

__all__ = [
    "LikelihoodEstimator",
    "register_estimator",
    "get_estimator",
    "available_estimators",
    "mean_field_logps",
    "mask_seeds_for_step",
    "mask_prompt_tokens",
    "token_logps",
]


@runtime_checkable
class LikelihoodEstimator(Protocol):
    """``(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, mask_seed, ...) -> (B, T)``.

    Shapes: prompts ``(B, P)`` left-padded with ``prompt_mask`` 1 on real tokens; completions
    ``(B, T)``. ``mask_seed`` is one int for the batch or a ``(B,)`` int64 tensor (one per row, so a
    micro-batch may mix rows from different rollout batches). Returns float32 per-token log-probs
    of ``completion_ids``; the caller applies ``completion_mask`` when reducing. Must be
    deterministic given ``mask_seed``.
    """

    def __call__(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        *,
        mask_seed: int | torch.Tensor,
        mask_token_id: int | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor: ...


_REGISTRY: dict[str, LikelihoodEstimator] = {}


def register_estimator(name: str) -> Callable[[LikelihoodEstimator], LikelihoodEstimator]:
    """Decorator: make an estimator available as ``get_estimator(name)``."""

    def decorator(fn: LikelihoodEstimator) -> LikelihoodEstimator:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"A likelihood estimator named {name!r} is already registered.")
        _REGISTRY[name] = fn
        return fn

    return decorator


def get_estimator(name: str | LikelihoodEstimator) -> LikelihoodEstimator:
    """The registered estimator ``name`` (a callable is returned as is)."""
    if callable(name):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"Unknown likelihood estimator {name!r}; available: {available_estimators()}.")
    return _REGISTRY[name]


def available_estimators() -> list[str]:
    return sorted(_REGISTRY)


# -- mask seeds ---------------------------------------------------------------------------------

def _hash_seeds(mask_seed: int | torch.Tensor, batch_size: int, device: torch.device) -> torch.Tensor:
    """``(B,)`` hashed seeds from one seed or one per row; equals ``_mix_int(seed)`` element-wise."""
    seeds = torch.as_tensor(mask_seed, dtype=torch.int64, device=device)
    if seeds.dim() == 0:
        seeds = seeds.expand(batch_size)
    elif seeds.shape != (batch_size,):
        raise ValueError(f"mask_seed must be an int or a ({batch_size},) tensor, got shape {tuple(seeds.shape)}.")
    return _mix32(_mix32(seeds & _M32) ^ ((seeds >> 32) & _M32))


def mask_seeds_for_step(base_seed: int, generation_step: int, num_iterations: int) -> list[int]:
    """One mask seed per GRPO inner iteration for the rollout batch generated at ``generation_step``.

    Recomputable anywhere (no need to carry seeds in the batch): the same arguments give the same
    seeds, so the old / rollout / current log-probs of inner iteration ``i`` all use ``seeds[i]``,
    while different iterations and different generation steps get different masks (as in d1).
    """
    if num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {num_iterations}.")
    return [_mix_int(base_seed, generation_step, i, 0x5EED) for i in range(num_iterations)]


# -- masking ------------------------------------------------------------------------------------


def _row_keys(prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """A 32-bit hash per row of its real tokens and their positions (padding excluded), ``(B,)``."""
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    dev = prompt_ids.device
    from_end = torch.arange(P - 1, -1, -1, device=dev)  # prompt positions counted from its last token
    from_start = torch.arange(T, device=dev) + (1 << 20)  # completion positions, a disjoint range
    ids = torch.cat([prompt_ids, completion_ids], dim=1).long() & _M32
    pos = torch.cat([from_end, from_start])[None, :]
    valid = torch.cat([prompt_mask, completion_mask], dim=1).bool()
    terms = _mix32(_mix32(ids) ^ pos)
    return _mix32((terms * valid).sum(dim=1) & _M32)


def mask_prompt_tokens(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    mask_seed: int | torch.Tensor,
    p_mask_prompt: float,
) -> torch.Tensor:
    """Boolean ``(B, P)``: which real prompt tokens to mask, each with probability ``p_mask_prompt``.

    Deterministic in ``(mask_seed, the row's tokens, position from the prompt's end)``, hence the same
    for a sequence whatever batch, order or left padding it comes with.
    """
    if not 0.0 <= p_mask_prompt <= 1.0:
        raise ValueError(f"p_mask_prompt must be in [0, 1], got {p_mask_prompt}.")
    B, P = prompt_ids.shape
    seed = _hash_seeds(mask_seed, B, prompt_ids.device)  # (B,)
    keys = _row_keys(prompt_ids, prompt_mask, completion_ids, completion_mask)  # (B,)
    from_end = torch.arange(P - 1, -1, -1, device=prompt_ids.device)
    bits = _mix32(_mix32(keys[:, None] ^ seed[:, None]) ^ from_end[None, :])  # (B, P) uniform in [0, 2^32)
    threshold = round(p_mask_prompt * 2**32)
    return (bits < threshold) & prompt_mask.bool()


def token_logps(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)`` at ``token_ids``, float32 ``(B, T)``; one row at a time.

    Row-wise so a ``(B, T, V)`` float32 copy of bf16 logits is never materialised (V is 126k for LLaDA).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}.")
    out = []
    for row_logits, row_ids in zip(logits, token_ids):
        row = row_logits.float() / temperature
        out.append(row.gather(-1, row_ids[:, None]).squeeze(-1) - torch.logsumexp(row, dim=-1))
    return torch.stack(out)


# -- estimators ---------------------------------------------------------------------------------


@register_estimator("mean_field")
def mean_field_logps(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    mask_seed: int | torch.Tensor,
    mask_token_id: int | None = None,
    temperature: float = 1.0,
    p_mask_prompt: float = 0.3,
) -> torch.Tensor:
    """One-step mean-field estimate (d1): completion fully masked, prompt masked with ``p_mask_prompt``.

    Returns ``(B, T)`` float32 log-probs of ``completion_ids``. The whole completion canvas is attended
    (as when it was sampled); ``completion_mask`` only seeds the mask hash, so tokens after the first
    EOS do not change the mask. Gradients flow when called with grad enabled.
    """
    _check_shapes(prompt_ids, prompt_mask, completion_ids, completion_mask)
    if mask_token_id is None:
        mask_token_id = getattr(getattr(model, "config", None), "mask_token_id", None)
    if mask_token_id is None:
        raise ValueError("mask_token_id is required: pass it, or use a model whose config has mask_token_id.")
    masked_prompt = mask_prompt_tokens(
        prompt_ids, prompt_mask, completion_ids, completion_mask, mask_seed=mask_seed, p_mask_prompt=p_mask_prompt
    )
    noisy_prompt = prompt_ids.masked_fill(masked_prompt, mask_token_id)
    noisy_completion = torch.full_like(completion_ids, mask_token_id)
    input_ids = torch.cat([noisy_prompt, noisy_completion], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_mask)], dim=1)
    T = completion_ids.shape[1]
    logits = model(input_ids, attention_mask=attention_mask, logits_to_keep=T).logits  # (B, T, V)
    return token_logps(logits, completion_ids, temperature)


def _check_shapes(prompt_ids, prompt_mask, completion_ids, completion_mask) -> None:
    if prompt_ids.dim() != 2 or completion_ids.dim() != 2 or prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(
            f"prompt_ids {tuple(prompt_ids.shape)} and completion_ids {tuple(completion_ids.shape)} must be "
            "(B, P) and (B, T) with the same B."
        )
    if prompt_mask.shape != prompt_ids.shape or completion_mask.shape != completion_ids.shape:
        raise ValueError("prompt_mask / completion_mask must have the shapes of prompt_ids / completion_ids.")
