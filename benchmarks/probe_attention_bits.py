"""How many output bits does the decode attention kernel share with the training forward's attention?

The training forward runs SDPA over the whole sequence (causal, no mask on unpadded rows; torch picks
the backend: cuDNN on the H200 with torch 2.11). A decode step attends one query to the same keys.
This probe builds random BF16 q/k/v of an 8B layout (32 query heads, 8 KV heads, head_dim 128), runs the causal SDPA once, and for several
positions ``t`` compares row ``t`` of it, bit for bit, with:

* SDPA with one query over the first ``t + 1`` keys (what HF ``generate`` runs at decode);
* the Triton decode kernel with each tile size (64, 128) and order (flash attention's, newest tile
  first; or oldest first), under each launch setting given (``--settings``: ``DecodeAttentionSettings``
  variants; warps share a tile's row sums, so their number can change the bits).

It prints, per variant, the fraction of output elements that differ and the largest difference, and
for the kernel its time per call inside a CUDA graph at batch 64 and 256 (8B layout, 192 live
positions of a 384-position cache, the planned splits): what the engine's decode step pays.
With ``--pad N`` it also takes a left-padded batch through the masked call transformers makes for it
(see `padded`): which backend torch picks there, and how close each decode variant lands, with and
without the pad counts that line its tiles up with the padded row's.
Usage: ``python benchmarks/probe_attention_bits.py [--length 384] [--rows 8] [--target FLASH_ATTENTION]
[--settings "num_warps=8;num_warps=8,loop_stages=1"] [--pad 48]``
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
import torch.nn.functional as F
from _common import bench_graph_ms, cold_copies, cycling, dump, environment, replaced_settings
from torch.nn.attention import SDPBackend, sdpa_kernel

from jetrl_trainer.kernels.settings import DecodeAttentionSettings
from jetrl_trainer.kernels.triton_decode_attention import decode_attention

H, H_KV, D = 32, 8, 128


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    differ = got != want
    return dict(differ=round(differ.float().mean().item(), 6), max_abs=float((got.float() - want.float()).abs().max()))


def graph_us(options: dict) -> dict:
    """Microseconds per decode-attention call in a CUDA graph, batch 64 and 256, 192 live of 384 positions
    (pad counts 0-127, as the engine passes them). Keys and values are distinct tensors, and the calls
    cycle through copies of them that pass three times the L2 cache, so each call reads its live K/V
    from DRAM as a decode step does (at batch 64 the 25 MB of live positions would otherwise stay in L2)."""
    out = {}
    for batch in (64, 256):
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        caches = [torch.randn(batch + 1, H_KV, 384, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        slots = torch.arange(batch, device="cuda")
        lengths = torch.full((batch,), 192, device="cuda")
        pads = torch.randint(0, 128, (batch,), device="cuda")  # the engine passes its rows' pad counts
        live = 2 * batch * H_KV * 192 * D * 2  # bytes of K and V a call reads
        call = cycling(lambda k, v: decode_attention(q, k, v, slots, lengths, 0.088, pads=pads, **options),
                       cold_copies(caches, read_bytes=live))  # fmt: skip
        out[f"b{batch}"] = round(1e3 * bench_graph_ms(call), 1)
    return out


def padded(args, q, k, v, variants: dict) -> dict:
    """A left-padded batch as the trainer's forward sees it: row ``b`` starts with ``pads[b]`` pads, and
    transformers passes a 4D boolean mask (causal and padding) with K/V repeated to every head. The
    engine's cache holds each row's live positions from slot position 0, so a decode query at padded
    position ``t`` attends to ``t - pads[b] + 1`` cached positions. Which backend torch picks for the
    masked call, and how many output elements each decode variant shares with it (live positions only),
    with and without the rows' pad counts (``pads``: tiles on the padded row's boundaries)."""
    rows, length = q.shape[0], q.shape[2]
    pads = [(b * args.pad) // max(1, rows - 1) for b in range(rows)]
    live = torch.ones(rows, length, dtype=torch.bool, device="cuda")
    for b, pad in enumerate(pads):
        live[b, :pad] = False
    causal = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()
    mask = causal[None, None] & live[:, None, None, :]  # (B, 1, L, L), True = attend
    k_rep, v_rep = (x.repeat_interleave(H // H_KV, dim=1) for x in (k, v))
    choice = torch._fused_sdp_choice(q, k_rep, v_rep, attn_mask=mask, scale=D**-0.5)
    backend = next(b.name for b in SDPBackend.__members__.values() if b.value == choice)
    full = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, scale=D**-0.5)
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
    for b, pad in enumerate(pads):  # live positions from slot position 0, as the engine stores a prompt
        k_cache[b, :, : length - pad], v_cache[b, :, : length - pad] = k[b, :, pad:], v[b, :, pad:]
    slots = torch.arange(rows, device="cuda")
    positions = [t for t in map(int, args.positions.split(",")) if max(pads) <= t < length]
    out = dict(pads=pads, backend=backend, variants={})
    pad_counts = torch.tensor(pads, device="cuda")
    runs = [(name, options, aligned) for name, options in variants.items() for aligned in ((False,) if options is None
            else (False, True))]  # fmt: skip
    for name, options, aligned in runs:
        got, want = [], []
        for t in positions:
            if options is None:  # generate: one query over the padded row with the padding mask
                one = F.scaled_dot_product_attention(q[:, :, t : t + 1], k_rep[:, :, : t + 1], v_rep[:, :, : t + 1],
                                                     attn_mask=live[:, None, None, : t + 1], scale=D**-0.5)[:, :, 0]  # fmt: skip
            else:
                lengths = torch.tensor([t - pad + 1 for pad in pads], device="cuda")
                one = decode_attention(q[:, :, t].contiguous(), k_cache, v_cache, slots, lengths, D**-0.5, splits=1,
                                       pads=pad_counts if aligned else None, **options)  # fmt: skip
            got.append(one)
            want.append(full[:, :, t])
        key = name + (" pads" if aligned else "")
        out["variants"][key] = compare(torch.stack(got), torch.stack(want))
        print("padded:", key, out["variants"][key], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=384)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--settings", default="",
                    help="';'-separated DecodeAttentionSettings to compare, each like 'num_warps=8,loop_stages=1' "
                         "(the shipped settings run first)")  # fmt: skip
    ap.add_argument("--target", default="default", help="the causal SDPA to compare with: default or an SDPBackend name")
    ap.add_argument("--positions", default="0,63,64,127,128,200,255,300,383")
    ap.add_argument("--pad", type=int, default=0,
                    help="also a left-padded batch (rows padded by 0 to this many positions): the masked call "
                         "transformers makes for it, against the engine's unpadded cache")  # fmt: skip
    args = ap.parse_args()
    try:
        launches = [DecodeAttentionSettings()] + [replaced_settings(DecodeAttentionSettings(), text)
                                                  for text in filter(None, args.settings.split(";"))]  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"--settings: {exc}") from exc
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
    for launch, block_n, flash_order in itertools.product(launches, (64, 128), (True, False)):
        fields = ",".join(f"{k}={v}" for k, v in dataclasses.asdict(launch).items())
        name = f"kernel block_n={block_n} flash_order={int(flash_order)} {fields}"
        variants[name] = dict(block_n=block_n, flash_order=flash_order, settings=launch)
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
        if options is not None:
            result["variants"][name]["graph_us"] = graph_us(options)
        print(name, result["variants"][name], flush=True)
    if args.pad:
        result["padded"] = padded(args, q, k, v, variants)
    dump(dict(benchmark="attention_bits_probe", env=environment(), length=args.length, rows=args.rows,
              positions=positions, **result))  # fmt: skip


if __name__ == "__main__":
    main()
