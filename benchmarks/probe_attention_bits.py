"""How many output bits does the decode attention kernel share with the training forward's attention?

The training forward runs SDPA over the whole sequence (causal, no mask on unpadded rows: the flash
kernel). A decode step attends one query to the same keys. This probe builds random BF16 q/k/v of an
8B layout (32 query heads, 8 KV heads, head_dim 128), runs the causal SDPA once, and for several
positions ``t`` compares row ``t`` of it, bit for bit, with:

* SDPA with one query over the first ``t + 1`` keys (what HF ``generate`` runs at decode);
* the Triton decode kernel under each combination of its arithmetic knobs
  (``kernels/triton_decode_attention.py``: ``dot_accumulate``, ``fa2_row_sums``, ``reciprocal``).

It prints, per variant, the fraction of output elements that differ and the largest difference.
Usage: ``python benchmarks/probe_attention_bits.py [--length 384] [--rows 8]``
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from _common import dump, environment
from torch.nn.attention import SDPBackend, sdpa_kernel

from jetrl_trainer.kernels.triton_decode_attention import decode_attention

H, H_KV, D = 32, 8, 128


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    differ = got != want
    return dict(differ=round(differ.float().mean().item(), 6), max_abs=float((got.float() - want.float()).abs().max()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=384)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--target", default="default", help="the causal SDPA to compare with: default or an SDPBackend name")
    ap.add_argument("--positions", default="0,63,64,127,128,200,255,300,383")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(args.rows, H, args.length, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(args.rows, H_KV, args.length, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(args.rows, H_KV, args.length, D, device="cuda", generator=g).bfloat16()
    scale = D**-0.5
    default = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    t_last = args.length - 1
    default_one = F.scaled_dot_product_attention(q[:, :, t_last:], k, v, scale=scale, enable_gqa=True)
    backends = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):  # fmt: skip
        try:
            with sdpa_kernel(backend):
                full_b = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
                one_b = F.scaled_dot_product_attention(q[:, :, t_last:], k, v, scale=scale, enable_gqa=True)
            backends[backend.name] = dict(causal_equals_default=bool(torch.equal(full_b, default)),
                                          one_query_equals_default=bool(torch.equal(one_b, default_one)),
                                          one_query_vs_its_causal=compare(one_b[:, :, 0], full_b[:, :, t_last]))  # fmt: skip
        except RuntimeError as error:
            backends[backend.name] = f"refused: {str(error).splitlines()[0][:200]}"
        print(backend.name, backends[backend.name], flush=True)
    target = getattr(SDPBackend, args.target) if args.target != "default" else None
    if target is None:
        full = default
    else:
        with sdpa_kernel(target):
            full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    result = dict(backends=backends, target=args.target, variants={})
    positions = [int(t) for t in args.positions.split(",") if int(t) < args.length]
    slots = torch.arange(args.rows, device="cuda")
    variants = {"sdpa one query (generate)": None}
    for block_n, flash_order, fa2_sum in itertools.product((64, 128), (True, False), (False, True)):
        if fa2_sum and not flash_order:
            continue
        variants[f"kernel block_n={block_n} flash_order={int(flash_order)} fa2_sum={int(fa2_sum)}"] = dict(
            block_n=block_n, flash_order=flash_order, fa2_row_sums=fa2_sum
        )
    for name, options in variants.items():
        got, want = [], []
        for t in positions:
            lengths = torch.full((args.rows,), t + 1, device="cuda")
            if options is None:
                out = F.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], scale=scale,
                                                     enable_gqa=True)[:, :, 0]  # fmt: skip
            else:
                out = decode_attention(q[:, :, t].contiguous(), k, v, slots, lengths, scale, splits=1, **options)
            got.append(out)
            want.append(full[:, :, t])
        result["variants"][name] = compare(torch.stack(got), torch.stack(want))
        print(name, result["variants"][name], flush=True)
    dump(dict(benchmark="attention_bits_probe", env=environment(), length=args.length, rows=args.rows,
              positions=positions, **result))  # fmt: skip


if __name__ == "__main__":
    main()
