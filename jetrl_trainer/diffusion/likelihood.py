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
* Estimators are pluggable: register another with :func:`register_estimator` and select it by
  name with :func:`get_estimator`.

The second built-in estimator, ``"elbo"``, is LLaDA's Monte-Carlo bound (its published
``get_log_likelihood``): ``log p(completion | prompt) >= E_t[(1/t) Σ_{masked} log p(x_i | x_t)]``
with ``l ~ U{1..L}`` completion tokens masked uniformly at random (``t = l/L``) and the prompt
never masked. :func:`elbo_logps` returns it per token, ``(1/n) Σ_j (L/l_j) 1[i ∈ M_j] log p_j(x_i)``,
so the sum over a row's tokens is the published estimate for the same masks. Departures from the
published code:

* The masks are hashes of ``(mask_seed, row, sample index, position)``, as for the mean-field
  prompt mask, so the old, rollout, current and reference log-probs of an inner iteration score
  the same ``n_mc`` masked inputs (shared masks: the ratio's noise cancels) whatever the batch.
* ``l_j`` is stratified across the samples of a row, ``u_j = frac(u_0 + j/n)``, as the published
  ``linspace`` over a mini-batch; the published code draws one ``k`` per mini-batch of rows.
* ``antithetic=True`` pairs each mask of ``l`` tokens (the first ``l`` of a random order) with the
  mask of the last ``L + 1 - l`` tokens of the same order: both marginals are the published ones
  (so the estimate stays unbiased) and together they score every token, one of them twice.
* ``L`` counts the completion's real tokens (``completion_mask``); positions after them (past EOS,
  and the sampler canvas's padding) are ``[MASK]`` in every sample and never scored, so a row's
  value does not depend on the other completions of its batch.
* Logits are divided by ``temperature``, as in the mean-field estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from jetrl_trainer._hashing import M32 as _M32
from jetrl_trainer._hashing import mix32 as _mix32
from jetrl_trainer._hashing import mix_ints as _mix_int

from .sampler import _resolve_mask_token_id as _mask_id  # one resolution rule for sampler and estimators

__all__ = [
    "LikelihoodEstimator",
    "register_estimator",
    "get_estimator",
    "available_estimators",
    "mean_field_logps",
    "elbo_logps",
    "elbo_masks",
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
    mask_token_id = _mask_id(model, mask_token_id)
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


_ORDER_SALT, _TIME_SALT = 0x0E1B0, 0x7151E  # separate hash streams for the token order and for t


def elbo_masks(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    mask_seed: int | torch.Tensor,
    n_mc: int,
    antithetic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n_mc`` completion masks of :func:`elbo_logps` and their weights ``L / l``.

    Returns ``masked`` ``(n_mc, B, T)`` bool (only real completion tokens, ``l_j`` of the row's ``L``)
    and ``weight`` ``(n_mc, B)`` float32 (0 for an empty completion). With ``antithetic``, samples
    ``2d`` and ``2d + 1`` are a pair over one random order. Deterministic in the mask seed and the
    row's real tokens, like :func:`mask_prompt_tokens`.
    """
    _check_n_mc(n_mc, antithetic)
    B, T = completion_ids.shape
    dev = completion_ids.device
    seed = _hash_seeds(mask_seed, B, dev)  # (B,)
    keys = _mix32(_row_keys(prompt_ids, prompt_mask, completion_ids, completion_mask) ^ seed)  # (B,)
    valid = completion_mask.bool()
    L = valid.sum(dim=1)  # (B,)
    draws = n_mc // 2 if antithetic else n_mc
    u0 = _mix32(keys ^ _TIME_SALT).double() / 2**32  # (B,) uniform in [0, 1)
    pos = torch.arange(T, device=dev)
    masked, weight = [], []
    for d in range(draws):
        u = torch.frac(u0 + d / draws)  # stratified over the row's draws, as the published linspace
        l = torch.minimum((u * L).floor().long() + 1, L.clamp(min=1))  # (B,) in 1..L
        # a random order of the real tokens: unique int64 sort keys, padding last
        bits = _mix32(_mix32(keys ^ _mix_int(_ORDER_SALT, d)) [:, None] ^ pos[None, :])  # (B, T)
        order_key = (bits << 20) + pos[None, :] + ((~valid).long() << 53)
        rank = order_key.argsort(dim=1).argsort(dim=1)  # (B, T): 0 = first in the order
        pairs = [(rank < l[:, None], l)]
        if antithetic:  # the last L + 1 - l tokens of the same order
            pairs.append((rank >= (l - 1)[:, None], L + 1 - l))
        for m, count in pairs:
            masked.append(m & valid)
            weight.append(torch.where(L > 0, L / count.clamp(min=1), 0.0).float())
    return torch.stack(masked), torch.stack(weight)


@register_estimator("elbo")
def elbo_logps(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    mask_seed: int | torch.Tensor,
    mask_token_id: int | None = None,
    temperature: float = 1.0,
    n_mc: int = 8,
    antithetic: bool = False,
) -> torch.Tensor:
    """LLaDA's Monte-Carlo ELBO per token, ``n_mc`` forwards (see the module docstring).

    Returns ``(B, T)`` float32 whose row sums are the published ``-E_t[(1/t) Σ_masked CE]`` for
    the masks of :func:`elbo_masks`; an unbiased estimate of a lower bound on the completion's
    log-likelihood. The prompt is never masked. Gradients flow when called with grad enabled.
    """
    _check_shapes(prompt_ids, prompt_mask, completion_ids, completion_mask)
    mask_token_id = _mask_id(model, mask_token_id)
    masked, weight = elbo_masks(
        prompt_ids, prompt_mask, completion_ids, completion_mask, mask_seed=mask_seed, n_mc=n_mc, antithetic=antithetic
    )
    hidden = ~completion_mask.bool()  # after the completion: [MASK] in every sample, never scored
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_mask)], dim=1)
    T = completion_ids.shape[1]
    total = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    for m, w in zip(masked, weight):
        noisy = completion_ids.masked_fill(m | hidden, mask_token_id)
        logits = model(torch.cat([prompt_ids, noisy], dim=1), attention_mask=attention_mask, logits_to_keep=T).logits
        total = total + torch.where(m, token_logps(logits, completion_ids, temperature) * w[:, None], 0.0)
    return total / n_mc


def _elbo_forward_weights(prompt_ids, prompt_mask, completion_ids, completion_mask, *, mask_seed, n_mc=8,
                          antithetic=False, **_options) -> torch.Tensor:  # fmt: skip
    """``(n_mc, B, T)``: how :func:`elbo_logps` weighs each forward at each position (for entropies)."""
    masked, weight = elbo_masks(
        prompt_ids, prompt_mask, completion_ids, completion_mask, mask_seed=mask_seed, n_mc=n_mc, antithetic=antithetic
    )
    return masked * weight[:, :, None]


elbo_logps.forward_weights = _elbo_forward_weights  # read by DiffusionScorer's entropy


def _check_n_mc(n_mc: int, antithetic: bool) -> None:
    if isinstance(n_mc, bool) or not isinstance(n_mc, int) or n_mc < 1:
        raise ValueError(f"n_mc must be a positive int (Monte-Carlo samples per log-prob); got {n_mc!r}.")
    if antithetic and n_mc % 2:
        raise ValueError(f"antithetic=True uses samples in pairs: n_mc must be even; got n_mc={n_mc}.")


def _check_shapes(prompt_ids, prompt_mask, completion_ids, completion_mask) -> None:
    if prompt_ids.dim() != 2 or completion_ids.dim() != 2 or prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(
            f"prompt_ids {tuple(prompt_ids.shape)} and completion_ids {tuple(completion_ids.shape)} must be "
            "(B, P) and (B, T) with the same B."
        )
    if prompt_mask.shape != prompt_ids.shape or completion_mask.shape != completion_ids.shape:
        raise ValueError("prompt_mask / completion_mask must have the shapes of prompt_ids / completion_ids.")
