"""JetGRPOConfig: defaults, normalisation, corrector parameters and every refused combination."""

from __future__ import annotations

import dataclasses

import pytest

from jetrl_trainer.config import CORRECTOR_PARAMS, PRECISIONS, JetGRPOConfig
from jetrl_trainer.correctors import AISCorrector, TISCorrector, available_correctors


def make(**kw) -> JetGRPOConfig:
    base = dict(output_dir="/tmp/jetrl-test-config", report_to="none", bf16=False, use_cpu=True)
    return JetGRPOConfig(**{**base, **kw})


def test_defaults_are_unified_fp8_without_corrector():
    cfg = make()
    assert (cfg.train_precision, cfg.rollout_precision, cfg.corrector) == ("fp8", "fp8", "none")
    assert cfg.corrector_params() == {}
    assert not cfg.corrector_active
    assert cfg.fp8_scale_format == "fp32" and cfg.nvfp4_backward == "dequantized"
    assert cfg.keep_last_n_layers_bf16 == 0 and cfg.keep_bf16_modules is None
    assert cfg.log_mismatch is True


def test_every_new_field_has_help_and_appears_in_the_docstring():
    base = {f.name for f in dataclasses.fields(JetGRPOConfig.__mro__[1])}
    new = [f for f in dataclasses.fields(JetGRPOConfig) if f.name not in base]
    ours = {"train_precision", "rollout_precision", "corrector", "corrector_clip", "corrector_low", "corrector_high",
            "corrector_level", "ais_delta", "ais_gamma", "ais_beta", "log_mismatch", "keep_last_n_layers_bf16",
            "keep_bf16_modules", "fp8_scale_format", "nvfp4_backward"}  # fmt: skip
    assert ours <= {f.name for f in new}
    for f in new:
        assert f.metadata.get("help"), f.name
        assert f"{f.name} (`" in JetGRPOConfig.__doc__, f.name


def test_names_are_normalised_case_and_spaces():
    cfg = make(train_precision=" BF16", rollout_precision="FP8", corrector="TIS", fp8_scale_format="UE8M0")
    assert (cfg.train_precision, cfg.rollout_precision, cfg.corrector) == ("bf16", "fp8", "tis")
    assert cfg.fp8_scale_format == "ue8m0"
    assert cfg.corrector_active


def test_corrector_params_map_to_get_corrector_keywords():
    cfg = make(corrector="ais", corrector_clip=3.0, ais_delta=0.1, ais_gamma=0.2, ais_beta=0.5, corrector_level="geometric")
    assert cfg.corrector_params() == {"clip": 3.0, "delta": 0.1, "gamma": 0.2, "beta": 0.5, "level": "geometric"}
    mis = make(corrector="mis", corrector_low=0.25, corrector_high=4.0)
    assert mis.corrector_params() == {"low": 0.25, "high": 4.0}


def test_param_table_covers_every_builtin_corrector():
    assert set(CORRECTOR_PARAMS) == set(available_correctors())


def test_a_corrector_instance_is_accepted_and_named():
    cfg = make(corrector=TISCorrector(clip=5.0))
    assert cfg.corrector_name == "tis" and cfg.corrector_active


def test_keep_bf16_modules_accepts_one_string():
    assert make(keep_bf16_modules="shared_expert").keep_bf16_modules == ["shared_expert"]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(train_precision="fp16"), "train_precision must be one of bf16, fp8, nvfp4"),
        (dict(rollout_precision="int8"), "rollout_precision must be one of"),
        (dict(fp8_scale_format="e8m0"), "fp8_scale_format must be one of fp32, ue8m0"),
        (dict(nvfp4_backward="fp32"), "nvfp4_backward must be one of dequantized, high_precision"),
        (dict(corrector="vtrace"), "Unknown corrector 'vtrace'; choose one of"),
        (dict(corrector="tis", corrector_low=0.3), "corrector_low does not apply to corrector='tis' (used by: mis)"),
        (dict(corrector="none", ais_delta=0.1), "ais_delta does not apply to corrector='none'"),
        (dict(corrector="mis", corrector_low=2.0, corrector_high=0.5), "must be below corrector_high"),
        (dict(corrector="mis", corrector_low=1.0, corrector_high=1.0), "must be below corrector_high"),
        (dict(corrector="mis", corrector_low=1.5, corrector_high=3.0), "0 <= low <= 1 <= high"),
        (dict(corrector="tis", corrector_clip=0.5), "clip must be >= 1.0"),
        (dict(corrector="ais", ais_delta=0.0), "delta must be > 0.0"),
        (dict(corrector="is", corrector_level="batch"), "level"),
        (dict(corrector=AISCorrector(), corrector_clip=2.0), "set its parameters on the instance"),
        (dict(corrector=TISCorrector), "pass an instance"),
        (dict(keep_last_n_layers_bf16=-1), "keep_last_n_layers_bf16 must be >= 0"),
        # vLLM rolls out BF16 only; the message names the flag the user set, not the backend it implies
        (dict(use_vllm=True), "use_vllm=True with rollout_precision='fp8' (the default) is not supported"),
        # exact log-probs: each unmet condition names the setting to change
        (dict(exact_logprobs=True), "exact_logprobs=True: only the decode engine records the training forward's bits: "
         "set rollout_backend='engine' (got 'auto')"),
        (dict(exact_logprobs=True, rollout_backend="engine", train_precision="bf16"),
         "it needs the unified flow, train_precision == rollout_precision (got 'bf16' and 'fp8')"),
        (dict(exact_logprobs=True, rollout_backend="engine", top_p=0.9), "leave top_k, top_p and min_p unset"),
        (dict(exact_logprobs=True, rollout_backend="engine", compile_policy_forward=True),
         "set compile_policy_forward=False"),
        (dict(exact_check_every=-1), "exact_check_every must be an integer >= 0 (0: never check); got -1."),
    ],
)
def test_bad_configs_name_the_fix(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        make(**kwargs)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "kwargs, first_line",
    [
        (dict(temperature=0.0), "temperature must be > 0; got 0.0."),
        (dict(generation_kwargs={"temperature": 0}), "generation_kwargs['temperature'] must be > 0; got 0."),
        (dict(generation_kwargs={"do_sample": False}),
         "generation_kwargs do_sample=False is not supported: greedy rollouts give every completion of a prompt the "
         "same tokens, hence the same reward and a zero advantage; remove it (GRPO samples)."),
        (dict(generation_kwargs={"typical_p": 0.9}),
         "generation_kwargs: generation_config.typical_p=0.9 is not supported with recorded sampling log-probs; only "
         "temperature, top_k, top_p and min_p are. Unset it (generation_kwargs)."),
        (dict(generation_kwargs='{"epsilon_cutoff": 0.001}'), "generation_kwargs: generation_config.epsilon_cutoff=0.001"),
        (dict(max_nonfinite_reward_batches=0),
         "max_nonfinite_reward_batches must be a positive integer, or None to never stop; got 0."),
    ],
)
def test_sampling_settings_the_rollouts_cannot_honour_are_refused_before_any_model_loads(kwargs, first_line):
    with pytest.raises(ValueError) as err:
        make(**kwargs)
    assert str(err.value).splitlines()[0].startswith(first_line), str(err.value)


def test_supported_generation_kwargs_and_a_small_temperature_pass():
    cfg = make(temperature=0.1, generation_kwargs={"num_beams": 2, "min_p": 0.05, "repetition_penalty": 1.1})
    assert cfg.generation_kwargs["num_beams"] == 2 and cfg.max_nonfinite_reward_batches == 3
    assert make(max_nonfinite_reward_batches=None).max_nonfinite_reward_batches is None


def test_corrector_none_means_no_corrector_and_the_card_says_so():
    from jetrl_trainer.hub import jetrl_card_metadata

    cfg = make(corrector=None)
    assert cfg.corrector == "none" and not cfg.corrector_active
    assert jetrl_card_metadata(cfg)["corrector"] == "none"  # before: "NoneType"


def test_every_precision_pair_is_accepted():
    for train in PRECISIONS:
        for rollout in PRECISIONS:
            cfg = make(train_precision=train, rollout_precision=rollout)
            assert (cfg.train_precision, cfg.rollout_precision) == (train, rollout)


def test_cli_parser_exposes_the_fields():
    from trl import TrlParser

    (cfg,) = TrlParser((JetGRPOConfig,)).parse_args_into_dataclasses(
        [
            "--output_dir", "/tmp/jetrl-test-config", "--report_to", "none", "--bf16", "false", "--use_cpu", "true",
            "--train_precision", "bf16", "--rollout_precision", "fp8", "--corrector", "mis",
            "--corrector_low", "0.4", "--corrector_high", "3", "--keep_bf16_modules", "a", "b",
        ]
    )  # fmt: skip
    assert (cfg.train_precision, cfg.rollout_precision, cfg.corrector) == ("bf16", "fp8", "mis")
    assert cfg.corrector_params() == {"low": 0.4, "high": 3.0}
    assert cfg.keep_bf16_modules == ["a", "b"]


def test_corrector_field_takes_a_name_on_the_cli_and_an_instance_from_python():
    import typing

    from transformers import HfArgumentParser

    parser = HfArgumentParser(JetGRPOConfig)
    (cfg,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "x", "--corrector", "tis", "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    )
    assert cfg.corrector == "tis"
    assert "Corrector instance" in parser.format_help()  # the help says what the CLI cannot take
    assert make(corrector=TISCorrector(clip=3.0)).corrector == TISCorrector(clip=3.0)
    # The parser sees `str` (one type per field); readers and type checkers see the union.
    assert typing.get_type_hints(JetGRPOConfig)["corrector"] is str
    assert JetGRPOConfig.__annotations__["corrector"] == "_CorrectorLike"


@pytest.mark.parametrize("fuse", [True, False])
def test_fuse_norm_quant_reaches_quantize_model(tmp_path, fuse):
    from _trainer_utils import make_trainer

    from jetrl_trainer.quant.fused import FusedRMSNorm

    trainer = make_trainer(tmp_path, fuse_norm_quant=fuse)
    fused = any(isinstance(m, FusedRMSNorm) for m in trainer.model.modules())
    assert fused is fuse
