"""_rewards.py: what a reward function returns is checked where the trainer sees it; NaN/inf rewards are
missing rewards, counted, and fatal only after max_nonfinite_reward_batches consecutive batches."""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np
import pytest
import torch
from _trainer_utils import byte_reward, make_args, prompts, tiny_model, tokenizer, train
from torch import nn

from jetrl_trainer import JetGRPOTrainer
from jetrl_trainer._rewards import RewardChecks


def test_numbers_pass_and_non_finite_rewards_become_missing():
    checks = RewardChecks(max_bad_batches=None)
    out = checks.check("r", [1, 0.5, None, float("inf"), np.float32(2.0), torch.tensor(3.0), float("nan"), True])
    assert out == [1.0, 0.5, None, None, 2.0, 3.0, None, 1.0]
    assert checks.check("r", torch.tensor([0.25, -float("inf")])) == [0.25, None]
    assert checks.check("r", np.array([1.5])) == [1.5]
    assert checks.end_batch(torch.zeros(8, 1), [lambda **k: None], training=True) == 3.0


@pytest.mark.parametrize(
    "output, message",
    [
        (None, "reward function 'r' returned None; it must return a list with one float (or None to skip that "
               "completion) per completion."),
        (0.5, "reward function 'r' returned a float (0.5); it must return a list"),
        (["good", "bad"], "reward function 'r' returned a str ('good') at position 0; each reward must be a number, "
                          "or None to skip that completion."),
        ([1.0, [2.0]], "reward function 'r' returned a list ([2.0]) at position 1; each reward must be a number"),
    ],
)
def test_wrong_return_types_name_the_function_and_what_it_returned(output, message):
    with pytest.raises(TypeError) as err:
        RewardChecks(None).check("r", output)
    assert str(err.value).startswith(message)


def test_wrapping_keeps_the_name_and_async_functions_stay_async():
    checks = RewardChecks(None)

    def accuracy(completions, **kwargs):
        return [float("nan")] * len(completions)

    async def judge(completions, **kwargs):
        return [0.5] * len(completions)

    sync_checked, async_checked = checks.wrap_all([accuracy, judge], ["accuracy", "judge"])
    assert sync_checked.__name__ == "accuracy" and sync_checked(completions=["a", "b"]) == [None, None]
    assert asyncio.iscoroutinefunction(async_checked) and asyncio.run(async_checked(completions=["a"])) == [0.5]
    model = nn.Linear(2, 1)
    assert checks.wrap_all([model], ["rm"]) == [model], "reward models are checked on their outputs instead"


def test_reward_model_outputs_and_the_streak():
    checks = RewardChecks(max_bad_batches=2)
    rewards = torch.tensor([[1.0, 0.5], [float("inf"), 0.5], [float("nan"), 1.0]])
    funcs = [nn.Linear(2, 1), lambda **k: None]
    assert checks.end_batch(rewards, funcs, training=True) == 2.0
    assert rewards[1:, 0].isnan().all() and rewards[0, 0] == 1.0 and rewards[:, 1].tolist() == [0.5, 0.5, 1.0]
    assert checks.end_batch(torch.ones(3, 2), funcs, training=True) == 0.0 and checks.bad_streak == 0  # reset
    checks.end_batch(torch.full((3, 2), float("inf")), funcs, training=True)
    checks.end_batch(torch.full((3, 2), float("inf")), funcs, training=False)  # eval batches do not count
    with pytest.raises(RuntimeError) as err:
        checks.end_batch(torch.full((3, 2), float("inf")), funcs, training=True)
    assert str(err.value).startswith(
        "non-finite rewards (NaN or inf) in 2 consecutive generation batches, the last from: reward model 0 returned inf."
    )


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "jetrl_trainer" and r.levelno == logging.WARNING]


def test_the_first_non_finite_reward_of_each_function_warns_once_with_its_name_and_value(caplog):
    checks = RewardChecks(max_bad_batches=None)
    with caplog.at_level(logging.WARNING, logger="jetrl_trainer"):
        assert checks.check("accuracy", [1.0, float("-inf"), float("nan")]) == [1.0, None, None]
        assert checks.check("accuracy", [float("nan")]) == [None]  # a later batch: still dropped, not re-warned
        assert checks.check("length", [np.float64("nan"), 0.5]) == [None, 0.5]
        assert checks.check("format", [0.0, 1.0]) == [0.0, 1.0]
    warned = _warnings(caplog)
    assert len(warned) == 2
    assert warned[0].startswith("jetrl: reward function 'accuracy' returned -inf; a non-finite reward is dropped like None")
    assert warned[1].startswith("jetrl: reward function 'length' returned nan; a non-finite reward is dropped like None")
    assert checks.end_batch(torch.zeros(6, 1), [lambda **k: None], training=True) == 4.0  # every one still counted


def test_a_reward_models_first_non_finite_output_warns_once(caplog):
    checks, funcs = RewardChecks(max_bad_batches=None), [lambda **k: None, nn.Linear(2, 1)]
    with caplog.at_level(logging.WARNING, logger="jetrl_trainer"):
        for _ in range(2):
            rewards = torch.tensor([[1.0, 0.5], [1.0, float("inf")]])
            assert checks.end_batch(rewards, funcs, training=True) == 1.0
            assert rewards[1, 1].isnan() and rewards[0, 1] == 0.5
    assert [w.split(";")[0] for w in _warnings(caplog)] == ["jetrl: reward model 1 returned inf"]


# --------------------------------------------------------------------------------------------- in the trainer


def _trainer(tmp_path, reward, **overrides):
    args = make_args(tmp_path, train_precision="bf16", rollout_precision="bf16", **overrides)
    return JetGRPOTrainer(tiny_model(), reward, args=args, train_dataset=prompts(), processing_class=tokenizer())


def test_an_inf_reward_is_missing_and_the_rest_of_its_group_still_learns(tmp_path, caplog):
    """Before: reward=inf, every advantage of the group 0, loss 0, grad_norm 0."""

    def one_inf(completions, **kwargs):
        rewards = byte_reward(completions)
        rewards[0] = math.inf
        return rewards

    with caplog.at_level(logging.WARNING, logger="jetrl_trainer"):
        logs, _ = train(_trainer(tmp_path, one_inf, max_steps=2))
    assert logs["rewards/nonfinite"] == 1.0
    dropped = [w for w in _warnings(caplog) if "non-finite reward" in w]
    assert dropped == [dropped[0]] and dropped[0].startswith("jetrl: reward function 'one_inf' returned inf;")
    assert math.isfinite(logs["reward"]) and math.isfinite(logs["rewards/one_inf/mean"])
    assert logs["grad_norm"] > 0, "the other completions of the group keep their advantages"


def test_nan_rewards_stop_training_after_the_configured_streak(tmp_path):
    def broken(completions, **kwargs):
        return [math.nan] * len(completions)

    with pytest.raises(RuntimeError, match=r"^non-finite rewards \(NaN or inf\) in 1 consecutive generation batches, "
                                           r"the last from: reward function 'broken' returned nan\."):  # fmt: skip
        train(_trainer(tmp_path, broken, max_nonfinite_reward_batches=1))


@pytest.mark.parametrize(
    "reward, first_line",
    [
        (lambda completions, **kw: None, "reward function '<lambda>' returned None; it must return a list"),
        (lambda completions, **kw: ["good"] * len(completions),
         "reward function '<lambda>' returned a str ('good') at position 0; each reward must be a number"),
    ],
)
def test_a_reward_function_returning_none_or_strings_names_itself(tmp_path, reward, first_line):
    with pytest.raises(TypeError) as err:
        train(_trainer(tmp_path, reward))
    assert str(err.value).startswith(first_line)
