"""The decode step's layer path (layers.py, residual.py, projections.py), on CPU and on CUDA.

The kernel path runs here with its GPU kernels emulated (``_emulated_kernels.py``: each launch logs
itself and computes its reference with the CPU path's arithmetic), so that:

* on every layer layout, with q/k/v's K split or not, it computes the plain-torch step's logits and
  KV bit for bit;
* the launches are the ones each layer's plan names, in order, and every FP8 input a launch wrote
  reaches its projection as an argument: no act-quant launch where a pair was handed over, and none
  of it through the hand-off table of ``quant/_handoff.py``.

On CUDA, the graphed engine's grouped and fused launches really run, and its greedy rollout is the
torch path's (the modules one by one, SDPA): the same tokens, close log-probs (the attention sums in
another order). Each fused launch's bits against the separate launches it replaces are tested on the
kernel (tests/kernels/).
"""

from __future__ import annotations

import pytest
import torch
from _cuda_engine import CUDA_PROMPTS, graphs_or_skip
from _emulated_kernels import emulate_kernels
from _trainer_utils import tokenizer
from torch import nn
from transformers import GenerationConfig

from jetrl_trainer.quant import PrecisionPhases, quantize_model
from jetrl_trainer.quant.fused import fuse_norm_and_swiglu
from jetrl_trainer.quant.linear import QuantLinear
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings
from jetrl_trainer.rollout.engine.kv_cache import KVCache
from jetrl_trainer.rollout.engine.projections import Activation, GroupedProjection, GroupedSplitSums, SplitSums
from jetrl_trainer.tiny import build_tiny_llama, build_tiny_qwen2, build_tiny_qwen3

LAYOUTS = {  # name: (builder, fuse the norms / SwiGLU, LoRA targets)
    "llama": (build_tiny_llama, True, None),
    "qwen2": (build_tiny_qwen2, True, None),
    "qwen3": (build_tiny_qwen3, True, None),
    "qwen3_hf_norms": (build_tiny_qwen3, False, None),
    "qwen3_head128": (lambda tok: build_tiny_qwen3(tok, head_dim=128), True, None),
    "llama_bias_head128": (lambda tok: build_tiny_llama(tok, head_dim=128, attention_bias=True), True, None),
    "qwen3_lora": (lambda tok: build_tiny_qwen3(tok, head_dim=128), True, ["q_proj", "v_proj", "down_proj"]),
}


def _model(layout: str, fp8: bool = True) -> nn.Module:
    build, fuse, lora = LAYOUTS[layout]
    torch.manual_seed(0)
    model = build(tokenizer()).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # not ones: a norm applied twice, or skipped, must show
        if "norm" in name:
            p.data = (torch.rand(p.shape, generator=g) + 0.5).to(p.dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=lora, init_lora_weights=False)).eval()
    if fp8:
        quantize_model(model, train="fp8", rollout="fp8")
        if fuse:
            fuse_norm_and_swiglu(model)
    return model


def _decode(model, settings: EngineSettings, rows: int = 3, steps: int = 2):
    """``steps`` decode steps of ``rows`` rows over a cache filled with random prompt KV: the logits
    of each step and the cache."""
    engine = DecodeEngine(model, settings=settings)
    v = engine.view
    cache = KVCache(num_layers=len(v.layers), num_slots=rows + 1, max_len=12, num_kv_heads=v.num_kv_heads,
                    head_dim=v.head_dim, dtype=v.dtype, device=v.device)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 6, (rows + 1,), generator=g)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.lengths.copy_(lengths)
    cache.pads.copy_(torch.randint(0, 3, (rows + 1,), generator=g))
    slots = torch.randperm(rows + 1, generator=g)[:rows]
    with torch.no_grad(), PrecisionPhases(model).rollout():
        logits = [engine.decode_step(cache, slots, torch.randint(0, 100, (rows,), generator=g)) for _ in range(steps)]
    return engine, logits, cache


def _on_emulated_kernels(monkeypatch, splits: int = 2):
    """The emulated kernels installed, the kernel path allowed on CPU, and the hand-off table disabled."""
    from jetrl_trainer.quant import _dispatch
    from jetrl_trainer.rollout.engine import engine

    log = emulate_kernels(monkeypatch, splits=splits)
    monkeypatch.setattr(engine, "cuda_graphs_available", lambda device: True)
    monkeypatch.setattr(_dispatch, "take_prequantized", lambda x2d, scale_format: None)
    return log


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("splits", [1, 2])
def test_the_kernel_path_computes_the_torch_paths_bits(layout, splits, monkeypatch):
    """The kernel path, with q/k/v's K split or not: the plain-torch step's logits and KV cache, bit
    for bit (the emulated kernels follow each kernel's contract)."""
    model = _model(layout)
    _, want, want_cache = _decode(model, EngineSettings(decode_path="torch"))
    _on_emulated_kernels(monkeypatch, splits=splits)
    _, got, cache = _decode(model, EngineSettings(decode_path="kernels"))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(cache.k, want_cache.k) and torch.equal(cache.lengths, want_cache.lengths)


def _layer_launches(log, layers: int, steps: int = 2) -> list[list[str]]:
    names = log.names()
    per = len(names) // (layers * steps)
    assert per * layers * steps == len(names), names
    return [names[i * per : (i + 1) * per] for i in range(layers)]


def test_the_default_plan_launches_nine_kernels_a_layer_and_quantizes_nothing_twice(monkeypatch):
    """Qwen3 with heads of 128 (the attention kernel writes o's FP8 input), FP8, fused norms: per layer
    the norm (taking the residual add after layer 0), grouped q/k/v partial sums reduced in the RoPE
    launch, attention, o's partial sums, add + norm, grouped gate/up, SwiGLU, down's partial sums
    (the last layer's down reduced by its own GEMM: the final norm is HF's). Every FP8 input comes
    from the launch that wrote it: no act-quant launch at all."""
    log = _on_emulated_kernels(monkeypatch)
    engine, _, _ = _decode(_model("qwen3_head128"), EngineSettings(decode_path="kernels"), steps=1)
    tail = ["fp8_decode_gemm_grouped_partials", "rope_append_from_partials", "decode_attention",
            "fp8_decode_gemm_partials", "add_rmsnorm_quant_fp8", "fp8_decode_gemm_grouped", "swiglu_quant_fp8"]  # fmt: skip
    assert _layer_launches(log, 2, steps=1) == [
        ["rmsnorm_quant_fp8", *tail, "fp8_decode_gemm_partials"],
        ["add_rmsnorm_quant_fp8", *tail, "fp8_decode_gemm_nt"],
    ]
    quantized = [kw for name, _, kw in log if name == "decode_attention"]
    assert all(dict(kw)["quantize_output"] == "fp32" for kw in quantized)


def test_qkv_sums_reach_the_rope_launch_only_where_k_is_split_and_no_module_norm_sits_between(monkeypatch):
    """One K split: q/k/v come reduced (no reduction launch to save). Qwen3 with HF's own q/k norms:
    the norm modules run between the projections and RoPE, so the sums are reduced first."""
    for layout, splits, want in (("qwen3", 1, "rope_append"), ("qwen3_hf_norms", 2, "rope_append"),
                                 ("qwen3", 2, "rope_append_from_partials"), ("qwen2", 2, "rope_append_from_partials")):  # fmt: skip
        with monkeypatch.context() as patch:
            log = _on_emulated_kernels(patch, splits=splits)
            _decode(_model(layout), EngineSettings(decode_path="kernels"), steps=1)
        ropes = [name for name in log.names() if name.startswith("rope_append")]
        assert ropes == [want] * 2, (layout, splits, ropes)


def test_rows_above_decode_m_fall_back_where_the_launch_cannot_run(monkeypatch):
    """70 rows: q/k/v keep their grouped launch (up to QKV_MAX_ROWS), the rest run the general FP8
    GEMM, still fed by the launches' FP8 pairs (no act quant), with the same bits as the torch path."""
    model = _model("qwen3_head128")
    _, want, _ = _decode(model, EngineSettings(decode_path="torch"), rows=70, steps=1)
    log = _on_emulated_kernels(monkeypatch)
    _, got, _ = _decode(model, EngineSettings(decode_path="kernels"), rows=70, steps=1)
    assert torch.equal(got[0], want[0])
    layer = _layer_launches(log, 2, steps=1)[1]
    assert layer == ["add_rmsnorm_quant_fp8", "fp8_decode_gemm_grouped_partials", "rope_append_from_partials",
                     "decode_attention", "fp8_gemm_nt", "add_rmsnorm_quant_fp8", "fp8_gemm_nt", "fp8_gemm_nt",
                     "swiglu_quant_fp8", "fp8_gemm_nt"]  # fmt: skip


def test_generate_on_the_emulated_kernels_records_the_torch_paths_tokens_and_logprobs(monkeypatch):
    """End to end, sampled, with refills and look-ahead: the kernel path's rollout is the torch path's."""
    from transformers import GenerationConfig

    model = _model("qwen3_head128")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [5, 6, 7, 8, 9]]
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, pad_token_id=0)

    def rollout(settings):
        with PrecisionPhases(model).rollout():
            return DecodeEngine(model, settings=settings).generate(prompts, config, eos_token_ids=[-1], seed=3,
                                                                   max_batch_size=3, row_budgets=[6, 2, 4, 6])

    want = rollout(EngineSettings(decode_path="torch"))
    log = _on_emulated_kernels(monkeypatch)
    tokens, logprobs = rollout(EngineSettings(decode_path="kernels"))
    assert tokens == want[0] and [len(t) for t in tokens] == [6, 2, 4, 6]
    assert all(torch.equal(torch.tensor(a), torch.tensor(b)) for a, b in zip(logprobs, want[1]))
    assert "decode_attention" in log.names()


# -- projections ----------------------------------------------------------------------------------


def test_a_quantlinear_uses_the_pair_its_input_came_with_only_where_its_recipe_reads_it():
    """``forward_prequantized`` (through ``linear``): an FP8 recipe in the pair's scale format uses it
    (a pair of another tensor shows in the output), another format or a BF16 recipe quantizes ``x``."""
    from jetrl_trainer.quant.fp8 import quantize_fp8_groups
    from jetrl_trainer.rollout.engine.projections import linear

    torch.manual_seed(0)
    layer = QuantLinear.from_linear(nn.Linear(256, 64), {"train": "bf16", "rollout": "fp8"})
    x, other = torch.randn(3, 1, 256), torch.randn(3, 256)
    own, foreign = quantize_fp8_groups(x.reshape(3, 256), 128), quantize_fp8_groups(other, 128)
    with torch.no_grad(), PrecisionPhases(layer).rollout():
        want = layer(x)
        assert torch.equal(linear(layer, Activation(x, own, "fp32")), want)
        assert torch.equal(linear(layer, Activation(x, foreign, "ue8m0")), want)
        assert not torch.equal(linear(layer, Activation(x, foreign, "fp32")), want)
    with torch.no_grad(), PrecisionPhases(layer).train():
        assert torch.equal(linear(layer, Activation(x, foreign, "fp32")), layer(x))


def test_split_sums_materialize_as_the_gemms_reduction():
    parts = torch.randn(3, 4, 8) * 1e3
    bias = torch.randn(8).bfloat16()
    expected = ((parts[0] + parts[1]) + parts[2] + bias.float()).bfloat16()
    sums = SplitSums(parts, bias, (2, 2, 8), torch.bfloat16)
    assert torch.equal(sums.materialize(), expected.view(2, 2, 8))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_projections_group_only_plain_fp8_quantlinears(arch):
    """q/k/v and gate/up form one decode launch each for FP8 QuantLinears (Qwen2's biases too);
    HF's own Linears and LoRA layers do not group; off CUDA a group's call returns None."""
    from peft import LoraConfig, get_peft_model

    from jetrl_trainer.rollout.engine.architecture import DecoderView

    build = LAYOUTS[arch][0]
    plain = build(tokenizer()).eval()
    assert not any(DecoderView.from_model(plain).qkv_groups + DecoderView.from_model(plain).mlp_groups)
    for fuse in (False, True):
        model = quantize_model(build(tokenizer()), train="fp8", rollout="fp8").eval()
        if fuse:
            fuse_norm_and_swiglu(model)
        view = DecoderView.from_model(model)
        assert all(g is not None and len(g.modules) == 3 for g in view.qkv_groups)
        assert all(g is not None and len(g.modules) == 2 for g in view.mlp_groups)
        x = torch.randn(3, 1, model.config.hidden_size)
        with torch.no_grad(), PrecisionPhases(model).rollout():
            assert view.qkv_groups[0](Activation(x)) is None  # CPU: the modules run one by one
    lora = LoraConfig(r=4, target_modules=["k_proj", "up_proj"], init_lora_weights=False)
    model = quantize_model(get_peft_model(build(tokenizer()), lora), train="fp8", rollout="fp8").eval()
    view = DecoderView.from_model(model)
    assert not any(view.qkv_groups) and not any(view.mlp_groups)


class _EmulatedDecodeModule:
    """``kernels/triton_decode_gemm`` for CPU: the partials ops emulated (K split into ``splits`` pieces,
    FP32 sums of the dequantized operands), a plan of ``splits``; counts how often it was looked up."""

    def __init__(self, splits: int) -> None:
        self.splits, self.lookups = splits, 0

    def planned_splits(self, m, widths, k, device, settings):
        return self.splits

    def _parts(self, x_q, x_s, w_q, w_s):
        from jetrl_trainer.quant.fp8 import dequantize_fp8_blocks, dequantize_fp8_groups

        x, w = dequantize_fp8_groups(x_q, x_s), dequantize_fp8_blocks(w_q, w_s)
        pieces = zip(x.chunk(self.splits, dim=1), w.chunk(self.splits, dim=1))
        return torch.stack([xk @ wk.t() for xk, wk in pieces])

    def fp8_decode_gemm_partials(self, x_q, x_s, w_q, w_s, *, settings):
        return self._parts(x_q, x_s, w_q, w_s)

    def fp8_decode_gemm_grouped_partials(self, x_q, x_s, weights, *, settings):
        return torch.cat([self._parts(x_q, x_s, *w) for w in weights], dim=-1)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_projection_leaves_split_sums_where_its_launch_splits_k(splits, bias, monkeypatch):
    """``GroupedProjection.split_sums``: q/k/v leave their split sums only where the launch splits K (one
    split: None, the outputs come reduced); a group of one (o, down) always; none under autograd or
    for a BF16 recipe. The decode kernel is looked up once per call. Materialized, the sums are each
    module's FP8 product (+ bias)."""
    from jetrl_trainer.rollout.engine import projections

    module = _EmulatedDecodeModule(splits)

    def lookup(x2d, max_rows):
        module.lookups += 1
        return module

    monkeypatch.setattr(projections, "decode_gemm_module", lookup)
    torch.manual_seed(0)
    linears = [QuantLinear.from_linear(nn.Linear(256, n, bias=bias), {"train": "fp8", "rollout": "fp8"})
               for n in (128, 64, 64)]  # fmt: skip
    x = Activation(torch.randn(3, 1, 256))
    qkv, o = GroupedProjection.of(linears), GroupedProjection.of(linears[:1])
    with torch.no_grad(), PrecisionPhases(nn.ModuleList(linears)).rollout():
        grouped, single = qkv.split_sums(x), o.split_sums(x)
        wanted = [m(x.x) for m in linears]
    assert module.lookups == 2
    assert isinstance(single, SplitSums) and single.parts.shape == (splits, 3, 128)
    assert torch.allclose(single.materialize(), wanted[0], atol=1e-5)
    if splits == 1:
        assert grouped is None
    else:
        assert isinstance(grouped, GroupedSplitSums) and grouped.parts.shape == (2, 3, 256)
        assert (grouped.biases is not None) == bias
        outs = grouped.parts.sum(dim=0).split([128, 64, 64], dim=-1)
        for got, b, want in zip(outs, grouped.biases or [0.0] * 3, wanted):
            assert torch.allclose((got + b).view(want.shape), want, atol=1e-5)
    with PrecisionPhases(nn.ModuleList(linears)).rollout():  # autograd on (the weights want gradients): the training path
        assert o.split_sums(x) is None
    bf16 = GroupedProjection.of([QuantLinear.from_linear(nn.Linear(256, 64), {"train": "bf16", "rollout": "bf16"})])
    with torch.no_grad(), PrecisionPhases(bf16.modules[0]).rollout():
        assert bf16.split_sums(x) is None


# -- the residual stream ------------------------------------------------------------------------


def test_residual_stream_takes_each_pending_add_into_the_norm_launch_its_mode_names(monkeypatch):
    """``"kernel+add"``: the pending add (split sums with their bias, or a tensor) goes into the add +
    norm launch, and the FP8 pair comes back for the consumer; ``"kernel"``: a separate add, then the
    norm launch (quantizing only for an FP8 consumer); ``"module"``: a separate add, then the module.
    Every mode gives the same stream and output."""
    from jetrl_trainer.quant.fused import FusedRMSNorm
    from jetrl_trainer.rollout.engine.residual import ResidualStream

    log = emulate_kernels(monkeypatch)
    norm = FusedRMSNorm(nn.Parameter(torch.rand(128) + 0.5), 1e-6)
    h0 = torch.randn(2, 1, 128)
    sums = SplitSums(torch.randn(2, 2, 128), torch.randn(128), (2, 1, 128), torch.float32)
    want_h = h0 + sums.materialize()
    want_y = norm(want_h)
    for mode, fmt, launches in (("kernel+add", "fp32", ["add_rmsnorm_quant_fp8"]), ("kernel", None, ["rmsnorm_quant_fp8"]),
                                ("module", None, ["rmsnorm_quant_fp8"])):  # fmt: skip
        log.clear()
        stream = ResidualStream(h0.clone())
        stream.add(sums)
        out = stream.norm(norm, mode, fmt)
        assert torch.equal(out.x, want_y) and torch.equal(stream.h, want_h), mode
        assert (out.fp8 is not None) == (fmt is not None) and log.names() == launches, mode
    first = ResidualStream(h0.clone())
    log.clear()
    assert torch.equal(first.norm(norm, "kernel+add", "fp32").x, norm(h0)) and log.names()[0] == "rmsnorm_quant_fp8"


# -- on CUDA -------------------------------------------------------------------------------------------------


def _graphed_rollout_is_the_torch_paths(model, prompts, after_graphs=lambda: None, max_new_tokens: int = 8) -> None:
    """Greedy rollouts on the graphed kernel path (then ``after_graphs()``) and on the torch path (the
    modules one by one, SDPA): the same tokens, log-probs within the attention order's difference."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=[-1])
    runs = []
    with PrecisionPhases(model).rollout():
        for path in ("graphs", "torch"):
            engine = DecodeEngine(model, settings=EngineSettings(decode_path=path))
            runs.append(engine.generate(prompts, config, eos_token_ids=[-1], seed=0, pad_token_id=0))
            if path == "graphs":
                after_graphs()
    (tokens, logprobs), (want_tokens, want_logprobs) = runs
    assert tokens == want_tokens
    for a, b in zip(logprobs, want_logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-2, rtol=0)


def test_the_views_rope_is_the_modeling_modules_at_call_time(monkeypatch):
    """`ExactOps` replaces the modeling module's ``apply_rotary_pos_emb`` when first entered, maybe after the
    engine was built; the training forward's attention reads the module's global at each call, so the
    decode must too (a view that kept the function it was built with decoded with the eager function
    while the training forward ran the fused kernel)."""
    from jetrl_trainer.rollout.engine.architecture import DecoderView
    from transformers.models.qwen3 import modeling_qwen3

    view = DecoderView.from_model(build_tiny_qwen3(tokenizer()))
    calls = []
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", lambda *args: calls.append(args) or ("q", "k"))
    q, k, cos, sin = torch.ones(1, 2, 1, 8), torch.ones(1, 1, 1, 8), torch.ones(1, 1, 8), torch.zeros(1, 1, 8)
    assert view.apply_rope(q, k, cos, sin) == ("q", "k")
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0], (q, k, cos, sin)))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_grouped_projections_run_and_keep_the_torch_paths_tokens(arch, monkeypatch):
    """q/k/v and gate/up in one FP8 decode launch each (Qwen2: with biases): the grouped launch really
    ran (two per layer and step), the torch path ran none, and the greedy tokens are the torch path's."""
    graphs_or_skip()
    from jetrl_trainer.kernels import triton_decode_gemm as dg
    from jetrl_trainer.tiny import build_tiny_qwen2

    build = build_tiny_qwen2 if arch == "qwen2" else build_tiny_qwen3
    model = build(tokenizer()).cuda().eval()
    quantize_model(model, train="fp8", rollout="fp8")
    calls = []
    real = dg.fp8_decode_gemm_grouped
    monkeypatch.setattr(dg, "fp8_decode_gemm_grouped", lambda *a, **kw: calls.append(len(a[2])) or real(*a, **kw))

    def grouped_launches_ran():
        assert sorted(set(calls)) == [2, 3] and len(calls) >= 2 * len(model.model.layers), calls
        calls.clear()

    _graphed_rollout_is_the_torch_paths(model, CUDA_PROMPTS, grouped_launches_ran)
    assert not calls


@pytest.mark.gpu
def test_qkv_group_takes_the_decode_kernel_up_to_its_row_limit(monkeypatch):
    """Above the recipe's decode_gemm.max_m rows only the q/k/v group keeps the grouped launch (up to QKV_MAX_ROWS):
    a 130-row batch (its graph bucket: 130 rows) runs it at 130 rows, gate/up never above 64 rows, and the greedy
    tokens are the torch path's."""
    graphs_or_skip()
    from jetrl_trainer.kernels import triton_decode_gemm as dg
    from jetrl_trainer.kernels.settings import DecodeGemmSettings
    from jetrl_trainer.rollout.engine.projections import QKV_MAX_ROWS

    model = build_tiny_qwen3(tokenizer()).cuda().eval()
    quantize_model(model, train="fp8", rollout="fp8")
    calls = []
    real = dg.fp8_decode_gemm_grouped
    monkeypatch.setattr(dg, "fp8_decode_gemm_grouped",
                        lambda *a, **kw: calls.append((len(a[2]), a[0].shape[0])) or real(*a, **kw))  # fmt: skip

    def rows_within_the_limits():
        qkv_rows = {rows for n, rows in calls if n == 3}
        mlp_rows = {rows for n, rows in calls if n == 2}
        decode_max_m = DecodeGemmSettings().max_m
        assert 130 in qkv_rows and max(qkv_rows) <= QKV_MAX_ROWS and max(mlp_rows, default=0) <= decode_max_m, (qkv_rows, mlp_rows)

    prompts = [CUDA_PROMPTS[i % len(CUDA_PROMPTS)] + [20 + i % 50] for i in range(130)]
    _graphed_rollout_is_the_torch_paths(model, prompts, rows_within_the_limits, max_new_tokens=4)


def _fp8_head128_model(arch: str, tok, **overrides):
    """A tiny unified-FP8 model with heads of 128 (one 1x128 group per head): Qwen3, or Llama with
    biases on q/k/v/o; ``overrides``: more config fields."""
    from jetrl_trainer.tiny import build_tiny_llama

    if arch == "qwen3":
        model = build_tiny_qwen3(tok, head_dim=128, **overrides)
    else:
        model = build_tiny_llama(tok, head_dim=128, attention_bias=True, **overrides)
    model = model.cuda().eval()
    quantize_model(model, train="fp8", rollout="fp8")
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama_bias"])
def test_fused_epilogues_run_and_keep_the_torch_paths_tokens(arch, monkeypatch):
    """Residual adds with the o / down split-K reductions inside the next fused RMSNorm, and the o
    projection's activation quant inside the attention kernel: the fused kernels really ran, the torch
    path ran none, and the greedy tokens are the torch path's. Heads of 128 (the attention kernel's
    quant needs one 1x128 group per head); Llama with biases on q/k/v/o."""
    graphs_or_skip()
    from jetrl_trainer.kernels import triton_decode_attention as attention
    from jetrl_trainer.kernels import triton_decode_gemm as dg
    from jetrl_trainer.kernels import triton_norm

    model = _fp8_head128_model(arch, tokenizer())
    calls = {"partials": 0, "add_norm": 0, "attention_quant": 0}

    def counting(name, real, check=lambda *a, **kw: True):
        def wrapped(*args, **kwargs):
            calls[name] += bool(check(*args, **kwargs))
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(dg, "fp8_decode_gemm_partials", counting("partials", dg.fp8_decode_gemm_partials))
    monkeypatch.setattr(triton_norm, "add_rmsnorm_quant_fp8", counting("add_norm", triton_norm.add_rmsnorm_quant_fp8))
    monkeypatch.setattr(attention, "decode_attention", counting(
        "attention_quant", attention.decode_attention, lambda *a, **kw: kw.get("quantize_output") is not None))

    def fused_kernels_ran():
        layers = len(model.model.layers)
        assert calls["partials"] >= 2 * layers - 1 and calls["add_norm"] >= 2 * layers - 1, calls
        assert calls["attention_quant"] >= layers, calls
        calls.update(partials=0, add_norm=0, attention_quant=0)

    _graphed_rollout_is_the_torch_paths(model, CUDA_PROMPTS * 2, fused_kernels_ran)
    assert calls == {"partials": 0, "add_norm": 0, "attention_quant": 0}


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama_bias"])
@pytest.mark.parametrize("min_groups", [1, 4])
def test_qkv_sums_are_reduced_in_the_rope_launch_where_k_is_split(arch, min_groups, monkeypatch):
    """Where the grouped q/k/v launch splits K it leaves its split sums and the RoPE + KV-append launch
    reduces them (with Qwen3's q/k norms, or Llama's q/k/v biases) in every layer; with the shipped
    split length (one split here) the plain path runs instead. Either way the greedy tokens are the
    torch path's."""
    graphs_or_skip()
    from jetrl_trainer.kernels import triton_rope_append
    from jetrl_trainer.kernels.settings import DecodeGemmSettings
    from jetrl_trainer.quant import QuantLinear
    from jetrl_trainer.quant.recipe import FP8Recipe

    model = _fp8_head128_model(arch, tokenizer(), hidden_size=512)  # K of 4 groups: q/k/v split in up to 4
    recipe = FP8Recipe(decode_gemm=DecodeGemmSettings(min_groups_per_split=min_groups))
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.set_recipes(train=recipe, rollout=recipe)
    calls = []
    real = triton_rope_append.rope_append_from_partials

    def counting(parts, *args, **kwargs):
        calls.append(parts.shape[0])
        return real(parts, *args, **kwargs)

    monkeypatch.setattr(triton_rope_append, "rope_append_from_partials", counting)

    def reduced_in_the_rope_launch():
        if min_groups == 4:  # one K split: no reduction launch to save, the plain path runs
            assert not calls, calls
        else:
            assert len(calls) >= len(model.model.layers) and min(calls) > 1, calls
        calls.clear()

    _graphed_rollout_is_the_torch_paths(model, CUDA_PROMPTS * 2, reduced_in_the_rope_launch)
    assert not calls
