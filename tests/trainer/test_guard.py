"""NonFiniteGuard: NaN/Inf losses or gradients skip the step and leave weights and Adam state alone."""

from __future__ import annotations

import math

import pytest
import torch

from jetrl_trainer._guard import NonFiniteGuard


def _setup(optim=torch.optim.AdamW):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    opt = optim(layer.parameters(), lr=0.1)
    guard = NonFiniteGuard()
    guard.install(opt)
    return layer, opt, guard


def _backward(layer, scale=1.0):
    layer.zero_grad()
    (layer(torch.ones(2, 4)).sum() * scale).backward()


def _snapshot(layer):
    return [p.detach().clone() for p in layer.parameters()]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_gradient_skips_the_step(bad):
    layer, opt, guard = _setup()
    _backward(layer)
    opt.step()  # one good step creates Adam state
    before, state_before = _snapshot(layer), [opt.state[p]["exp_avg"].clone() for p in layer.parameters()]
    _backward(layer, scale=bad)
    assert opt.step() is None
    assert guard.skipped_steps == 1
    for p, b in zip(layer.parameters(), before):
        assert torch.equal(p, b)
    for p, s in zip(layer.parameters(), state_before):
        assert torch.equal(opt.state[p]["exp_avg"], s) and int(opt.state[p]["step"]) == 1


def test_non_finite_loss_skips_even_with_finite_gradients():
    layer, opt, guard = _setup(torch.optim.SGD)
    _backward(layer)
    before = _snapshot(layer)
    guard.observe_loss(torch.tensor(float("nan")))
    opt.step()
    assert guard.skipped_steps == 1 and all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))
    opt.step()  # the flag is consumed by one decision: the next step goes through
    assert guard.skipped_steps == 1 and not torch.equal(layer.weight, before[0])


def test_finite_step_is_taken_exactly_as_without_the_guard():
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 3)
    guarded, opt_g, guard = _setup()
    opt_p = torch.optim.AdamW(plain.parameters(), lr=0.1)
    for layer, opt in ((plain, opt_p), (guarded, opt_g)):
        _backward(layer)
        opt.step()
    assert guard.skipped_steps == 0
    for a, b in zip(plain.parameters(), guarded.parameters()):
        assert torch.equal(a, b)


def test_install_is_idempotent_and_survives_an_lr_scheduler():
    layer, opt, guard = _setup()
    step = opt.step
    assert guard.install(opt) is opt and opt.step is step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # re-wraps step.__func__
    _backward(layer, scale=math.nan)
    opt.step()
    sched.step()
    assert guard.skipped_steps == 1


def test_decision_is_or_reduced_across_processes():
    seen = []

    def any_proc(flag):
        seen.append(flag)
        return True  # another rank saw a NaN

    layer = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    guard = NonFiniteGuard(any_proc)
    guard.install(opt)
    _backward(layer)
    before = _snapshot(layer)
    opt.step()
    assert seen == [False] and guard.skipped_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))


def test_gradients_finite_ignores_parameters_without_grad():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a.grad = torch.tensor([1.0, 2.0])
    assert NonFiniteGuard.gradients_finite([a, b])
    b.grad = torch.tensor([0.0, float("nan")])
    assert not NonFiniteGuard.gradients_finite([a, b])
    assert NonFiniteGuard.gradients_finite([])
