"""rollout_backend="vllm" at construction, without vLLM: what is accepted, what is refused and why."""

from __future__ import annotations

import pytest
import torch

from jetrl_trainer import JetGRPOConfig
from jetrl_trainer._composition import resolve_rollout_backend
from jetrl_trainer.rollout.vllm_backend import check_processed_logprobs

BASE = dict(report_to="none", bf16=False, use_cpu=True, rollout_precision="bf16")


def make(tmp_path, **kw) -> JetGRPOConfig:
    return JetGRPOConfig(output_dir=str(tmp_path), **{**BASE, **kw})


def test_use_vllm_and_rollout_backend_vllm_mean_the_same(tmp_path):
    by_flag, by_name = make(tmp_path, use_vllm=True), make(tmp_path, rollout_backend="vllm")
    assert (by_flag.rollout_backend, by_flag.use_vllm) == (by_name.rollout_backend, by_name.use_vllm) == ("vllm", True)
    # TRL's own IS correction stays off: the corrector replaces it.
    assert by_flag.vllm_importance_sampling_correction is False
    assert make(tmp_path, rollout_backend="vllm", corrector="tis", train_precision="fp8").corrector == "tis"
    assert make(tmp_path).use_vllm is False  # nothing changes for the other backends


def test_use_vllm_with_the_default_fp8_rollouts_names_the_flag_the_precision_and_both_fixes(tmp_path):
    with pytest.raises(ValueError) as err:
        JetGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, use_vllm=True)  # fp8 by default
    message = str(err.value)
    assert message.startswith("use_vllm=True with rollout_precision='fp8' (the default) is not supported: vLLM rolls "
                              "out its own BF16 copy of the model")  # fmt: skip
    assert "To keep vLLM, set rollout_precision='bf16'" in message
    assert "for FP8 rollouts on the policy's own modules, drop use_vllm=True and set rollout_backend='engine'" in message
    assert "rollout_backend='vllm'" not in message  # the user never wrote it


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(rollout_backend="vllm", rollout_precision="fp8"),
         "rollout_backend='vllm' with rollout_precision='fp8' (the default) is not supported"),
        (dict(use_vllm=True, rollout_precision="nvfp4"), "use_vllm=True with rollout_precision='nvfp4' is not supported"),
        (dict(use_vllm=True, rollout_precision="nvfp4"), "NVFP4 there would quantize the synced weights"),
        (dict(use_vllm=True, vllm_importance_sampling_correction=True), "token_truncate -> corrector='tis'"),
        (dict(use_vllm=True, rollout_backend="hf"), "use_vllm=True contradicts rollout_backend='hf'"),
        (dict(use_vllm=True, use_transformers_continuous_batching=True),
         "use_transformers_continuous_batching=True contradicts use_vllm=True; unset one of the two flags."),
        (dict(use_vllm=True, vllm_mode="server", use_cpu=True), "On CPU use vllm_mode='colocate'"),
        (dict(use_vllm=True, vllm_enable_sleep_mode=True, use_cpu=True), "leave it False on CPU"),
    ],
)
def test_unsupported_vllm_settings_are_refused_with_the_fix(tmp_path, kwargs, fragment):
    with pytest.raises(ValueError) as err:
        make(tmp_path, **kwargs)
    assert fragment in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_server_mode_is_refused_without_cuda_even_without_use_cpu(tmp_path):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        JetGRPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, rollout_precision="bf16",
                      use_vllm=True, vllm_mode="server")  # fmt: skip


def test_composition_resolves_vllm_for_causal_lms_only():
    assert resolve_rollout_backend("vllm", diffusion=False, continuous_batching=False)[0] == "vllm"
    with pytest.raises(ValueError, match=r"^rollout_backend='vllm' \(or use_vllm=True\) cannot sample a diffusion LM"):
        resolve_rollout_backend("vllm", diffusion=True, continuous_batching=False)


def test_a_server_without_processed_logprobs_is_refused():
    check_processed_logprobs({"model_config": {"logprobs_mode": "processed_logprobs"}})
    with pytest.raises(ValueError, match="logprobs_mode='raw_logprobs'.*--logprobs-mode processed_logprobs"):
        check_processed_logprobs({"model_config": {"logprobs_mode": "raw_logprobs"}})


def test_colocate_refuses_a_model_that_vllm_cannot_load_from_disk(tmp_path):
    from _trainer_utils import byte_reward, prompts, tiny_model, tokenizer
    from jetrl_trainer import JetGRPOTrainer

    model = tiny_model()
    model.name_or_path = ""  # built in memory: vLLM has no path to start from
    with pytest.raises(ValueError, match="save it first|Save it first"):
        JetGRPOTrainer(model, byte_reward, args=make(tmp_path, use_vllm=True), train_dataset=prompts(),
                       processing_class=tokenizer())  # fmt: skip
