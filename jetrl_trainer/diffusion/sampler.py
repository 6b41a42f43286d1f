"""LLaDA sampler: semi-autoregressive blocks with low-confidence remasking.

The pipeline, per block and per step (names follow the house verb grammar)::

    mask_tokens            prompt -> canvas [prompt | MASK * gen_length]
    for each block, for each of steps/num_blocks steps:
      denoise_step         one forward; Gumbel-max proposal x0 and its confidence, current block only
      remask_low_confidence commit the k most confident proposals, keep the rest masked

``k`` per step comes from :func:`get_num_transfer_tokens` (the block's masks split evenly over the
steps, remainder to the first steps), the Gumbel-max sampling runs in float64, and classifier-free
guidance is ``un + (s + 1)(cond - un)`` — all as in LLaDA's published ``generate.py``.

How we depart from the published ``generate``:

* Only the current block's logits are computed and sampled (``logits_to_keep``), instead of the
  whole sequence's. Positions outside the block never receive tokens in the published code either
  (their confidence is ``-inf``), so the committed tokens are the same; the float64 noise is drawn
  for the block only, which also makes a row's samples independent of how much left padding the
  batch needs.
* Tokens are committed only inside the current block. The published code would also fill
  ``[MASK]`` tokens that appear inside the prompt; here they are left as conditioning.
* The ``[MASK]`` logit is set to ``-inf`` before sampling, so no ``[MASK]`` is ever committed and
  the output contains none (the published code could commit a predicted ``[MASK]``).
* Gumbel-max is evaluated in log space, ``l - T·log(-log u)``: the same argmax as the published
  ``exp(l) / (-log u)^T`` without overflowing ``exp`` for large logits.
* Confidences are softmax probabilities in fp32 (the published code uses the logits' dtype, so
  bf16 logits give many exact ties).
* Per-row top-k is vectorised; randomness comes from an optional ``torch.Generator``.
* The attention mask is honoured with classifier-free guidance too (the published code drops it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from jetrl_trainer._choices import REMASKINGS, check_choice

__all__ = [
    "DenoiseStepInfo",
    "generate",
    "mask_tokens",
    "denoise_step",
    "remask_low_confidence",
    "get_num_transfer_tokens",
    "add_gumbel_noise",
]

REMASKING = REMASKINGS  # the one definition lives in jetrl_trainer/_choices.py


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
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass; returns the proposal ``x0`` and its confidence for the block, each ``(B, L_block)``."""
    if cfg_scale > 0:
        un_x = x.clone()
        un_x[:, :prompt_length] = mask_token_id  # unconditional branch: the prompt is fully masked
        mask2 = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
        both = model(torch.cat([x, un_x]), attention_mask=mask2, logits_to_keep=block).logits
        cond, uncond = both.chunk(2, dim=0)
        logits = uncond + (cfg_scale + 1) * (cond - uncond)
    else:
        logits = model(x, attention_mask=attention_mask, logits_to_keep=block).logits  # (B, L_block, V)
    logits = logits.clone()
    logits[..., mask_token_id] = -torch.inf  # never propose [MASK] itself
    x0 = add_gumbel_noise(logits, temperature, generator).argmax(dim=-1)  # (B, L_block)
    if remasking == "low_confidence":
        probs = F.softmax(logits.float(), dim=-1)
        confidence = probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    else:  # "random"
        confidence = torch.rand(x0.shape, generator=generator, device=x0.device, dtype=torch.float32)
    return x0, confidence


def remask_low_confidence(
    x_block: torch.Tensor,
    x0: torch.Tensor,
    confidence: torch.Tensor,
    num_transfer: torch.Tensor,
    mask_token_id: int,
) -> torch.Tensor:
    """Commit, per row, the ``num_transfer[b]`` most confident proposals among still-masked positions.

    Writes into ``x_block`` (a view of the canvas, ``(B, L_block)``) and returns the boolean
    ``(B, L_block)`` mask of positions committed; everything else stays ``[MASK]``.
    """
    still_masked = x_block == mask_token_id
    confidence = torch.where(still_masked, confidence.to(torch.float64), -torch.inf)
    k_max = int(num_transfer.max())
    transferred = torch.zeros_like(still_masked)
    if k_max == 0:
        return transferred
    top = confidence.topk(k_max, dim=-1).indices  # (B, k_max), most confident first
    keep = torch.arange(k_max, device=x0.device)[None, :] < num_transfer[:, None]
    transferred.scatter_(1, top, keep)
    x_block[transferred] = x0[transferred].to(x_block.dtype)
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
        generator: RNG for the Gumbel noise and random remasking, on ``prompt_ids``' device.
        progress: show a tqdm bar over the steps.
        on_step: called after every step with a :class:`DenoiseStepInfo` (for tests / tracing).

    The model runs in whatever precision phase is active, so call it inside
    ``precision_phase("rollout")`` for quantized rollouts.
    """
    mask_token_id = _resolve_mask_token_id(model, mask_token_id)
    steps_per_block = _validate(
        prompt_ids, attention_mask, steps, gen_length, block_length, temperature, cfg_scale, remasking
    )
    prompt_length = prompt_ids.shape[1]
    x = mask_tokens(prompt_ids, gen_length, mask_token_id)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(x.shape[0], gen_length)], dim=1)
    bar = tqdm(total=steps, desc="LLaDA denoising", disable=not progress, leave=False)
    for b in range(gen_length // block_length):
        block = slice(prompt_length + b * block_length, prompt_length + (b + 1) * block_length)
        num_transfer = get_num_transfer_tokens(x[:, block] == mask_token_id, steps_per_block)
        for i in range(steps_per_block):
            x0, confidence = denoise_step(
                model,
                x,
                attention_mask,
                block,
                prompt_length=prompt_length,
                mask_token_id=mask_token_id,
                temperature=temperature,
                cfg_scale=cfg_scale,
                remasking=remasking,
                generator=generator,
            )
            transferred = remask_low_confidence(x[:, block], x0, confidence, num_transfer[:, i], mask_token_id)
            if on_step is not None:
                full = torch.zeros_like(x, dtype=torch.bool)
                full[:, block] = transferred
                on_step(DenoiseStepInfo(block=b, step=i, x=x, transferred=full))
            bar.update(1)
    bar.close()
    return x


def _resolve_mask_token_id(model: nn.Module, mask_token_id: int | None) -> int:
    if mask_token_id is None:
        mask_token_id = getattr(getattr(model, "config", None), "mask_token_id", None)
    if mask_token_id is None:
        raise ValueError("mask_token_id is required: pass it, or use a model whose config has mask_token_id.")
    return int(mask_token_id)


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
