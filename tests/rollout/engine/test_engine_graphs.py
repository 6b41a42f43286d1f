"""The decode step's CUDA graphs (graphs.py).

CPU: the buckets, and `DecodeGraphs`' own logic (a bucket captured once and replayed, rows padded
onto the scratch slot, the cache's lengths restored after a capture) with CUDA's graph and stream
calls replaced by stand-ins whose replay reruns the captured step, over the emulated kernels of
``_emulated_kernels.py``. GPU: real captures, replayed with the bits of the same launches made eagerly,
and the graphed engine against ``generate`` and the eager engine (look-ahead, sampling, kept graphs).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _cuda_engine import CUDA_PROMPTS, cuda_model, graphs_or_skip
from _emulated_kernels import emulate_kernels
from _trainer_utils import tokenizer
from transformers import GenerationConfig

from jetrl_trainer.quant import PrecisionPhases, WeightCacheRefresh, quantize_model
from jetrl_trainer.quant.fused import fuse_norm_and_swiglu
from jetrl_trainer.rollout import left_pad, processed_logprobs, truncate_after_eos
from jetrl_trainer.rollout.engine import DecodeEngine, EngineSettings
from jetrl_trainer.rollout.engine import engine as engine_module
from jetrl_trainer.rollout.engine import graphs
from jetrl_trainer.tiny import build_tiny_qwen3

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [5, 6, 7, 8, 9], [10, 11, 12], [7, 8]]
BUDGETS = [7, 2, 5, 1, 7, 3]  # rows leave at different steps: the live batch walks down the buckets


def _fp8_model(device="cpu"):
    torch.manual_seed(0)
    model = build_tiny_qwen3(tokenizer(), head_dim=128).to(device=device, dtype=torch.bfloat16).eval()
    return fuse_norm_and_swiglu(quantize_model(model, train="fp8", rollout="fp8"))


def _rollout(model, settings, **kwargs):
    config = GenerationConfig(max_new_tokens=7, do_sample=True, temperature=1.0, pad_token_id=0)
    engine = DecodeEngine(model, settings=settings, **kwargs)
    with PrecisionPhases(model).rollout():
        out = engine.generate(PROMPTS, config, eos_token_ids=[-1], seed=5, row_budgets=BUDGETS, max_batch_size=4)
    return engine, out


def _equal(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(torch.tensor(x), torch.tensor(y)) for x, y in zip(a[1], b[1]))


def test_buckets_double_up_to_the_slot_count():
    assert graphs._buckets(1) == [1]
    assert graphs._buckets(4) == [1, 2, 4]
    assert graphs._buckets(6) == [1, 2, 4, 6]
    assert graphs._buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def test_graphs_need_cuda_and_triton():
    assert not graphs.cuda_graphs_available(torch.device("cpu"))


class _StandInGraph:
    """``torch.cuda.CUDAGraph`` on CPU: the capture runs the step once; a replay reruns it and writes
    its outputs into the captured ones (as a replay writes the graph's static outputs)."""

    capturing: _StandInGraph | None = None

    def __init__(self) -> None:
        self.step, self.out, self.replays = None, None, 0

    def replay(self) -> None:
        self.replays += 1
        for static, new in zip(self.out, self.step()):
            static.copy_(new)


@pytest.fixture
def stand_in_cuda_graphs(monkeypatch):
    """CUDA's graph and stream calls for `DecodeGraphs` on CPU; every stand-in graph made."""
    made: list[_StandInGraph] = []

    @contextlib.contextmanager
    def capture(graph, pool=None):
        _StandInGraph.capturing = graph
        yield
        _StandInGraph.capturing = None

    run = graphs.DecodeGraphs._run

    def run_and_note(self, bucket):
        out = run(self, bucket)
        graph = _StandInGraph.capturing
        if graph is not None:
            graph.step, graph.out = (lambda: run(self, bucket)), out
            made.append(graph)
        return out

    class _Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(graphs.DecodeGraphs, "_run", run_and_note)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return made


def test_replays_of_one_capture_per_bucket_give_the_eager_kernels_bits(monkeypatch, stand_in_cuda_graphs):
    """Rows that leave at different steps run in buckets 4, 2 and 1, each captured once (on the scratch
    slot alone, the cache's lengths restored after) and replayed with the live rows padded onto the
    scratch slot: the same tokens and log-probs, bit for bit, as the same launches made eagerly."""
    model = _fp8_model()
    want = _rollout(model, EngineSettings(decode_path="torch"))[1]
    emulate_kernels(monkeypatch)
    monkeypatch.setattr(engine_module, "cuda_graphs_available", lambda device: True)
    eager = _rollout(model, EngineSettings(decode_path="kernels"))[1]
    engine, graphed = _rollout(model, EngineSettings(decode_path="graphs"), keep_state=True)
    assert _equal(graphed, eager) and _equal(graphed, want)
    state = engine._kept
    assert sorted(state.graphs.buckets) == [1, 2, 4] and engine.last_stats["graphs_captured"] == 3
    assert len(stand_in_cuda_graphs) == 3 and all(g.replays > 0 for g in stand_in_cuda_graphs)
    assert engine.last_stats["capture_seconds"] > 0
    assert state.cache.k.shape[1] == 5  # 4 slots and the scratch slot


def test_a_kept_state_replays_without_capturing_again(monkeypatch, stand_in_cuda_graphs):
    emulate_kernels(monkeypatch)
    monkeypatch.setattr(engine_module, "cuda_graphs_available", lambda device: True)
    model = _fp8_model()
    engine, first = _rollout(model, EngineSettings(decode_path="graphs"), keep_state=True)
    captured = len(stand_in_cuda_graphs)
    config = GenerationConfig(max_new_tokens=7, do_sample=True, temperature=1.0, pad_token_id=0)
    with PrecisionPhases(model).rollout():
        again = engine.generate(PROMPTS, config, eos_token_ids=[-1], seed=5, row_budgets=BUDGETS, max_batch_size=4)
    assert _equal(again, first) and len(stand_in_cuda_graphs) == captured
    assert engine.last_stats["reused_state"] and engine.last_stats["capture_seconds"] == 0.0


@pytest.mark.gpu
def test_graph_replays_give_the_eager_kernel_launches_bits_on_cuda():
    """On CUDA: the graphed engine's rollout equals the same kernels launched eagerly, bit for bit,
    through bucket changes; each bucket is captured once."""
    from jetrl_trainer.kernels import triton_available

    if not torch.cuda.is_available() or not triton_available():
        pytest.skip("needs CUDA and Triton")
    model = _fp8_model("cuda")
    engine, graphed = _rollout(model, EngineSettings(decode_path="graphs"), keep_state=True)
    _, eager = _rollout(model, EngineSettings(decode_path="kernels"))
    assert _equal(graphed, eager)
    assert sorted(engine._kept.graphs.buckets) == [1, 2, 4] and engine.last_stats["graphs_captured"] == 3


@pytest.mark.gpu
def test_the_fp8_plan_on_cuda_runs_every_fusion():
    """On an H100/H200 the real kernel modules load, so the FP8 model's plan fuses everything."""
    from jetrl_trainer.kernels import triton_available

    if not torch.cuda.is_available() or not triton_available():
        pytest.skip("needs CUDA and Triton")
    plan = DecodeEngine(_fp8_model("cuda")).plan
    assert {p.attention for p in plan.layers} == {"kernel+fp8"} and all(p.qkv_sums_to_rope for p in plan.layers)
    assert [p.down_sums_to_norm for p in plan.layers] == [True, False] and plan.layers[1].input_norm == "kernel+add"


# -- on CUDA, through the engine -----------------------------------------------------------------------------


GRAPHS, TORCH = EngineSettings(decode_path="graphs"), EngineSettings(decode_path="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_graphed_decode_matches_generate_and_the_eager_engine(precision):
    graphs_or_skip()
    model, tok = cuda_model(precision), tokenizer()
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=[-1])
    ids, mask = left_pad(CUDA_PROMPTS, tok.pad_token_id)
    with PrecisionPhases(model).rollout():
        out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), generation_config=config)
        expected, _ = truncate_after_eos(out[:, ids.shape[1] :].cpu(), torch.zeros(out.shape), [-1])
        engine = DecodeEngine(model)
        graphed, graphed_lp = engine.generate(CUDA_PROMPTS, config, eos_token_ids=[-1], seed=0, pad_token_id=0)
        refilled, _ = DecodeEngine(model, settings=GRAPHS).generate(CUDA_PROMPTS, config, eos_token_ids=[-1], seed=0,
                                                                    pad_token_id=0, max_batch_size=3)  # fmt: skip
        eager, eager_lp = DecodeEngine(model, settings=TORCH).generate(CUDA_PROMPTS, config, eos_token_ids=[-1], seed=0,
                                                                       pad_token_id=0)  # fmt: skip
    assert engine.settings.decode_path == "graphs" and graphed == expected == refilled == eager
    for a, b in zip(graphed_lp, eager_lp):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_graphed_look_ahead_records_each_rows_tokens_up_to_its_eos_or_budget():
    """On CUDA step t + 1 really runs while the host reads step t (pinned copies, events): with slots
    refilled, EOS and budgets, each row stops at its first EOS or its budget, and the rollout is the
    eager kernels' bit for bit (the same launches, with the host far slower to catch up)."""
    graphs_or_skip()
    model, tok = cuda_model("fp8"), tokenizer()
    config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.0, pad_token_id=tok.pad_token_id)
    budgets = [12, 3, 7, 1, 12, 5, 2, 9]
    runs = []
    with PrecisionPhases(model).rollout():
        for path in ("graphs", "kernels"):
            engine = DecodeEngine(model, settings=EngineSettings(decode_path=path))
            runs.append(engine.generate(CUDA_PROMPTS * 2, config, eos_token_ids=[tok.eos_token_id], seed=4, pad_token_id=0,
                                        max_batch_size=3, row_budgets=budgets))  # fmt: skip
    assert _equal(runs[0], runs[1])
    for tokens, budget in zip(runs[0][0], budgets):
        assert len(tokens) <= budget and tok.eos_token_id not in tokens[:-1]
        assert len(tokens) == budget or tokens[-1] == tok.eos_token_id


@pytest.mark.gpu
def test_graphed_sampling_records_the_warped_logprobs():
    graphs_or_skip()
    model, tok = cuda_model("fp8"), tokenizer()
    warp = dict(temperature=0.7, top_k=12, top_p=0.9)
    config = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=tok.pad_token_id, **warp)
    budgets = [8, 3, 5, 1]  # rows leave their slots at different steps
    with PrecisionPhases(model).rollout():
        tokens, logprobs = DecodeEngine(model, settings=GRAPHS).generate(
            CUDA_PROMPTS, config, eos_token_ids=[-1], seed=5, pad_token_id=0, row_budgets=budgets
        )
        assert [len(t) for t in tokens] == budgets
        for r, (t, lps) in enumerate(zip(tokens, logprobs)):
            ids = torch.tensor([CUDA_PROMPTS[r] + t], device="cuda")
            logits = model(input_ids=ids).logits[:, len(CUDA_PROMPTS[r]) - 1 : -1]
            expected = processed_logprobs(logits.float(), torch.tensor([t], device="cuda"), **warp)[0].cpu()
            assert torch.allclose(torch.tensor(lps), expected, atol=1e-2, rtol=0), r  # see above


@pytest.mark.gpu
def test_kept_graphs_replay_the_weights_of_each_step():
    """keep_state on CUDA: the second rollout, after an optimizer step, replays the first one's
    graphs (no capture) and generates exactly what a fresh engine generates with the new weights."""
    graphs_or_skip()
    tok = tokenizer()
    model = quantize_model(build_tiny_qwen3(tok).cuda().eval(), train="fp8", rollout="fp8")
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=[-1])
    kept = DecodeEngine(model, settings=GRAPHS, keep_state=True)

    def run(engine):
        with PrecisionPhases(model).rollout():
            return engine.generate(CUDA_PROMPTS, config, eos_token_ids=[-1], seed=0, pad_token_id=0)

    first = run(kept)
    assert kept.last_stats["graphs_captured"] >= 1 and kept.last_stats["capture_seconds"] > 0
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2, fused=True)
    WeightCacheRefresh(model, opt)  # fused AdamW bumps no _version: the refresh marks the weights stale
    with PrecisionPhases(model).train():
        model(input_ids=torch.tensor([CUDA_PROMPTS[0]], device="cuda")).logits.float().pow(2).mean().backward()
    opt.step()
    after = run(kept)
    assert kept.last_stats["reused_state"] and kept.last_stats["capture_seconds"] == 0.0
    fresh = run(DecodeEngine(model, settings=GRAPHS))
    assert after[0] == fresh[0] and after[0] != first[0]
    for a, b in zip(after[1], fresh[1]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)
