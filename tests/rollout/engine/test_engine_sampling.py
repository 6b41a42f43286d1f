"""The engine's two-level inverse-CDF draw against the one-level FP64 cumulative sum it replaces."""

from __future__ import annotations

import pytest
import torch

from jetrl_trainer.rollout.engine.sampling import CDF_BLOCK, inverse_cdf_sample, pick_in_block


def one_level(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference draw (a full FP64 cumulative sum), its cumulative sums and the targets."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = u.to(torch.float64) * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1), cdf, target


def warped_probs(rows: int, vocab: int, keep: int, seed: int) -> torch.Tensor:
    """Softmax of random scores with all but the top ``keep`` of each row removed (probability 0)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=g) * 4
    kth = scores.topk(keep, dim=-1).values[:, -1:]
    return torch.softmax(scores.masked_fill(scores < kth, float("-inf")), dim=-1)


def assert_same_draw_except_at_edges(probs, u, block=CDF_BLOCK):
    got = inverse_cdf_sample(probs, u, block)
    want, cdf, target = one_level(probs, u)
    differ = (got != want).nonzero().flatten()
    for row in differ.tolist():  # only where the target sits within FP64 rounding of a step edge
        edge = cdf[row, want[row] - 1] if want[row] > 0 else torch.tensor(0.0, dtype=torch.float64)
        assert min(abs(edge - target[row]), abs(cdf[row, want[row]] - target[row])) < 1e-12, row
    assert differ.numel() <= max(1, probs.shape[0] // 100)
    assert bool((probs.gather(1, got[:, None]) > 0).all()), "a removed token was drawn"
    return got


@pytest.mark.parametrize("vocab, block", [(5000, CDF_BLOCK), (4096, CDF_BLOCK), (777, 64), (300, 1000), (64, 1)])
def test_two_level_draw_equals_the_one_level_cumulative_sum(vocab, block):
    """Ragged and exact block counts, one block larger than the vocabulary, blocks of one entry."""
    g = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(256, vocab, generator=g) * 3, dim=-1)
    u = (torch.randint(0, 2**32, (256,), generator=g, dtype=torch.int64).double() + 0.5) / 2**32
    assert_same_draw_except_at_edges(probs, u, block)


def test_removed_tokens_are_never_drawn_even_at_the_extreme_uniforms():
    """top-k leaves 3 of 3000 entries; u from the smallest to the largest value the hash can give."""
    probs = warped_probs(rows=200, vocab=3000, keep=3, seed=1)
    u = torch.linspace(0.5 / 2**32, 1 - 0.5 / 2**32, 200, dtype=torch.float64)
    got = assert_same_draw_except_at_edges(probs, u, block=128)
    assert len(set(got.tolist())) > 3


def test_frequencies_over_a_grid_of_uniforms_are_those_of_the_distribution():
    """One row, 20,000 evenly spaced uniforms: each token is drawn as often as the one-level draw
    draws it, and that count is its probability's share of the grid to within one."""
    probs = torch.tensor([[0.05, 0.0, 0.3, 0.15, 0.0, 0.0, 0.25, 0.25]]).expand(20000, 8).contiguous()
    u = (torch.arange(20000, dtype=torch.float64) + 0.5) / 20000
    got = inverse_cdf_sample(probs, u, block=3)
    counts = torch.bincount(got, minlength=8)
    assert counts.tolist() == torch.bincount(one_level(probs, u)[0], minlength=8).tolist()
    assert (counts - probs[0].double() * 20000).abs().max() <= 1


def test_a_target_past_the_blocks_running_sum_takes_its_last_nonzero_entry():
    """The block sum said the target is inside, the entry-by-entry sum ends an ulp below it."""
    inner = torch.tensor([[0.1, 0.2, 0.0, 0.0], [0.0, 0.5, 0.25, 0.0]], dtype=torch.float32)
    before = torch.zeros(2, 1, dtype=torch.float64)
    running_end = inner.double().sum(-1, keepdim=True)
    past = torch.nextafter(running_end, torch.full_like(running_end, 2.0))
    assert pick_in_block(inner, before, past).flatten().tolist() == [1, 2]
    inside = running_end / 2  # row 0: 0.15 falls on entry 1; row 1: 0.375 on entry 1
    assert pick_in_block(inner, before, inside).flatten().tolist() == [1, 1]


@pytest.mark.gpu
def test_two_level_draw_on_cuda_at_an_8b_vocabulary():
    """Batch 64 over Qwen3's 151,936 entries, top-k and plain, on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for keep in (151936, 50):
        probs = warped_probs(rows=64, vocab=151936, keep=keep, seed=keep).cuda()
        u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).cuda()
        assert_same_draw_except_at_edges(probs, u)


def test_block_sums_refuse_what_the_kernel_cannot_take():
    from jetrl_trainer.kernels.triton_sampling import block_sums_fp64

    with pytest.raises(ValueError, match="CUDA tensor"):
        block_sums_fp64(torch.rand(2, 8), 4)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="power of two"):
            block_sums_fp64(torch.rand(2, 8, device="cuda"), 3)


@pytest.mark.gpu
def test_block_sums_kernel_equals_fp64_sums_and_ignores_the_batch():
    """The kernel's sums equal torch's FP64 block sums to FP64 rounding; a row's sums are the same
    bits alone and in a batch of 64 (a ragged last block: 151,936 = 148 x 1024 + 384)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from jetrl_trainer.kernels.triton_sampling import block_sums_fp64
    from jetrl_trainer.rollout.engine.sampling import block_sums

    probs = warped_probs(rows=64, vocab=151936, keep=151936, seed=5).cuda()
    got = block_sums_fp64(probs, CDF_BLOCK)
    assert got.shape == (64, 149) and got.dtype == torch.float64
    padded = torch.nn.functional.pad(probs.double(), (0, 149 * CDF_BLOCK - 151936))
    want = padded.view(64, 149, CDF_BLOCK).sum(-1)
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-300)
    assert torch.equal(block_sums_fp64(probs[7:8].contiguous(), CDF_BLOCK), got[7:8])
    assert torch.equal(block_sums(probs, CDF_BLOCK), got), "the sampler takes the kernel on CUDA"


# -- in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 pytest -m interpreter) -----------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("vocab, block", [(1000, 128), (1024, 256), (151_936 // 64, 1024)])
def test_block_sums_of_the_two_level_sampler(vocab, block):
    """The sampler's first level: FP64 sums of each block of an FP32 table, a ragged last block included."""
    from jetrl_trainer.kernels import triton_sampling
    from jetrl_trainer.rollout.engine.sampling import block_sums

    probs = torch.rand(3, vocab, generator=torch.Generator().manual_seed(vocab)).softmax(-1)
    got = triton_sampling._block_sums_op._init_fn(probs, block)
    want = block_sums(probs, block)  # on CPU tensors: the torch path the engine runs off CUDA
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-12, atol=0)
