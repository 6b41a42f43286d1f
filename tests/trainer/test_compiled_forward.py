"""The opt-in compiled policy forward (``compile_policy_forward``): same log-probs and gradients as
eager on a padded batch, only the policy's train-phase forwards compiled (rollouts, reference models
and rollout-phase rescoring run the module's own forward), and a clean fallback where it cannot run.

On CPU the tests compile with ``aot_eager`` (the trace and the autograd graph, no code generation);
``benchmarks/bench_actor_update.py --captured`` measures the inductor path on the GPU."""

from __future__ import annotations

import logging

import pytest
import torch
from _trainer_utils import make_args, make_trainer, tiny_model, train

from jetrl_trainer.compiled_forward import CompiledBackbone, compile_unavailable_reason
from jetrl_trainer.quant.testing import relative_error

COMPILE = dict(compile_policy_forward=True, compile_backend="aot_eager", compile_length_multiple=16)


def _batch(vocab: int, rows: int = 3, prompt: int = 5, completion: int = 6):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows, prompt + completion), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    mask[1, -2:] = 0  # a completion that ended early
    return ids, mask, completion


@pytest.mark.parametrize(
    "precision, multiple, grad_tol",
    [
        ("bf16", 16, 1e-5),
        ("fp8", 1, 0.0),  # no padding: the compiled trace is the eager computation, bit for bit
        # Padded: the pad positions' activations join the 1x128 token groups that WGrad quantizes
        # along tokens (as TRL's own completion padding does), so FP8 gradients move by ~1%.
        ("fp8", 16, 3e-2),
    ],
)
def test_compiled_forward_gives_the_eager_logps_and_gradients(tmp_path, precision, multiple, grad_tol):
    options = {**COMPILE, "compile_length_multiple": multiple}
    trainers = [make_trainer(tmp_path / str(c), train_precision=precision, rollout_precision=precision,
                             **(options if c else {})) for c in (False, True)]  # fmt: skip
    ids, mask, T = _batch(trainers[0].model.config.vocab_size)
    results = []
    for trainer in trainers:
        trainer.model.load_state_dict(trainers[0].model.state_dict())
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T)
        logps.masked_fill(mask[:, -T:] == 0, 0).sum().backward()
        results.append((logps.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}))
    assert trainers[1].policy_scorer.compiled is not None and trainers[0].policy_scorer.compiled is None
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert compiled.shape == eager.shape == (3, T)
    live = mask[:, -T:].bool()
    assert torch.allclose(compiled[live], eager[live], atol=1e-5, rtol=0)  # 11 tokens, padded to 16 or not
    assert eager_grads.keys() == compiled_grads.keys() and eager_grads
    for name, grad in eager_grads.items():
        if grad_tol == 0.0:
            assert torch.equal(compiled_grads[name], grad), name
        else:
            assert relative_error(compiled_grads[name], grad) < grad_tol, name


def test_only_the_policys_train_phase_forwards_are_compiled(tmp_path):
    trainer = make_trainer(tmp_path, **COMPILE)
    compiled = trainer.policy_scorer.compiled
    backbone = trainer.model.model
    calls = []
    compiled._compiled = lambda *a, **k: calls.append(1) or type(backbone).forward(backbone, *a, **k)
    ids, mask, T = _batch(trainer.model.config.vocab_size)
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T)
    assert calls and "forward" not in backbone.__dict__  # restored: generate and the engine run the module's own
    calls.clear()
    with trainer.precision_phases.rollout():
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T)
    other = make_trainer(tmp_path / "ref").model  # e.g. a reference model
    trainer._get_per_token_logps_and_entropies(other, ids, mask, T)
    assert not calls
    assert not compiled.applies_to(other) and compiled.applies_to(trainer.model)


def test_padding_to_the_length_multiple():
    model = tiny_model()
    compiled = CompiledBackbone(model, length_multiple=8)
    ids, mask, pad = compiled.pad(torch.ones(2, 11, dtype=torch.long), torch.ones(2, 11, dtype=torch.long))
    assert pad == 5 and ids.shape == mask.shape == (2, 16) and not mask[:, 11:].any()
    assert compiled.pad(ids, mask)[2] == 0
    with pytest.raises(ValueError, match="length_multiple"):
        CompiledBackbone(model, length_multiple=0)


def test_gradient_checkpointing_falls_back_with_the_reason(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="jetrl_trainer"):
        trainer = make_trainer(tmp_path, gradient_checkpointing=True, **COMPILE)
    assert trainer.policy_scorer.compiled is None
    assert "gradient checkpointing" in caplog.text and "eagerly" in caplog.text
    assert "gradient checkpointing" in compile_unavailable_reason(trainer.model, True)


def test_config_refuses_a_bad_length_multiple(tmp_path):
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="compile_length_multiple must be a positive integer"):
            make_args(tmp_path, compile_policy_forward=True, compile_length_multiple=bad)


def test_trainer_trains_with_a_compiled_forward(tmp_path):
    trainer = make_trainer(tmp_path, train_precision="fp8", rollout_precision="fp8", max_steps=2, **COMPILE)
    first, _ = train(trainer)
    assert trainer.state.global_step == 2 and torch.isfinite(torch.tensor(first["loss"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inductor_compiled_forward_on_cuda(tmp_path):
    """The shipped backend (inductor) on the GPU: FP8 quant ops inside the compiled graph, log-probs
    as eager's, and a backward through it."""
    from jetrl_trainer import kernels

    if not kernels.triton_available():
        pytest.skip("needs Triton")
    # Inductor's compile workers are subprocesses; under pytest-xdist, next to seven other GPU
    # workers, one crashed with a segfault on the H200 (2026-12-02). Compiling in-process avoids them.
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        _compare_compiled_and_eager(tmp_path)


def _compare_compiled_and_eager(tmp_path) -> None:
    trainers = [make_trainer(tmp_path / str(c), model=tiny_model().cuda(), train_precision="fp8",
                             rollout_precision="fp8", bf16=False, use_cpu=False,
                             **({"compile_policy_forward": True, "compile_length_multiple": 16} if c else {}))
                for c in (False, True)]  # fmt: skip
    ids, mask, T = (t.cuda() if torch.is_tensor(t) else t for t in _batch(trainers[0].model.config.vocab_size))
    out = []
    for trainer in trainers:
        trainer.model.load_state_dict(trainers[0].model.state_dict())
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T)
        logps.masked_fill(mask[:, -T:] == 0, 0).sum().backward()
        out.append(logps.detach())
    live = mask[:, -T:].bool()
    assert trainers[1].policy_scorer.compiled._compiled is not None
    assert torch.allclose(out[1][live], out[0][live], atol=1e-3, rtol=0)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainers[1].model.parameters() if p.requires_grad)


def test_config_checks_the_compile_mode(tmp_path):
    assert make_args(tmp_path, compile_mode=" Reduce-Overhead ").compile_mode == "reduce-overhead"
    assert make_args(tmp_path).compile_mode is None
    with pytest.raises(ValueError, match="compile_mode must be one of"):
        make_args(tmp_path, compile_policy_forward=True, compile_mode="fast")
    with pytest.raises(ValueError, match="compile_backend='inductor'"):  # aot_eager would drop the mode silently
        make_args(tmp_path, compile_policy_forward=True, compile_backend="aot_eager", compile_mode="reduce-overhead")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reduce_overhead_replays_read_the_updated_weights(tmp_path):
    """``compile_mode="reduce-overhead"``: the compiled forward and backward run as CUDA graphs (none
    skipped), their log-probs are eager's, and after an in-place weight update (what the optimizer
    step does) the replayed graphs compute with the new weights."""
    from torch._dynamo.utils import counters

    from jetrl_trainer import kernels

    if not kernels.triton_available():
        pytest.skip("needs Triton")
    import torch._inductor.config as inductor_config

    counters.clear()
    options = dict(compile_policy_forward=True, compile_length_multiple=16, compile_mode="reduce-overhead")
    with inductor_config.patch(compile_threads=1):
        trainers = [make_trainer(tmp_path / str(c), model=tiny_model().cuda(), train_precision="fp8",
                                 rollout_precision="fp8", bf16=False, use_cpu=False, **(options if c else {}))
                    for c in (False, True)]  # fmt: skip
        ids, mask, T = (t.cuda() if torch.is_tensor(t) else t for t in _batch(trainers[0].model.config.vocab_size))
        live = mask[:, -T:].bool()

        def logps_both() -> list[torch.Tensor]:
            out = []
            for trainer in trainers:
                trainer.model.zero_grad(set_to_none=True)
                logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T)
                logps.masked_fill(~live, 0).sum().backward()
                out.append(logps.detach()[live])
            return out

        trainers[1].model.load_state_dict(trainers[0].model.state_dict())
        for _ in range(3):  # cudagraph trees: warm-up, record, then replay
            before = logps_both()
        assert torch.allclose(before[1], before[0], atol=1e-3, rtol=0)
        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():  # the same in-place update on both models
            for (_, p), (_, q) in zip(trainers[0].model.named_parameters(), trainers[1].model.named_parameters()):
                step = 0.05 * p.abs().mean() * torch.randn(p.shape, device="cuda", generator=g)
                p.add_(step)
                q.add_(step)
        after = logps_both()
    assert (after[0] - before[0]).abs().max() > 1e-2  # the update moved the log-probs
    assert torch.allclose(after[1], after[0], atol=1e-3, rtol=0)  # and the replay followed it
    assert trainers[1].policy_scorer.compiled.mode == "reduce-overhead"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    from torch._inductor.cudagraph_trees import get_manager  # internal: proves graphs were recorded

    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values())


def test_reduce_overhead_starts_one_graph_step_per_scorer_call(tmp_path, monkeypatch):
    """Under ``reduce-overhead`` each scorer call (not each chunk of it) tells cudagraph trees that a new
    step begins, so the graph memory of the previous call's outputs may be reused."""
    trainer = make_trainer(tmp_path, **COMPILE)
    compiled = trainer.policy_scorer.compiled
    steps = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    ids, mask, T = _batch(trainer.model.config.vocab_size)
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T, batch_size=1)  # 3 chunks
    assert not steps  # torch's default mode: nothing to mark
    compiled.mode = "reduce-overhead"  # (aot_eager ignores the mode itself; the marking is ours)
    forwards, inner = [], compiled._compiled
    compiled._compiled = lambda *a, **k: forwards.append(1) or inner(*a, **k)
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T, batch_size=1)
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T)
    assert len(forwards) == 4 and len(steps) == 2  # 3 chunks + 1 forward, one step per call
