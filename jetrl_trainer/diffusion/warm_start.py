"""LLaDA's SFT objective on a task's reference answers: the masked-diffusion warm start.

GRPO learns nothing from groups whose rewards are all equal, as they are for an untrained model, so
a tiny LLaDA is first fine-tuned on the answers. Each completion token is masked with probability
t ~ U(0.05, 1) per row, and the cross-entropy on the masked tokens is weighted by 1/t (LLaDA's
SFT loss). The target is the sampler's whole canvas: answer, end of turn, then EOS up to
``gen_length``, so the model learns to fill the rest of the canvas with EOS, as LLaDA-Instruct does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["diffusion_warm_start"]


def diffusion_warm_start(
    model,
    tokenizer,
    task,
    *,
    steps: int,
    gen_length: int,
    seed: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    dataset: Any = None,
    progress: bool = True,
) -> float:
    """Fine-tune ``model`` in place on ``task``'s reference answers; returns the last loss.

    ``dataset`` holds the problems (default: 512 rows of ``task.make_dataset(512, seed=seed + 7)``);
    prompts are rendered with the chat template exactly as GRPO renders them.
    """
    from tqdm.auto import tqdm

    data = task.make_dataset(512, seed=seed + 7) if dataset is None else dataset
    prompts = tokenizer.apply_chat_template(list(data["prompt"]), add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]  # fmt: skip
    stop, eos = model.config.eos_token_id, tokenizer.eos_token_id
    answers = [tokenizer(task.reference_answer(row), add_special_tokens=False)["input_ids"][: gen_length - 1]
               for row in data]  # fmt: skip
    canvases = torch.tensor([a + [stop] + [eos] * (gen_length - 1 - len(a)) for a in answers])  # (N, gen_length)
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for _ in tqdm(range(steps), desc="masked-diffusion warm start", disable=not progress):
        pick = torch.randint(len(answers), (batch_size,), generator=g)
        batch = tokenizer.pad({"input_ids": [prompts[i] for i in pick]}, return_tensors="pt")  # left padding
        target = canvases[pick]
        t = torch.rand(batch_size, 1, generator=g).clamp(min=0.05)  # masking rate per row
        masked = torch.rand(target.shape, generator=g) < t
        noisy = target.masked_fill(masked, model.config.mask_token_id)
        ids = torch.cat([batch["input_ids"], noisy], dim=1)
        attn = torch.cat([batch["attention_mask"], torch.ones_like(noisy)], dim=1)
        logits = model(ids, attention_mask=attn, logits_to_keep=gen_length).logits.float()
        ce = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # (B, gen_length)
        loss = ((ce * masked / t).sum(1) / gen_length).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()
