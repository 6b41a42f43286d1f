"""The batch-invariant ops of `jetrl_trainer.exact`: a row's bits depend on that row alone.

Each check computes a row in two calls of different shape (alone, among other rows, at another
place in a chunk, under another thread count) and compares with ``torch.equal``; the attention is
also checked against SDPA within FP32 rounding, so the exact arithmetic is still attention.
"""

from __future__ import annotations

import pytest
import torch
from _tensors import seeded_randn as _rand
import torch.nn.functional as F

from jetrl_trainer.exact import ROWS, ExactOps, exact_attention, exact_linear, row_invariant_matmul, row_mean

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (1536, 576), (64, 65), (128, 49152), (576, 1)])
def test_a_linear_row_is_the_same_alone_and_in_any_batch(device, dtype, k, n):
    weight = _rand(n, k, dtype=dtype, device=device, seed=1)
    x = _rand(70, k, dtype=dtype, device=device)
    full = exact_linear(x, weight)
    for rows in (1, 2, ROWS - 1, ROWS, ROWS + 1, 33):
        assert torch.equal(exact_linear(x[:rows], weight), full[:rows])
    for i in (0, 5, ROWS, 69):  # alone, so at chunk place 0 with zero rows around it
        assert torch.equal(exact_linear(x[i : i + 1], weight)[0], full[i])
    assert torch.allclose(full.float(), x.float() @ weight.float().T, rtol=2e-2, atol=2e-2)


def test_a_row_keeps_its_bits_under_another_thread_count():
    weight, x = _rand(300, 576, seed=1), _rand(40, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = exact_linear(x, weight)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(exact_linear(x, weight), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
def test_batched_matmul_rows_are_invariant(device):
    a, b = _rand(3, 50, 64, device=device), _rand(3, 64, 64, device=device, seed=2)
    full = row_invariant_matmul(a, b)
    assert torch.equal(row_invariant_matmul(a[:, 7:8], b), full[:, 7:8])
    assert torch.equal(row_invariant_matmul(a[1:2], b[1:2]), full[1:2])


@pytest.mark.parametrize("device", DEVICES)
def test_row_mean_is_row_invariant_and_a_mean(device):
    x = _rand(2, 37, 576, device=device)
    full = row_mean(x)
    assert full.shape == (2, 37, 1)
    assert torch.equal(row_mean(x[1:, 5:6]), full[1:, 5:6])
    assert torch.allclose(full, x.mean(-1, keepdim=True), atol=1e-6)


def _padded_batch(device, pads=(0, 5, 37), s=100, h=6, h_kv=2, d=64):
    q = _rand(len(pads), h, s, d, device=device)
    k = _rand(len(pads), h_kv, s, d, device=device, seed=1)
    v = _rand(len(pads), h_kv, s, d, device=device, seed=2)
    real = torch.arange(s, device=device)[None] >= torch.tensor(pads, device=device)[:, None]  # (B, S)
    valid = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None] & real[:, None, :]
    return q, k, v, valid, real


@pytest.mark.parametrize("device", DEVICES)
def test_attention_is_softmax_attention(device):
    q, k, v, valid, real = _padded_batch(device)
    out = exact_attention(q, k, v, valid, 0.125)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                         attn_mask=valid[:, None], scale=0.125)  # fmt: skip
    rows = real[:, None, :, None].expand_as(out)
    assert torch.allclose(out[rows], ref[rows], atol=1e-5)
    assert out.isfinite().all()  # the padding queries read no key and still give finite values


@pytest.mark.parametrize("device", DEVICES)
def test_a_decoded_query_equals_its_row_of_the_padded_batch(device):
    """One query over a cache that holds the row from its first real key (stale values after it)
    gives the bits of the same query inside the left-padded causal batch, at tile edges too."""
    q, k, v, valid, _ = _padded_batch(device)
    full = exact_attention(q, k, v, valid, 0.125)
    for b, pad in enumerate((0, 5, 37)):
        for i in sorted({pad, pad + 1, pad + 63, pad + 64, pad + 65, 99} - {100, 101, 102}):
            n = i + 1 - pad
            stale = _rand(1, 2, 30, 64, device=device, seed=3)
            kc = torch.cat([k[b : b + 1, :, pad : i + 1], stale], 2)
            vc = torch.cat([v[b : b + 1, :, pad : i + 1], stale], 2)
            live = (torch.arange(kc.shape[2], device=device) < n)[None, None, :]
            one = exact_attention(q[b : b + 1, :, i : i + 1], kc, vc, live, 0.125)
            assert torch.equal(one[0, :, 0], full[b, :, i]), (b, i)


def test_attention_has_a_gradient():
    q, k, v, valid, real = _padded_batch("cpu")
    q.requires_grad_()
    out = exact_attention(q, k, v, valid, 0.125)
    out[real[:, None, :, None].expand_as(out)].sum().backward()
    assert q.grad.isfinite().all() and q.grad.abs().sum() > 0


def test_the_mode_routes_linear_matmul_sdpa_and_the_norm_mean():
    x, weight = _rand(9, 576), _rand(100, 576, seed=1)
    with ExactOps():
        assert torch.equal(F.linear(x, weight), exact_linear(x, weight))
        assert torch.equal(x @ weight.T, row_invariant_matmul(x, weight.T))
        assert torch.equal(x.pow(2).mean(-1, keepdim=True), row_mean(x.pow(2)))
        total = x.mean()  # any other mean is torch's
        wide = x.double() @ weight.double().T  # float64 (the FP8 emulation's exact sums) passes through
    assert torch.equal(total, x.mean())
    assert torch.equal(wide, x.double() @ weight.double().T)


def _count_invariant_products(monkeypatch) -> list:
    """The shapes of the invariant products made from here on (the list grows as they run)."""
    from jetrl_trainer.exact import ops

    calls = []
    invariant = ops._invariant_matmul
    monkeypatch.setattr(ops, "_invariant_matmul", lambda a, b: calls.append(a.shape) or invariant(a, b))
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_the_backward_multiplies_with_torchs_products_not_the_invariant_ones(device, monkeypatch):
    """The mode stays on while autograd runs (gradient checkpointing recomputes the forward there), but a
    gradient need not be exact: the linear's dgrad and wgrad are plain matmuls (cuBLAS on CUDA, where
    the invariant kernel takes 2.3-2.9x its time at training sizes), and equal autograd's own."""
    calls = _count_invariant_products(monkeypatch)
    x = _rand(24, 64, dtype=torch.bfloat16, device=device).requires_grad_()
    weight = _rand(32, 64, dtype=torch.bfloat16, device=device, seed=1).requires_grad_()
    grad_out = _rand(24, 32, dtype=torch.bfloat16, device=device, seed=2)
    with ExactOps.entered():
        out = F.linear(x, weight)
        assert len(calls) == 1  # the forward's product is the invariant one
        (out.float() * grad_out.float()).sum().backward()
    assert len(calls) == 1
    assert torch.equal(x.grad, grad_out @ weight.detach())
    assert torch.equal(weight.grad, grad_out.T @ x.detach())


def test_a_checkpointed_linear_recomputes_its_forward_with_the_invariant_product(monkeypatch):
    """Non-reentrant checkpointing recomputes the forward when the backward unpacks its saved tensors:
    that recomputation must run the exact ops (it saves what the forward saved), though the gradient's
    own products are plain."""
    from torch.utils.checkpoint import checkpoint

    calls = _count_invariant_products(monkeypatch)
    x = _rand(24, 64, dtype=torch.bfloat16).requires_grad_()
    weight = _rand(32, 64, dtype=torch.bfloat16, seed=1).requires_grad_()
    with ExactOps.entered():
        out = checkpoint(lambda t: F.linear(t, weight).float().square(), x, use_reentrant=False)
        out.sum().backward()
    assert len(calls) == 2  # the forward and its recomputation; not the gradient's two products
    grads = x.grad, weight.grad
    x.grad = weight.grad = None
    with ExactOps.entered():
        F.linear(x, weight).float().square().sum().backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], weight.grad)


def test_entered_nests_without_stacking_a_second_mode():
    with ExactOps.entered():
        assert ExactOps.active()
        with ExactOps.entered():
            stack = torch.overrides._get_current_function_mode_stack()
        assert sum(isinstance(m, ExactOps) for m in stack) == 1
    assert not ExactOps.active()
    with ExactOps.entered(False):
        assert not ExactOps.active()


def test_active_on_a_thread_that_has_the_mode_but_not_the_entered_count():
    # Autograd's CUDA device thread during a checkpoint's recomputation: the caller's torch function mode
    # stack (with the ExactOps `_backward_in_mode` pushes), none of its thread-locals. Simulated with a
    # thread that pushes the mode itself, as the state propagation does.
    import threading

    seen = {}

    def device_thread():
        seen["before"] = ExactOps.active()
        with ExactOps():
            seen["with the mode"] = ExactOps.active()
        seen["after"] = ExactOps.active()

    with ExactOps.entered():
        worker = threading.Thread(target=device_thread)
        worker.start()
        worker.join()
    assert seen == {"before": False, "with the mode": True, "after": False}


def test_a_checkpointed_backward_recomputes_under_the_mode():
    # What the recomputation sees, on CPU (where autograd runs it on the calling thread): the same answer
    # as the forward, so the fused modules and FP8 linears take the same branch in both.
    seen = []

    def layer(x):
        seen.append(ExactOps.active())
        return x.square()

    x = torch.randn(4, 8, requires_grad=True)
    with ExactOps.entered():
        torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert seen == [True, True]


def test_dropout_in_attention_is_refused():
    q = _rand(1, 2, 4, 8)
    with ExactOps(), pytest.raises(ValueError, match="attention_dropout"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
