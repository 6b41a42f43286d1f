"""Diffusion rollout speed: the LLaDA sampler in the BF16 and the FP8 rollout phase, one run.

One process, one model: an LLaDA-8B-shaped random model (32 layers, d 4096, MLP 12288, vocab 126464,
BF16 master weights) converted with ``quantize_model(train="bf16", rollout="fp8")``, so the "train"
phase is BF16 and the "rollout" phase FP8 on the very same Parameters (the colocated setup: BF16
master + FP8 weight cache). ``generate`` as the trainer calls it: prompts of 128 tokens, gen 256,
block 32, 64 steps, temperature 1.0 (GRPO samples), no EOS handling (a random model).

Variants, in the order issue 12 asks for them (each includes the previous):

* ``eager``: the denoise step run eagerly, LLaDA's SwiGLU unfused (the RMSNorm + FP8 quant fusion
  of ``quantize_model`` is on, as before); the top-k transfer is already sync-free.
* ``fused_swiglu``: LLaDA's SwiGLU and ``ff_out``'s FP8 quantization in one kernel (the default).
* ``prefix_cache`` (approximate, opt-in): ``fused_swiglu`` plus Fast-dLLM's block-wise prefix cache.

The denoise step is not timed as a CUDA graph: it measured no faster (docs/llada.md, "Speed").

Also reported: the GEMM time of one denoise step (the 7 projections x layers at the step's M,
BF16 ``F.linear`` against the FP8 ``QuantLinear`` with its activation quant), which bounds the
FP8/BF16 ratio a full step can reach, and the memory held by weights and at the peak.

Confidence-threshold decoding (the other approximate mode) is not timed on the random 8B model: its
number of forwards depends on how confident the model is, and a random model is never confident.
``--tiny-task`` (CPU) measures both approximate modes where that is visible: a tiny LLaDA warm-started
on countdown (as ``examples/train_llada.py``), 256 prompts, forwards per rollout, time and mean reward
against the exact sampler.

Usage: ``python benchmarks/bench_diffusion_rollout.py [--layers 32] [--batches 16,64] [--all-variants 16]
[--out result.json]`` or ``... --tiny-task``. Prints one JSON object; ``--out`` also rewrites it after
every measurement.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _common import bench_ms, environment

from jetrl_trainer.diffusion import LLaDAConfig, LLaDAModelLM, generate
from jetrl_trainer.quant import PrecisionPhases, QuantLinear, quantize_model

VARIANTS = ("eager", "fused_swiglu", "prefix_cache")
PRECISIONS = {"bf16": "train", "fp8": "rollout"}  # label -> precision phase of quantize_model(train=bf16, rollout=fp8)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")


def build_model(layers: int) -> LLaDAModelLM:
    config = LLaDAConfig(n_layers=layers, init_device=None)  # LLaDA-8B's config.json otherwise
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LLaDAModelLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return quantize_model(model, train="bf16", rollout="fp8").eval()


def set_variant(model: LLaDAModelLM, variant: str) -> dict:
    for block in model.model.transformer.blocks:
        block.swiglu.fused = variant != "eager"
    return dict(prefix_cache=variant == "prefix_cache")


def prompts(batch: int, length: int, mask_token_id: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, mask_token_id, (batch, length), device="cuda", generator=g)  # no [MASK] in prompts


def time_generate(model, ids, phase: str, sampling: dict, options: dict) -> tuple[float, float]:
    """Seconds of one ``generate`` and its peak GiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with PrecisionPhases(model).use(phase):
        out = generate(model, ids, None, **sampling, **options)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert out.shape == (ids.shape[0], ids.shape[1] + sampling["gen_length"])
    return seconds, torch.cuda.max_memory_allocated() / 2**30


def gemm_ms_per_step(model, tokens: int) -> dict:
    """The 7 projections of every block at M = tokens: BF16 F.linear vs the FP8 QuantLinear."""
    block = model.model.transformer.blocks[0]
    layers = len(model.model.transformer.blocks)
    result = {}
    for label, phase in PRECISIONS.items():
        total = 0.0
        for name in PROJECTIONS:
            linear = getattr(block, name)
            x = torch.randn(tokens, linear.in_features, device="cuda", dtype=torch.bfloat16)
            with PrecisionPhases(linear).use(phase), torch.no_grad():
                total += bench_ms(lambda: linear(x))
        result[label] = round(total * layers, 2)
    result["fp8_speedup"] = round(result["bf16"] / result["fp8"], 3)
    return result


def weight_memory(model) -> dict:
    master = sum(p.numel() * p.element_size() for p in model.parameters())
    fp8 = sum(m.weight.numel() + -(-m.weight.shape[0] // 128) * -(-m.weight.shape[1] // 128) * 4
              for m in model.modules() if isinstance(m, QuantLinear))  # fmt: skip
    return dict(bf16_master_gib=round(master / 2**30, 2), fp8_cache_gib=round(fp8 / 2**30, 2))


def tiny_task(out: str | None) -> dict:
    """Approximate modes against the exact sampler on the tiny countdown model (CPU, offline)."""
    from jetrl_trainer.diffusion import build_tiny_llada, diffusion_warm_start
    from jetrl_trainer.tasks import get_task
    from jetrl_trainer.tiny import END_OF_TURN, build_tiny_tokenizer

    torch.set_num_threads(1)
    task, tok = get_task("countdown"), build_tiny_tokenizer()
    model = build_tiny_llada(vocab_size=len(tok), mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.convert_tokens_to_ids(END_OF_TURN))  # fmt: skip
    gen = 16  # examples/train_llada.py's tiny preset
    diffusion_warm_start(model, tok, task, steps=500, gen_length=gen, seed=0, progress=False)
    data = task.make_dataset(256, seed=123, prompt_style="short")
    enc = tok.apply_chat_template(list(data["prompt"]), add_generation_prompt=True, tokenize=True, return_dict=True)
    batch = tok.pad({"input_ids": enc["input_ids"]}, return_tensors="pt")
    modes = {"exact": {}, "threshold_0.9": dict(threshold=0.9), "threshold_0.7": dict(threshold=0.7),
             "prefix_cache": dict(prefix_cache=True)}  # fmt: skip
    report = dict(env=environment(), config=dict(task="countdown", prompts=256, gen_length=gen, warm_start_steps=500),
                  runs=[])  # fmt: skip
    for block, steps in ((16, 8), (8, 8)):
        for temperature in (0.0, 1.0):
            for name, extra in modes.items():
                forwards = []
                start = time.perf_counter()
                out_ids = generate(model, batch["input_ids"], batch["attention_mask"], steps=steps, gen_length=gen,
                                   block_length=block, temperature=temperature, generator=torch.Generator().manual_seed(0),
                                   on_step=lambda info: forwards.append(1), **extra)  # fmt: skip
                seconds = time.perf_counter() - start
                texts = tok.batch_decode(out_ids[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
                rewards = task.reward_fn(list(data["prompt"]), texts, **{k: list(data[k]) for k in data.column_names
                                                                          if k != "prompt"})  # fmt: skip
                report["runs"].append(dict(block_length=block, steps=steps, temperature=temperature, mode=name,
                                           forwards=len(forwards), seconds=round(seconds, 2),
                                           mean_reward=round(sum(rewards) / len(rewards), 4)))  # fmt: skip
                print(json.dumps(report["runs"][-1]), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--all-variants", default="16", help="batches that run every variant (others: fused_swiglu only)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny-task", action="store_true", help="CPU: the approximate modes on tiny countdown")
    args = parser.parse_args()
    if args.tiny_task:
        print(json.dumps(tiny_task(args.out), indent=1))
        return

    sampling = dict(steps=args.steps, gen_length=args.gen, block_length=args.block, temperature=args.temperature)
    warm = dict(sampling, steps=args.gen // args.block)  # same shapes, one step per block
    model = build_model(args.layers)
    report = dict(env=environment(), config=dict(vars(args), model="LLaDA-8B-shaped random", sampling=sampling),
                  runs=[], memory=weight_memory(model))  # fmt: skip

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    full = {int(b) for b in args.all_variants.split(",") if b}
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = prompts(batch, args.prompt, model.config.mask_token_id)
        for label, phase in PRECISIONS.items():
            for variant in ("eager", "fused_swiglu"):  # compile kernels, fill the FP8 weight cache
                try:
                    time_generate(model, ids, phase, warm, set_variant(model, variant))
                except Exception as err:  # noqa: BLE001  (reported; the other variants still run)
                    report.setdefault("errors", []).append(f"warm-up {label} {variant}: {err!r}"[:2000])
            for variant in VARIANTS if batch in full else ("fused_swiglu",):
                try:
                    seconds, peak = time_generate(model, ids, phase, sampling, set_variant(model, variant))
                except Exception as err:  # noqa: BLE001
                    report.setdefault("errors", []).append(f"{batch} {label} {variant}: {err!r}"[:2000])
                    print(report["errors"][-1], flush=True)
                    continue
                report["runs"].append(dict(
                    batch=batch, precision=label, variant=variant, seconds=round(seconds, 2),
                    tok_s=round(batch * args.gen / seconds, 1), ms_per_step=round(1000 * seconds / args.steps, 1),
                    peak_gib=round(peak, 2),
                ))  # fmt: skip
                print(json.dumps(report["runs"][-1]), flush=True)
                save()
        runs = {(r["precision"], r["variant"]): r["seconds"] for r in report["runs"] if r["batch"] == batch}
        report.setdefault("fp8_over_bf16", {})[batch] = {
            v: round(runs[("bf16", v)] / runs[("fp8", v)], 3) for v in VARIANTS if ("fp8", v) in runs
        }
        report.setdefault("gemm_ms_per_step", {})[batch] = gemm_ms_per_step(model, batch * (args.prompt + args.gen))
        save()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
