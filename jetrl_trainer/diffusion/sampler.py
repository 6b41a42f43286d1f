"""LLaDA sampler: semi-autoregressive blocks with low-confidence remasking.

The pipeline, per block and per step (names follow the house verb grammar)::

    mask_tokens            prompt -> canvas [prompt | MASK * gen_length]
    for each block, for each of steps/num_blocks steps:
      denoise_step         one forward; Gumbel-max proposal x0 and its confidence, current block only
      remask_low_confidence commit the k most confident proposals, keep the rest masked

``k`` per step comes from :func:`get_num_transfer_tokens` (the block's masks split evenly over the
steps, remainder to the first steps), the Gumbel-max sampling runs in float64, classifier-free
guidance is ``un + (s + 1)(cond - un)`` with the attention mask passed to both halves, and the
confidence is the softmax probability of the proposal under the model's logits, ``[MASK]``
included -- all as in LLaDA's published ``generate.py`` (read in its late-2025 revision), as are
the options ``logits_eos_inf`` and ``confidence_eos_eot_inf`` (LLaDA appendix B.4).

How we depart from the published ``generate``:

* Only the current block's logits are computed and sampled (``logits_to_keep``), instead of the
  whole sequence's. Positions outside the block never receive tokens in the published code either
  (their confidence is ``-inf``), so the committed tokens are the same; the float64 noise is drawn
  for the block only, which also makes a row's samples independent of how much left padding the
  batch needs. At temperature > 0 the noise stream is therefore consumed differently from the
  published code: the same distribution, not the same draws.
* Tokens are committed only inside the current block. The published code would also fill
  ``[MASK]`` tokens that appear inside the prompt; here they are left as conditioning.
* The ``[MASK]`` logit is set to ``-inf`` for *sampling* the proposal only, so no ``[MASK]`` is ever
  committed and the output contains none (the published code could commit a predicted ``[MASK]``).
  The confidence is still read from the unmodified distribution, as published, so the order of
  commits is the published one whenever the proposal is not ``[MASK]``.
* ``confidence_eos_eot_inf`` removes both EOS and EoT from the confidence distribution at every
  temperature. The published line ``logits_with_noise[..., EOS] = logits[..., EOT] = -inf`` does
  that only at temperature 0, where ``logits_with_noise`` *is* ``logits``; above 0 it writes EOS
  into the noisy copy, after the proposal was taken, which changes nothing.
* EOS / EoT ids come from the model's config / the arguments, not the 8B tokenizer's constants.
* Gumbel-max is evaluated in log space, ``l - T·log(-log u)``: the same argmax as the published
  ``exp(l) / (-log u)^T`` without overflowing ``exp`` for large logits.
* Confidences are softmax probabilities in fp32 (the published code uses the logits' dtype, so
  bf16 logits give many exact ties).
* Per-row top-k is vectorised, breaks ties by position (a stable sort; the published ``topk``
  leaves the order of equal confidences unspecified), and needs no host synchronisation (the number of tokens per step is
  known on the host: a block is all ``[MASK]`` when it starts); randomness comes from an optional
  ``torch.Generator``. The denoise step runs eagerly: captured as a CUDA graph it measured no
  faster for LLaDA-8B shapes, whose steps hide their launch overhead (docs/llada.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from jetrl_trainer._choices import REMASKINGS, check_choice

from .modeling_llada import LLaDAPrefixCache

__all__ = [
    "DenoiseStepInfo",
    "LLADA_EOT_TOKEN_ID",
    "generate",
    "mask_tokens",
    "denoise_step",
    "propose_tokens",
    "remask_low_confidence",
    "remask_below_threshold",
    "get_num_transfer_tokens",
    "add_gumbel_noise",
]

REMASKING = REMASKINGS  # the one definition lives in jetrl_trainer/_choices.py
LLADA_EOT_TOKEN_ID = 126348  # <|eot_id|> of the LLaDA-8B tokenizer (the published code's constant)


@dataclass(frozen=True)
class DenoiseStepInfo:
    """What one denoising step did; passed to ``generate(..., on_step=...)``.

    ``x`` is the live canvas after the step (``(B, P + gen_length)``; do not modify it) and
    ``transferred`` marks, in canvas coordinates, the positions unmasked by this step.
    """

    block: int
    step: int
    x: torch.Tensor
    transferred: torch.Tensor


def get_num_transfer_tokens(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to unmask at each step, ``(B, steps)`` int64: an even split, remainder to the first steps.

    LLaDA's linear noise schedule makes the expected number of tokens revealed per step constant.
    """
    mask_num = block_mask.sum(dim=1, keepdim=True)  # (B, 1)
    base, remainder = mask_num // steps, mask_num % steps
    step_idx = torch.arange(steps, device=block_mask.device)
    return (base + (step_idx[None, :] < remainder).long()).long()


def _transfer_schedule(block_length: int, steps: int) -> list[int]:
    """:func:`get_num_transfer_tokens` of an all-``[MASK]`` block, on the host (no device sync)."""
    base, remainder = divmod(block_length, steps)
    return [base + (i < remainder) for i in range(steps)]


def add_gumbel_noise(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Scores whose argmax samples ``softmax(logits / temperature)``; identity at ``temperature == 0``.

    Computed in float64: low-precision Gumbel noise is known to hurt masked-diffusion generation
    quality (arXiv:2409.02908), which is why LLaDA samples in float64.
    """
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
    # log of the published exp(l) / (-log u)^T
    return logits - temperature * torch.log(-torch.log(noise))


def mask_tokens(prompt_ids: torch.Tensor, gen_length: int, mask_token_id: int) -> torch.Tensor:
    """The initial canvas: the prompt followed by ``gen_length`` ``[MASK]`` tokens, ``(B, P + gen_length)``."""
    masks = prompt_ids.new_full((prompt_ids.shape[0], gen_length), mask_token_id)
    return torch.cat([prompt_ids, masks], dim=1)


def propose_tokens(
    logits: torch.Tensor,
    *,
    mask_token_id: int,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    eos_token_id: int | None = None,
    eot_token_id: int | None = None,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposal ``x0`` and its confidence from block logits ``(B, L_block, V)``; each ``(B, L_block)``.

    ``logits_eos_inf`` removes EOS from both the proposal and the confidence distribution (as
    published); ``confidence_eos_eot_inf`` removes EOS and EoT from the confidence only, so a
    proposed EOS/EoT gets confidence 0 and is committed after every other proposal.
    """
    if logits_eos_inf:
        logits = logits.clone()
        logits[..., eos_token_id] = -torch.inf
    sampling = logits.clone()
    sampling[..., mask_token_id] = -torch.inf  # never propose [MASK] itself
    x0 = add_gumbel_noise(sampling, temperature, generator).argmax(dim=-1)  # (B, L_block)
    if remasking == "random":
        confidence = torch.rand(x0.shape, generator=generator, device=x0.device, dtype=torch.float32)
        return x0, confidence
    # The published confidence: p(x0) under the model's distribution with [MASK] still in it.
    scores = logits.float()
    if confidence_eos_eot_inf:
        scores = scores.clone() if scores is logits else scores
        scores[..., eos_token_id] = -torch.inf  # two scalar writes: an index list would be a host-to-device copy
        scores[..., eot_token_id] = -torch.inf
    confidence = F.softmax(scores, dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    return x0, confidence


def denoise_step(
    model: nn.Module,
    x: torch.Tensor,
    attention_mask: torch.Tensor | None,
    block: slice,
    *,
    prompt_length: int,
    mask_token_id: int,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    eos_token_id: int | None = None,
    eot_token_id: int | None = None,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    generator: torch.Generator | None = None,
    prefix_cache: LLaDAPrefixCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass; returns the proposal ``x0`` and its confidence for the block, each ``(B, L_block)``.

    ``block`` is the slice of canvas positions to propose for. ``prefix_cache`` (approximate, see
    :class:`LLaDAPrefixCache`) is passed to the model.
    """
    cache = {} if prefix_cache is None else dict(prefix_cache=prefix_cache)  # plain models need not take it
    if cfg_scale > 0:
        un_x = x.clone()
        un_x[:, :prompt_length] = mask_token_id  # unconditional branch: the prompt is fully masked
        mask2 = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
        both = model(torch.cat([x, un_x]), attention_mask=mask2, logits_to_keep=block, **cache).logits
        cond, uncond = both.chunk(2, dim=0)
        logits = uncond + (cfg_scale + 1) * (cond - uncond)
    else:
        logits = model(x, attention_mask=attention_mask, logits_to_keep=block, **cache).logits  # (B, L_block, V)
    return propose_tokens(
        logits, mask_token_id=mask_token_id, temperature=temperature, remasking=remasking,
        eos_token_id=eos_token_id, eot_token_id=eot_token_id, logits_eos_inf=logits_eos_inf,
        confidence_eos_eot_inf=confidence_eos_eot_inf, generator=generator,
    )  # fmt: skip


def remask_low_confidence(
    x_block: torch.Tensor,
    x0: torch.Tensor,
    confidence: torch.Tensor,
    num_transfer: torch.Tensor,
    mask_token_id: int,
    *,
    k_max: int | None = None,
) -> torch.Tensor:
    """Commit, per row, the ``num_transfer[b]`` most confident proposals among still-masked positions.

    Writes into ``x_block`` (a view of the canvas, ``(B, L_block)``) and returns the boolean
    ``(B, L_block)`` mask of positions committed; everything else stays ``[MASK]``. ``k_max``
    (``>= num_transfer.max()``, known on the host) avoids reading ``num_transfer`` back from the device.
    """
    still_masked = x_block == mask_token_id
    confidence = torch.where(still_masked, confidence.to(torch.float64), -torch.inf)
    if k_max is None:
        k_max = int(num_transfer.max())
    transferred = torch.zeros_like(still_masked)
    if k_max == 0:
        return transferred
    # (B, k_max), most confident first; a stable sort breaks ties by position on every device (topk's
    # tie order is unspecified and differs between CPU and CUDA)
    top = confidence.sort(dim=-1, descending=True, stable=True).indices[:, :k_max]
    keep = torch.arange(k_max, device=x0.device)[None, :] < num_transfer[:, None]
    transferred.scatter_(1, top, keep)
    x_block.copy_(torch.where(transferred, x0.to(x_block.dtype), x_block))  # no boolean indexing: no sync
    return transferred


def remask_below_threshold(
    x_block: torch.Tensor, x0: torch.Tensor, confidence: torch.Tensor, threshold: float, mask_token_id: int
) -> torch.Tensor:
    """Commit every still-masked proposal with confidence >= ``threshold``, and at least the most
    confident one per row that has a ``[MASK]`` left (Fast-dLLM's parallel decoding). Returns the
    ``(B, L_block)`` mask of positions committed; writes into ``x_block``."""
    still_masked = x_block == mask_token_id
    confidence = torch.where(still_masked, confidence.to(torch.float64), -torch.inf)
    transferred = still_masked & (confidence >= threshold)
    best = confidence.argmax(dim=-1, keepdim=True)  # (B, 1)
    transferred.scatter_(1, best, transferred.gather(1, best) | still_masked.gather(1, best))
    x_block.copy_(torch.where(transferred, x0.to(x_block.dtype), x_block))
    return transferred


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    steps: int,
    gen_length: int,
    block_length: int,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    mask_token_id: int | None = None,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    eos_token_id: int | None = None,
    eot_token_id: int | None = None,
    threshold: float | None = None,
    prefix_cache: bool = False,
    generator: torch.Generator | None = None,
    progress: bool = False,
    on_step: Callable[[DenoiseStepInfo], None] | None = None,
) -> torch.Tensor:
    """Sample completions; returns the full ``(B, P + gen_length)`` sequence (prompt included).

    Args:
        prompt_ids: ``(B, P)`` token ids, left-padded when prompts differ in length.
        attention_mask: ``(B, P)``, 1 for real tokens, 0 for padding; the generated part is attended.
        steps: total denoising steps, a multiple of the number of blocks.
        gen_length: tokens to generate, a multiple of ``block_length``.
        block_length: tokens per semi-autoregressive block (``gen_length`` for a single block).
        temperature: Gumbel-max temperature; 0 is greedy and deterministic.
        cfg_scale: unsupervised classifier-free guidance scale (0 disables it; costs 2x forwards).
        remasking: ``"low_confidence"`` or ``"random"`` choice of which proposals to keep.
        mask_token_id: ``[MASK]`` id; defaults to ``model.config.mask_token_id``.
        logits_eos_inf: never propose EOS (LLaDA appendix B.4; the published option of that name).
        confidence_eos_eot_inf: give proposed EOS / EoT tokens confidence 0, so they are committed
            last (the published option of that name).
        eos_token_id: EOS id for the two options; defaults to ``model.config.eos_token_id``.
        eot_token_id: EoT id for ``confidence_eos_eot_inf``; defaults to ``model.config.eot_token_id``
            when set, else LLaDA-8B's ``<|eot_id|>`` (126348).
        threshold: *approximate, off by default* (Fast-dLLM): commit every proposal whose confidence
            reaches it (at least one per step) and move on when the block is full, instead of the
            fixed ``steps / num_blocks`` schedule; costs one device-to-host read per step.
        prefix_cache: *approximate, off by default* (Fast-dLLM's prefix cache): the first step of a
            block runs the whole sequence and stores the keys/values of the prompt and the committed
            blocks; the block's other steps recompute only the current and later positions.
        generator: RNG for the Gumbel noise and random remasking, on ``prompt_ids``' device.
        progress: show a tqdm bar over the steps.
        on_step: called after every step with a :class:`DenoiseStepInfo` (for tests / tracing).

    The model runs in its own precision phase, so call it inside
    ``PrecisionPhases(model).rollout()`` (``jetrl_trainer.quant``) for quantized rollouts.
    """
    mask_token_id = _resolve_mask_token_id(model, mask_token_id)
    steps_per_block = _validate(
        prompt_ids, attention_mask, steps, gen_length, block_length, temperature, cfg_scale, remasking
    )
    _validate_approximate(threshold, remasking)
    eos_token_id, eot_token_id = _resolve_eos_eot(model, logits_eos_inf, confidence_eos_eot_inf, eos_token_id, eot_token_id)
    prompt_length = prompt_ids.shape[1]
    x = mask_tokens(prompt_ids, gen_length, mask_token_id)
    # Padding is decided once, on the host: the model's no-padding shortcut would read the mask back every step.
    if attention_mask is not None and bool(attention_mask.bool().all()):
        attention_mask = None
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(x.shape[0], gen_length)], dim=1)
    options = dict(
        prompt_length=prompt_length, mask_token_id=mask_token_id, temperature=temperature, cfg_scale=cfg_scale,
        remasking=remasking, eos_token_id=eos_token_id, eot_token_id=eot_token_id, logits_eos_inf=logits_eos_inf,
        confidence_eos_eot_inf=confidence_eos_eot_inf,
    )  # fmt: skip
    step = functools.partial(denoise_step, model, x, attention_mask, generator=generator, **options)
    _denoise_blocks(step, x, prompt_length, gen_length, block_length, steps, steps_per_block, threshold,
                    mask_token_id, prefix_cache, progress, on_step)  # fmt: skip
    return x


def _denoise_blocks(step, x, prompt_length, gen_length, block_length, steps, steps_per_block, threshold,
                    mask_token_id, prefix_cache, progress, on_step) -> None:  # fmt: skip
    """The block / step loop of :func:`generate` (writes into the canvas ``x``).

    ``step(block, prefix_cache=...)`` is :func:`denoise_step` on the canvas. With the prefix cache, a
    block's first step runs the whole canvas and fills a fresh cache; its later steps reuse it.
    """
    schedule = _transfer_schedule(block_length, steps_per_block)
    bar = tqdm(total=steps, desc="LLaDA denoising", disable=not progress, leave=False)
    for b in range(gen_length // block_length):
        block = slice(prompt_length + b * block_length, prompt_length + (b + 1) * block_length)
        num_transfer = get_num_transfer_tokens(x[:, block] == mask_token_id, steps_per_block)
        cache = LLaDAPrefixCache(block.start) if prefix_cache else None
        i, done = 0, False
        while not done:
            x0, confidence = step(block, prefix_cache=cache)
            if threshold is None:
                transferred = remask_low_confidence(
                    x[:, block], x0, confidence, num_transfer[:, i], mask_token_id, k_max=schedule[i]
                )
                done = i + 1 == steps_per_block
            else:
                transferred = remask_below_threshold(x[:, block], x0, confidence, threshold, mask_token_id)
                done = not bool((x[:, block] == mask_token_id).any())  # the one sync of this mode
            if on_step is not None:
                full = torch.zeros_like(x, dtype=torch.bool)
                full[:, block] = transferred
                on_step(DenoiseStepInfo(block=b, step=i, x=x, transferred=full))
            bar.update(1)
            i += 1
    bar.close()


def _validate_approximate(threshold: float | None, remasking: str) -> None:
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ValueError(f"threshold must be a confidence in (0, 1] (Fast-dLLM uses 0.9), or None; got {threshold!r}.")
    if remasking != "low_confidence":
        raise ValueError("threshold compares confidences: use remasking='low_confidence' with it, or threshold=None.")


def _resolve_mask_token_id(model: nn.Module, mask_token_id: int | None) -> int:
    if mask_token_id is None:
        mask_token_id = getattr(getattr(model, "config", None), "mask_token_id", None)
    if mask_token_id is None:
        raise ValueError("mask_token_id is required: pass it, or use a model whose config has mask_token_id.")
    return int(mask_token_id)


def _resolve_eos_eot(
    model: nn.Module, logits_eos_inf: bool, confidence_eos_eot_inf: bool, eos: int | None, eot: int | None
) -> tuple[int | None, int | None]:
    """EOS / EoT ids for the two published options (None when neither option is on)."""
    if not (logits_eos_inf or confidence_eos_eot_inf):
        return eos, eot
    config = getattr(model, "config", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if eos is None:
        raise ValueError("logits_eos_inf / confidence_eos_eot_inf need an EOS id: pass eos_token_id=.")
    if confidence_eos_eot_inf and eot is None:
        eot = getattr(config, "eot_token_id", None)
        eot = LLADA_EOT_TOKEN_ID if eot is None else eot
    vocab = getattr(config, "embedding_size", None) or getattr(config, "vocab_size", None)
    for name, token in (("eos_token_id", eos), ("eot_token_id", eot)):
        if token is not None and vocab is not None and not 0 <= int(token) < vocab:
            raise ValueError(f"{name}={token} is outside the model's vocabulary of {vocab}; pass {name}= for your "
                             "tokenizer (LLaDA-8B: EOS 126081, EoT 126348).")
    return int(eos), None if eot is None else int(eot)


def _validate(
    prompt_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    steps: int,
    gen_length: int,
    block_length: int,
    temperature: float,
    cfg_scale: float,
    remasking: str,
) -> int:
    """Check the arguments; returns the number of steps per block."""
    if prompt_ids.dim() != 2 or prompt_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"prompt_ids must be a (B, P) integer tensor, got {tuple(prompt_ids.shape)} {prompt_ids.dtype}."
        )
    if attention_mask is not None and attention_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal prompt_ids shape {tuple(prompt_ids.shape)}."
        )
    for name, value in (("steps", steps), ("gen_length", gen_length), ("block_length", block_length)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if gen_length % block_length != 0:
        raise ValueError(
            f"gen_length={gen_length} must be a multiple of block_length={block_length}; "
            f"e.g. block_length={gen_length} (one block) or a divisor of gen_length."
        )
    num_blocks = gen_length // block_length
    if steps % num_blocks != 0:
        raise ValueError(
            f"steps={steps} must be a multiple of the number of blocks gen_length/block_length={num_blocks}, "
            f"so that each block gets the same number of steps; e.g. steps={num_blocks * max(1, steps // num_blocks)}."
        )
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if cfg_scale < 0:
        raise ValueError(f"cfg_scale must be >= 0 (0 disables guidance), got {cfg_scale}.")
    check_choice("remasking", remasking, REMASKINGS)
    return steps // num_blocks
