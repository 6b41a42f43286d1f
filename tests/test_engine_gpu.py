"""The decode engine on CUDA: greedy parity with generate, recorded log-probs, and each of the
kernel path's settings against the launches it replaces (the same tokens; the same bits where the
fused launch reproduces the separate ones)."""

from __future__ import annotations

import pytest
import torch
from _trainer_utils import tokenizer
from transformers import GenerationConfig

from jetrl_trainer.quant import PrecisionPhases, WeightCacheRefresh, quantize_model
from jetrl_trainer.rollout import left_pad, processed_logprobs, truncate_after_eos
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings
from jetrl_trainer.tiny import build_tiny_qwen3

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [5, 6, 7, 8, 9]]
GRAPHS, TORCH = EngineSettings(decode_path="graphs"), EngineSettings(decode_path="torch")


def _model(precision):
    model = build_tiny_qwen3(tokenizer()).cuda().eval()
    quantize_model(model, train="bf16", rollout=precision)
    return model


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_greedy_matches_generate_on_cuda(precision):
    model, tok = _model(precision), tokenizer()
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=[-1])
    ids, mask = left_pad(PROMPTS, tok.pad_token_id)
    with PrecisionPhases(model).rollout():
        out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), generation_config=config)
        tokens, _ = DecodeEngine(model).generate(PROMPTS, config, eos_token_ids=[-1], seed=0,
                                                 pad_token_id=tok.pad_token_id)  # fmt: skip
    expected, _ = truncate_after_eos(out[:, ids.shape[1] :].cpu(), torch.zeros(out.shape), [-1])
    assert tokens == expected


def test_sampled_logprobs_on_cuda():
    model, tok = _model("fp8"), tokenizer()
    warp = dict(temperature=0.7, top_k=12, top_p=0.9)
    config = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=tok.pad_token_id, **warp)
    with PrecisionPhases(model).rollout():
        tokens, logprobs = DecodeEngine(model).generate(PROMPTS, config, eos_token_ids=[tok.eos_token_id], seed=5,
                                                        pad_token_id=tok.pad_token_id)  # fmt: skip
        prompt_ids, prompt_mask = left_pad(PROMPTS, tok.pad_token_id)
        width = max(map(len, tokens))
        comp = torch.full((len(tokens), width), tok.pad_token_id)
        comp_mask = torch.zeros_like(comp)
        for r, t in enumerate(tokens):
            comp[r, : len(t)], comp_mask[r, : len(t)] = torch.tensor(t), 1
        ids = torch.cat([prompt_ids, comp], 1).cuda()
        mask = torch.cat([prompt_mask, comp_mask], 1).cuda()
        logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_ids.shape[1] - 1 : -1]
        expected = processed_logprobs(logits.float(), comp.cuda(), **warp).cpu()
    for r, lps in enumerate(logprobs):
        # FP8: a batch-dependent GEMM order can flip one rounding (~1e-3); a wrong warper is off by > 0.1
        assert torch.allclose(torch.tensor(lps), expected[r, : len(lps)], atol=1e-2, rtol=0), r


def _graphs_or_skip():
    from jetrl_trainer.kernels import triton_available

    if not triton_available():
        pytest.skip("needs Triton (the graphed decode step runs the Triton attention kernel)")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_graphed_decode_matches_generate_and_the_eager_engine(precision):
    _graphs_or_skip()
    model, tok = _model(precision), tokenizer()
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=[-1])
    ids, mask = left_pad(PROMPTS, tok.pad_token_id)
    with PrecisionPhases(model).rollout():
        out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), generation_config=config)
        expected, _ = truncate_after_eos(out[:, ids.shape[1] :].cpu(), torch.zeros(out.shape), [-1])
        engine = DecodeEngine(model)
        graphed, graphed_lp = engine.generate(PROMPTS, config, eos_token_ids=[-1], seed=0, pad_token_id=0)
        refilled, _ = DecodeEngine(model, settings=GRAPHS).generate(PROMPTS, config, eos_token_ids=[-1], seed=0,
                                                                    pad_token_id=0, max_batch_size=3)  # fmt: skip
        eager, eager_lp = DecodeEngine(model, settings=TORCH).generate(PROMPTS, config, eos_token_ids=[-1], seed=0,
                                                                       pad_token_id=0)  # fmt: skip
    assert engine.settings.decode_path == "graphs" and graphed == expected == refilled == eager
    for a, b in zip(graphed_lp, eager_lp):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


def test_graphed_look_ahead_changes_no_token():
    """On CUDA step t + 1 really runs while the host reads step t (pinned copies, events)."""
    _graphs_or_skip()
    model, tok = _model("fp8"), tokenizer()
    config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.0, pad_token_id=tok.pad_token_id)
    budgets = [12, 3, 7, 1, 12, 5, 2, 9]
    runs = []
    with PrecisionPhases(model).rollout():
        for look_ahead in (True, False):
            engine = DecodeEngine(model, settings=EngineSettings(decode_path="graphs", look_ahead=look_ahead))
            runs.append(engine.generate(PROMPTS * 2, config, eos_token_ids=[tok.eos_token_id], seed=4, pad_token_id=0,
                                        max_batch_size=3, row_budgets=budgets))  # fmt: skip
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


def _grouped_then_ungrouped(model, prompts, config, calls: list):
    """Greedy runs with and without grouped projections; the grouped run's logged launches are
    moved out of ``calls`` so that the ungrouped run's (none expected) stay in it."""
    runs = []
    with PrecisionPhases(model).rollout():
        for grouped in (True, False):
            engine = DecodeEngine(model, settings=EngineSettings(decode_path="graphs", grouped_projections=grouped))
            runs.append(engine.generate(prompts, config, eos_token_ids=[-1], seed=0, pad_token_id=0))
            if grouped:
                grouped_calls = list(calls)
                calls.clear()
    return runs[0], grouped_calls, runs[1]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_grouped_projections_change_no_token(arch, monkeypatch):
    """q/k/v and gate/up in one FP8 decode launch each (Qwen2: with biases): the same greedy tokens
    as the modules one by one, and the grouped launch really ran (two per layer and step)."""
    _graphs_or_skip()
    from jetrl_trainer.kernels import triton_decode_gemm as dg
    from jetrl_trainer.tiny import build_tiny_qwen2

    build = build_tiny_qwen2 if arch == "qwen2" else build_tiny_qwen3
    model, tok = build(tokenizer()).cuda().eval(), tokenizer()
    quantize_model(model, train="fp8", rollout="fp8")
    calls = []
    real = dg.fp8_decode_gemm_grouped
    monkeypatch.setattr(dg, "fp8_decode_gemm_grouped", lambda *a, **kw: calls.append(len(a[2])) or real(*a, **kw))
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=[-1])
    grouped, calls_grouped, ungrouped = _grouped_then_ungrouped(model, PROMPTS, config, calls)
    assert sorted(set(calls_grouped)) == [2, 3] and len(calls_grouped) >= 2 * len(model.model.layers)
    assert grouped[0] == ungrouped[0] and not calls
    for a, b in zip(grouped[1], ungrouped[1]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


def test_qkv_group_takes_the_decode_kernel_up_to_its_row_limit(monkeypatch):
    """Above the recipe's decode_gemm.max_m rows only the q/k/v group keeps the grouped launch (up to QKV_MAX_ROWS):
    a 130-row batch (its graph bucket: 130 rows) runs it at 130 rows, gate/up never above 64 rows, and the greedy
    tokens are those of the modules one by one."""
    _graphs_or_skip()
    from jetrl_trainer.kernels import triton_decode_gemm as dg
    from jetrl_trainer.kernels.settings import DecodeGemmSettings
    from jetrl_trainer.rollout.engine.projections import QKV_MAX_ROWS

    model, tok = build_tiny_qwen3(tokenizer()).cuda().eval(), tokenizer()
    quantize_model(model, train="fp8", rollout="fp8")
    calls = []
    real = dg.fp8_decode_gemm_grouped
    monkeypatch.setattr(dg, "fp8_decode_gemm_grouped",
                        lambda *a, **kw: calls.append((len(a[2]), a[0].shape[0])) or real(*a, **kw))  # fmt: skip
    prompts = [PROMPTS[i % len(PROMPTS)] + [20 + i % 50] for i in range(130)]
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=[-1])
    grouped, calls, ungrouped = _grouped_then_ungrouped(model, prompts, config, calls)
    qkv_rows = {rows for n, rows in calls if n == 3}
    mlp_rows = {rows for n, rows in calls if n == 2}
    decode_max_m = DecodeGemmSettings().max_m
    assert 130 in qkv_rows and max(qkv_rows) <= QKV_MAX_ROWS and max(mlp_rows, default=0) <= decode_max_m, (qkv_rows, mlp_rows)
    assert grouped[0] == ungrouped[0]


def test_graphed_sampling_records_the_warped_logprobs():
    _graphs_or_skip()
    model, tok = _model("fp8"), tokenizer()
    warp = dict(temperature=0.7, top_k=12, top_p=0.9)
    config = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=tok.pad_token_id, **warp)
    budgets = [8, 3, 5, 1]  # rows leave their slots at different steps
    with PrecisionPhases(model).rollout():
        tokens, logprobs = DecodeEngine(model, settings=GRAPHS).generate(
            PROMPTS, config, eos_token_ids=[-1], seed=5, pad_token_id=0, row_budgets=budgets
        )
        assert [len(t) for t in tokens] == budgets
        for r, (t, lps) in enumerate(zip(tokens, logprobs)):
            ids = torch.tensor([PROMPTS[r] + t], device="cuda")
            logits = model(input_ids=ids).logits[:, len(PROMPTS[r]) - 1 : -1]
            expected = processed_logprobs(logits.float(), torch.tensor([t], device="cuda"), **warp)[0].cpu()
            assert torch.allclose(torch.tensor(lps), expected, atol=1e-2, rtol=0), r  # see above


def test_a_graph_replayed_after_an_optimizer_step_sees_the_new_weights():
    """The FP8 weight cache refreshes in place, so a captured graph reads the updated weights."""
    from jetrl_trainer.quant import QuantLinear

    layer = QuantLinear(256, 384, bias=False, device="cuda", dtype=torch.bfloat16, train="fp8", rollout="fp8")
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    with torch.no_grad(), PrecisionPhases(layer).rollout():
        layer(x)  # fill the cache, warm the kernels
        graph, static = torch.cuda.CUDAGraph(), torch.empty(16, 384, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static.copy_(layer(x))
        graph.replay()
        before = static.clone()
    layer(x.requires_grad_()).float().pow(2).sum().backward()
    opt.step()
    with torch.no_grad(), PrecisionPhases(layer).rollout():
        eager = layer(x.detach())  # refreshes the cache (in place)
        graph.replay()
    assert not torch.equal(before, eager)
    assert torch.equal(static, eager)


def test_kept_graphs_replay_the_weights_of_each_step():
    """keep_state on CUDA: the second rollout, after an optimizer step, replays the first one's
    graphs (no capture) and generates exactly what a fresh engine generates with the new weights."""
    _graphs_or_skip()
    tok = tokenizer()
    model = quantize_model(build_tiny_qwen3(tok).cuda().eval(), train="fp8", rollout="fp8")
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=[-1])
    kept = DecodeEngine(model, settings=GRAPHS, keep_state=True)

    def run(engine):
        with PrecisionPhases(model).rollout():
            return engine.generate(PROMPTS, config, eos_token_ids=[-1], seed=0, pad_token_id=0)

    first = run(kept)
    assert kept.last_stats["graphs_captured"] >= 1 and kept.last_stats["capture_seconds"] > 0
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2, fused=True)
    WeightCacheRefresh(model, opt)  # fused AdamW bumps no _version: the refresh marks the weights stale
    with PrecisionPhases(model).train():
        model(input_ids=torch.tensor([PROMPTS[0]], device="cuda")).logits.float().pow(2).mean().backward()
    opt.step()
    after = run(kept)
    assert kept.last_stats["reused_state"] and kept.last_stats["capture_seconds"] == 0.0
    fresh = run(DecodeEngine(model, settings=GRAPHS))
    assert after[0] == fresh[0] and after[0] != first[0]
    for a, b in zip(after[1], fresh[1]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


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


@pytest.mark.parametrize("arch", ["qwen3", "llama_bias"])
def test_fused_epilogues_change_no_bit(arch, monkeypatch):
    """Residual adds with the o / down split-K reductions inside the next fused RMSNorm, and the o
    projection's activation quant inside the attention kernel: the same tokens and the same
    log-probs, bit for bit, as the separate launches; and the fused kernels really ran. Heads of
    128 (the attention kernel's quant needs one 1x128 group per head); Llama with biases on q/k/v/o."""
    _graphs_or_skip()
    from jetrl_trainer.kernels import triton_decode_attention as attention
    from jetrl_trainer.kernels import triton_decode_gemm as dg
    from jetrl_trainer.kernels import triton_norm

    tok = tokenizer()
    model = _fp8_head128_model(arch, tok)
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

    _same_bits_with_and_without(model, tok, "fused_epilogues", fused_kernels_ran)
    assert calls == {"partials": 0, "add_norm": 0, "attention_quant": 0}


def _same_bits_with_and_without(model, tok, setting: str, check_on) -> None:
    """Sampled rollouts with the engine's ``setting`` on (then ``check_on()``) and off: the same tokens
    and log-probs, bit for bit."""
    config = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.0, pad_token_id=tok.pad_token_id)
    runs = []
    with PrecisionPhases(model).rollout():
        for on in (True, False):
            engine = DecodeEngine(model, settings=EngineSettings(decode_path="graphs", **{setting: on}))
            runs.append(engine.generate(PROMPTS * 2, config, eos_token_ids=[-1], seed=3, pad_token_id=0))
            if on:
                check_on()
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(torch.tensor(a), torch.tensor(b))


@pytest.mark.parametrize("arch", ["qwen3", "llama_bias"])
@pytest.mark.parametrize("min_groups", [1, 4])
def test_fused_qkv_reduce_changes_no_bit(arch, min_groups, monkeypatch):
    """``fused_qkv_reduce``: the grouped q/k/v launch leaves its split sums and the RoPE + KV-append
    launch reduces them (with Qwen3's q/k norms, or Llama's q/k/v biases): the same tokens and
    log-probs, bit for bit, as the GEMM's own reduction, and the fused launch really ran in every
    layer; with the shipped split length (one split here) the plain path runs instead."""
    _graphs_or_skip()
    from jetrl_trainer.kernels import triton_rope_append
    from jetrl_trainer.kernels.settings import DecodeGemmSettings
    from jetrl_trainer.quant import QuantLinear
    from jetrl_trainer.quant.recipe import FP8Recipe

    tok = tokenizer()
    model = _fp8_head128_model(arch, tok, hidden_size=512)  # K of 4 groups: q/k/v split in up to 4
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

    _same_bits_with_and_without(model, tok, "fused_qkv_reduce", reduced_in_the_rope_launch)
    assert not calls


def test_unified_mismatch_on_an_8b_shaped_model_is_no_larger_than_with_generate():
    """The issue's GPU check: an 8B-shaped random Qwen3 (36 layers, FP8 in both phases), 8 prompts of
    128 tokens, 256 sampled tokens, 3 seeds. Mean |Δlogp| against the FP8 training-phase forward:
    the engine's mean is at generate's level, within the seed-to-seed spread of either (0.02; on the
    H200 with torch 2.11 two runs gave 0.2445 / 0.2493 against 0.2447 / 0.2401, single seeds
    0.239-0.256), and well below the decode kernel's flash-order tiles, which sum in another order
    than the cuDNN attention torch picks there (0.325). Through 36 random layers any difference in
    summation order grows to about this size: the decode GEMMs' order differs from the training
    forward's in both rollouts, so neither reaches 0."""
    _graphs_or_skip()
    from torch.nn.attention import SDPBackend
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from jetrl_trainer.rollout import generate_with_logprobs

    config = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                         max_position_embeddings=4096, dtype=torch.bfloat16)  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    quantize_model(model, train="fp8", rollout="fp8")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 150000, (128,), generator=g).tolist() for _ in range(8)]
    sampling = GenerationConfig(max_new_tokens=256, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                pad_token_id=0, eos_token_id=[-1])  # fmt: skip

    def mismatch(completions, logprobs) -> float:
        ids = torch.cat([torch.tensor(prompts), torch.tensor(completions)], 1).cuda()
        with PrecisionPhases(model).train():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=257).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 128:, None])[..., 0]
        return (lp.cpu() - torch.tensor(logprobs)).abs().mean().item()

    means = {}
    with torch.no_grad():
        for name in ("generate", "engine", "engine_flash_order"):
            values = []
            for seed in range(3):
                with PrecisionPhases(model).rollout():
                    if name == "generate":
                        torch.manual_seed(seed)
                        out = generate_with_logprobs(model, prompts, sampling, pad_token_id=0, eos_token_ids=[-1])
                    else:
                        order = SDPBackend.FLASH_ATTENTION if name == "engine_flash_order" else None
                        engine = DecodeEngine(model, settings=EngineSettings(attention_order=order))
                        out = engine.generate(prompts, sampling, eos_token_ids=[-1], seed=seed)
                values.append(mismatch(*out))
            means[name] = (sum(values) / 3, max(values))
    assert means["engine"][0] <= means["generate"][0] + 0.02, means
    if DecodeEngine(model).attention_arithmetic == dict(block_n=128, flash_order=False):  # torch picks cuDNN
        assert means["engine"][0] < 0.9 * means["engine_flash_order"][0], means
