"""WeightCacheRefresh (quant/refresh.py): an optimizer step refreshes the quantized weights only where registered."""

import pytest
import torch
from torch import nn

from jetrl_trainer._guard import NonFiniteGuard
from jetrl_trainer.quant import QuantLinear, WeightCacheRefresh, quantize_fp8_blocks
from jetrl_trainer.quant.recipe import get_recipe
from jetrl_trainer.quant.refresh import stepping_optimizer
from jetrl_trainer.quant.testing import assert_bits_equal

FP8 = {"train": "fp8", "rollout": "fp8"}


def _layer(seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    return QuantLinear.from_linear(nn.Linear(256, 128), FP8)


def _fused_step(layer: QuantLinear) -> torch.optim.Optimizer:
    """A fused AdamW (it updates the weight without bumping ``_version``) with a gradient in place."""
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    layer(torch.randn(4, 256)).sum().backward()
    return optimizer


def _is_fresh(layer: QuantLinear) -> bool:
    w_q, w_s = layer.quantized_weight(get_recipe("fp8"))
    fresh_q, fresh_s = quantize_fp8_blocks(layer.weight.detach())
    return torch.equal(w_q.view(torch.uint8), fresh_q.view(torch.uint8)) and torch.equal(w_s, fresh_s)


def test_nothing_is_refreshed_at_a_distance():
    # No import-time hook: a step of an optimizer nobody registered leaves the cache as it was.
    layer = _layer()
    optimizer = _fused_step(layer)
    optimizer.step()
    assert not _is_fresh(layer) and layer.weight_quantizations == 1


def test_a_registered_refresh_requantizes_once_per_step_in_place():
    layer = _layer()
    optimizer = _fused_step(layer)
    refresh = WeightCacheRefresh(layer, optimizer)
    w_q, w_s = layer.quantized_weight(get_recipe("fp8"))
    optimizer.step()
    assert _is_fresh(layer) and layer.weight_quantizations == 2
    new_q, new_s = layer.quantized_weight(get_recipe("fp8"))
    assert new_q is w_q and new_s is w_s  # in place: a CUDA graph captured on them replays the new weights
    assert layer.weight_quantizations == 2
    refresh.remove()
    refresh.remove()  # idempotent
    optimizer.step()
    assert not _is_fresh(layer)


def test_only_the_registered_model_is_refreshed():
    layer, other = _layer(0), _layer(1)
    optimizer = _fused_step(layer)
    other(torch.randn(2, 256))
    WeightCacheRefresh(layer, optimizer)
    optimizer.step()
    for module in (layer, other):
        module(torch.randn(2, 256))
    assert layer.weight_quantizations == 2 and other.weight_quantizations == 1


def test_a_skipped_step_refreshes_nothing():
    layer = _layer()
    optimizer = _fused_step(layer)
    NonFiniteGuard().install(optimizer)
    WeightCacheRefresh(layer, optimizer)
    layer.weight.grad.fill_(float("nan"))
    optimizer.step()  # skipped by the guard: the weights, and so their quantization, are unchanged
    layer(torch.randn(2, 256))
    assert layer.weight_quantizations == 1 and _is_fresh(layer)


class _Wrapper:
    """What accelerate's AcceleratedOptimizer and DeepSpeed's ZeRO optimizers look like from outside
    (the trainer test runs accelerate's own)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.step()


def test_wrappers_are_unwrapped_to_the_optimizer_that_steps():
    layer = _layer()
    inner = _fused_step(layer)
    wrapped = _Wrapper(_Wrapper(inner))
    assert stepping_optimizer(wrapped) is inner
    refresh = WeightCacheRefresh(layer, wrapped)
    assert refresh.optimizer is inner and refresh.follows(wrapped) and refresh.follows(inner)
    assert not refresh.follows(torch.optim.SGD(layer.parameters(), lr=0.1))
    wrapped.step()
    assert _is_fresh(layer)
    with pytest.raises(TypeError, match="invalidate_weight_caches"):
        stepping_optimizer(_Wrapper(object()))


def test_equal_bits_after_the_refresh():
    layer = _layer()
    optimizer = _fused_step(layer)
    WeightCacheRefresh(layer, optimizer)
    optimizer.step()
    x = torch.randn(3, 256)
    fresh = QuantLinear.from_linear(nn.Linear(256, 128), FP8)
    with torch.no_grad():
        fresh.weight.copy_(layer.weight)
        fresh.bias.copy_(layer.bias)
        assert_bits_equal(layer(x), fresh(x), "y")
