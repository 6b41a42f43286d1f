"""Do the exact attention kernel's bits depend on its query block (``ExactAttentionSettings.block_m``)?

Both phases launch one settings object because a row's bits could depend on how the kernel groups its
products, and the grouping follows the block: below 64 rows the kernel runs mma.sync, at 64 Hopper's
wgmma. Session 35 measured that 64 makes the training forward 1.8-2.6x faster and the decode 6-46%
slower (docs/performance.md). Were the two instructions to give the same bits, the decode could keep its
small block while the training forward took 64. This probe asks that on the GPU, for the three ways keys
and values reach the kernel: BF16 values, FP8 codes with scales (the decode over the FP8 cache) and those
codes dequantized to BF16 beforehand (the training forward's shortcut on wgmma):

* ``whole``: every real query of a left-padded causal batch at each block, compared with the first block
  (millions of outputs: the comparison that can see a rare difference);
* ``decode vs whole``: single queries over their live keys (a decode step) at three positions, at each
  block, compared with the same queries inside the whole sequence at the largest block (the training
  forward's); tens of thousands of outputs, too few to see a rate of a few in a million.

It prints, per comparison, whether the outputs are equal bit for bit and the share of elements that
differ. Session 36's answer on an H100 is in docs/performance.md. Usage:
``python benchmarks/probe_exact_attention_blocks.py [--blocks 16,64] [--positions 600]`` (a CUDA GPU: Triton's
interpreter has no tensor cores, and outside the test suite's patch it cannot run this kernel's loops).
"""

from __future__ import annotations

import argparse

import torch
from _common import dump, environment

from jetrl_trainer.kernels.settings import ExactAttentionSettings
from jetrl_trainer.kernels.triton_exact_attention import exact_attention
from jetrl_trainer.rollout.engine.kv_cache import fp8_kv_encode, fp8_kv_roundtrip


def _same(got: torch.Tensor, want: torch.Tensor) -> dict:
    return {"equal": torch.equal(got, want), "differing_share": round((got != want).float().mean().item(), 6)}


def probe(blocks: list[int], positions: int, device: str, heads: int = 32, heads_kv: int = 8, d: int = 128,
          dot: str = "bf16", split: int = 2048) -> dict:  # fmt: skip
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, n, positions, d, generator=gen).to(device, torch.bfloat16) for n in (heads, heads_kv, heads_kv))
    k, v = k * 3, v * 3
    (k_q, k_s), (v_q, v_s) = fp8_kv_encode(k), fp8_kv_encode(v)
    forms = {
        "bf16": (k, v, {}),
        "fp8_codes": (k_q, v_q, dict(k_scale=k_s, v_scale=v_s)),
        # code x scale in FP32, rounded to BF16: what tensor-core products would read if decoded beforehand
        "fp8_values_bf16": (fp8_kv_roundtrip(k).to(torch.bfloat16), fp8_kv_roundtrip(v).to(torch.bfloat16), {}),
    }
    pads = [0, positions // 8]
    first = torch.tensor(pads, device=device)
    last = torch.arange(positions, device=device)[None].expand(2, positions).clone()
    last[torch.arange(positions, device=device)[None] < first[:, None]] = -1
    real = (last >= 0)[:, None, :].expand(2, heads, positions)  # padding queries read no key: not compared
    scale = d**-0.5
    picks = [pads[1], positions // 2, positions - 1]
    small, large = min(blocks), max(blocks)

    def at(block: int) -> ExactAttentionSettings:
        return ExactAttentionSettings(dot=dot, block_m=block, split_keys=split)

    def whole_sequence(keys, values, scales, block: int) -> torch.Tensor:
        return exact_attention(q, keys, values, first, last, scale, at(block), **scales)

    def decode_steps(keys, values, scales, block: int) -> torch.Tensor:
        """The queries at ``picks``, each a decode step over its live keys."""
        return torch.stack([exact_attention(q[:, :, p : p + 1], keys[:, :, : p + 1], values[:, :, : p + 1], first,
                                            torch.full((2, 1), p, device=device), scale, at(block),
                                            **scales)[:, :, 0] for p in picks])  # fmt: skip

    def at_picks(whole: torch.Tensor) -> torch.Tensor:
        return torch.stack([whole[:, :, p] for p in picks])

    out: dict = {}
    for name, form in forms.items():
        whole = {block: whole_sequence(*form, block) for block in blocks}
        out[f"{name}: whole, block_m {blocks[0]} vs others"] = {
            str(b): _same(whole[b][real], whole[blocks[0]][real]) for b in blocks[1:]}  # fmt: skip
        for block in blocks:
            out[f"{name}: decode at block_m {block} vs whole at {large}"] = _same(
                decode_steps(*form, block), at_picks(whole[large]))
    # The split that would need both: the decode reads the codes at the small block, the training forward
    # the dequantized values at the large one.
    out[f"fp8: decode over codes at block_m {small} vs whole over values at {large}"] = _same(
        decode_steps(*forms["fp8_codes"], small), at_picks(whole_sequence(*forms["fp8_values_bf16"], large)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="16,64", help="comma list of block_m values; the first is the baseline")
    ap.add_argument("--positions", type=int, default=600)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads_kv", type=int, default=8)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--split_keys", type=int, default=2048, help="ExactAttentionSettings.split_keys (0: none)")
    ap.add_argument("--dot", default="bf16", help="ExactAttentionSettings.dot: bf16 (tensor cores, the question) or fp32")
    args = ap.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    result = probe(blocks, args.positions, args.device, args.heads, args.heads_kv, args.head_dim, args.dot,
                   args.split_keys)
    dump({"benchmark": "exact_attention_blocks", "env": environment(), "args": vars(args), "result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
