"""pytest plugin: run TRL's own GRPO tests offline, against trl.GRPOTrainer or JetGRPOTrainer.

Load it with ``-p trl_compat_plugin`` (this folder on ``PYTHONPATH``); `run.py` does that and sets
the environment below. It holds no TRL code: the test files come from the TRL checkout given to
pytest.

Environment:
  TRL_COMPAT_CACHE  folder made by build_standins.py (its hf_home/ must also be HF_HOME, with
                    HF_HUB_OFFLINE=1, so that the trl-internal-testing/* model ids resolve).
  JET=1             swap the GRPO classes the test modules imported (``GRPOTrainer``,
                    ``GRPOConfig``) for ``JetGRPOTrainer`` and a ``JetGRPOConfig`` subclass.
  JET_STRATEGY      ``unified`` (default: train fp8, rollout fp8, corrector "none") or
                    ``baseline`` (train bf16, rollout fp8, corrector "tis"). The precisions and the
                    corrector become the *defaults* of the config class the tests construct, so a
                    test that sets them itself keeps its values (none of TRL's tests do).

Also here:
  * ``datasets.load_dataset("trl-internal-testing/zen", config, ...)`` reads the local parquet
    stand-ins (patched at import, before the test module binds ``load_dataset``); other
    ``trl-internal-testing/*`` data sets raise FileNotFoundError (no stand-in).
  * TRL_COMPAT_VOCAB=compact (default): tests whose source hard-codes Qwen special-token ids, and
    those in FULL_VOCAB_TESTS (they rely on a random model hardly ever sampling EOS), run against
    the full-vocabulary stand-ins (hf_home/hub_full), the others against the compact ones
    (hf_home/hub); =full: HF_HUB_CACHE should point at hf_home/hub_full (run.py --vocab full does).
  * TRL_COMPAT_SCORE_VALID_ONLY=1: a speed-up, see _patch_score_valid_only.
  * tests that need vision-language models or vLLM are deselected, for every run (DESELECTED).
  * availability helpers that the checkout's testing_utils imports but the installed trl lacks are
    added to trl.import_utils in this process (IMPORT_UTILS_SHIMS), so the test module imports.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
from pathlib import Path

import pytest

# ----------------------------------------------------------------------------- deselection

# (class name or None, test function name or None, reason). Matched on the collected item.
DESELECTED = [
    ("TestGRPOTrainerVLM", None,
     "vision-language models / multimodal prompts: JetGRPOTrainer refuses multimodal, and no VLM or zen-image "
     "stand-ins are built"),
    ("TestGRPOTrainerSlow", "test_vlm_training",
     "VLM (SmolVLM-Instruct from the Hub) + bitsandbytes + kernels, GPU"),
    ("TestGRPOTrainerSlow", "test_vlm_processor_vllm_colocate_mode", "VLM + vLLM (GPU)"),
    ("TestGRPOTrainerSlow", "test_train_vllm", "vLLM (GPU, Qwen/Qwen2.5-0.5B-Instruct); JetGRPOConfig refuses use_vllm"),
    (None, "test_train_vllm_and_peft", "vLLM; JetGRPOConfig refuses use_vllm"),
    (None, "test_train_vllm_structured_outputs", "vLLM; JetGRPOConfig refuses use_vllm"),
    (None, "test_train_vllm_importance_sampling_correction", "vLLM; JetGRPOConfig refuses use_vllm"),
    (None, "test_train_vllm_with_additional_generation_kwargs", "vLLM; JetGRPOConfig refuses use_vllm"),
]

STRATEGIES = {
    "unified": dict(train_precision="fp8", rollout_precision="fp8", corrector="none"),
    "baseline": dict(train_precision="bf16", rollout_precision="fp8", corrector="tis"),
}


def _deselect_reason(item) -> str | None:
    cls = getattr(item, "cls", None)
    cls_name = cls.__name__ if cls is not None else None
    func = getattr(item, "originalname", None) or item.name.split("[")[0]
    for want_cls, want_func, reason in DESELECTED:
        if (want_cls is None or want_cls == cls_name) and (want_func is None or want_func == func):
            return reason
    return None


# ----------------------------------------------------------------------------- data sets


def _patch_load_dataset() -> None:
    import datasets

    cache = os.environ.get("TRL_COMPAT_CACHE")
    if not cache:
        raise pytest.UsageError("TRL_COMPAT_CACHE is not set (run through tools/trl_compat/run.py)")
    zen = Path(cache) / "datasets" / "zen"
    original = datasets.load_dataset
    if getattr(original, "_trl_compat", False):
        return

    def load_dataset(path, name=None, *args, **kwargs):
        if isinstance(path, str) and path.startswith("trl-internal-testing/"):
            name = kwargs.pop("name", name)
            folder = zen / str(name)
            if path != "trl-internal-testing/zen" or not folder.is_dir():
                raise FileNotFoundError(f"trl_compat: no offline stand-in for data set {path!r}, config {name!r}")
            files = {p.stem: str(p) for p in sorted(folder.glob("*.parquet"))}
            return original("parquet", *args, data_files=files, **kwargs)
        return original(path, name, *args, **kwargs)

    load_dataset._trl_compat = True
    datasets.load_dataset = load_dataset


# ----------------------------------------------------------------------------- vocabularies

# Qwen special-token ids (151643 <|endoftext|> ... 151668 </think>) written into a test's source mean it
# fakes generations with real Qwen ids, so it needs the full-vocabulary stand-ins.
_QWEN_SPECIAL_ID = re.compile(r"(?<!\d)1516(?:4[3-9]|5\d|6[0-8])(?!\d)")


def _vocab_mode() -> str:
    mode = os.environ.get("TRL_COMPAT_VOCAB", "compact").strip().lower()
    if mode not in ("compact", "full"):
        raise pytest.UsageError(f"TRL_COMPAT_VOCAB must be compact or full; got {mode!r}")
    return mode


def _full_hub() -> str:
    return str(Path(os.environ["TRL_COMPAT_CACHE"]) / "hf_home" / "hub_full")


# Tests that rely on a random model (almost) never sampling EOS, which holds for a 151k-token vocabulary
# and not for a 4k one.
FULL_VOCAB_TESTS = {"test_train_with_mask_truncated_completions_all_masked"}


def needs_full_vocab(item) -> bool:
    if (getattr(item, "originalname", None) or item.name.split("[")[0]) in FULL_VOCAB_TESTS:
        return True
    function = getattr(item, "function", None)
    if function is None:
        return False
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return False
    return bool(_QWEN_SPECIAL_ID.search(source))


@pytest.fixture(autouse=True)
def _trl_compat_vocabulary(request, monkeypatch):
    """Point the Hub cache at the full-vocabulary stand-ins for a test that hard-codes Qwen ids."""
    if _vocab_mode() == "compact" and needs_full_vocab(request.node):
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", _full_hub())
    yield


# ----------------------------------------------------------------------------- version skew

# Availability helpers that the TRL checkout's tests/testing_utils.py imports but the installed trl
# may not define (the checkout and the installed package differ in version). Added to
# trl.import_utils in this process only, when missing; each reports whether the package imports.
IMPORT_UTILS_SHIMS = {"is_joblib_available": "joblib"}


def _shim_import_utils() -> list[str]:
    import importlib.util

    import trl.import_utils as import_utils

    added = []
    for name, package in IMPORT_UTILS_SHIMS.items():
        if not hasattr(import_utils, name):
            setattr(import_utils, name, lambda package=package: importlib.util.find_spec(package) is not None)
            added.append(name)
    return added


# ----------------------------------------------------------------------------- speed


def _score_valid_only() -> bool:
    return os.environ.get("TRL_COMPAT_SCORE_VALID_ONLY", "") not in ("", "0")


def _patch_score_valid_only() -> None:
    """TRL_COMPAT_SCORE_VALID_ONLY=1: TRL's fused lm_head log-probs score only the completion positions on CPU too.

    trl.trainer.utils decides with ``_use_triton(device)`` whether its chunked log-prob pass runs over the valid
    (completion) positions only, as on CUDA, or over every position of prompt + completion and masks afterwards, as
    elsewhere; the values at the completion positions are the same either way. With a 151k vocabulary and the tool
    tests' long prompts, the latter is most of a test's time on CPU. The flag flips only that decision (the kernel
    choice in trl.kernels.chunked_logprob is its own ``_use_triton`` and stays torch on CPU).
    """
    import trl.trainer.utils as trl_utils

    trl_utils._use_triton = lambda device: True


# ----------------------------------------------------------------------------- Jet swap


def _jet_enabled() -> bool:
    return os.environ.get("JET", "") not in ("", "0", "false", "False")


def _strategy() -> str:
    strategy = os.environ.get("JET_STRATEGY", "unified").strip().lower()
    if strategy not in STRATEGIES:
        raise pytest.UsageError(f"JET_STRATEGY must be one of {sorted(STRATEGIES)}; got {strategy!r}")
    return strategy


def _strategy_config_class(strategy: str):
    """A JetGRPOConfig subclass whose strategy fields default to ``STRATEGIES[strategy]``."""
    from jetrl_trainer import JetGRPOConfig

    values = STRATEGIES[strategy]
    name = f"JetGRPOConfig_{strategy}"
    namespace = {"__annotations__": {field: str for field in values}, **values, "__module__": __name__,
                 "__qualname__": name, "__doc__": f"JetGRPOConfig with the {strategy!r} strategy as defaults."}
    cls = dataclasses.dataclass(type(name, (JetGRPOConfig,), namespace))
    # The Trainer pickles its args (training_args.bin): the class must be found under its name here.
    setattr(sys.modules[__name__], name, cls)
    return cls


_SWAP: dict[str, object] = {}


def _install_swap():
    import trl
    import jetrl_trainer
    import jetrl_trainer.trainer as jet_trainer_module

    strategy = _strategy()
    config_cls = _strategy_config_class(strategy)
    _SWAP.update(
        strategy=strategy,
        trainer=jetrl_trainer.JetGRPOTrainer,
        config=config_cls,
        originals={"GRPOTrainer": trl.GRPOTrainer, "GRPOConfig": trl.GRPOConfig},
    )
    # JetGRPOTrainer(args=None) builds a default JetGRPOConfig (test_init_minimal); make that the strategy
    # class too, so every trainer of the run uses the run's strategy. Process-local, nothing is written.
    jet_trainer_module.JetGRPOConfig = config_cls


def _swap_module_globals(module) -> None:
    if module is None or getattr(module, "_trl_compat_swapped", False):
        return
    originals = _SWAP["originals"]
    replacements = {"GRPOTrainer": _SWAP["trainer"], "GRPOConfig": _SWAP["config"]}
    for name, new in replacements.items():
        if module.__dict__.get(name) is originals[name]:
            setattr(module, name, new)
    module._trl_compat_swapped = True


# ----------------------------------------------------------------------------- hooks


def pytest_configure(config):
    if not os.environ.get("HF_HUB_OFFLINE"):
        raise pytest.UsageError("HF_HUB_OFFLINE=1 must be set (and HF_HOME point at the stand-ins' hf_home)")
    _patch_load_dataset()
    config._trl_compat_shims = _shim_import_utils()
    if _score_valid_only():
        _patch_score_valid_only()
    if _jet_enabled():
        _install_swap()
    config.addinivalue_line("markers", "trl_compat: marker namespace of the trl_compat harness")


def pytest_report_header(config):
    lines = []
    if _jet_enabled():
        s = _strategy()
        import jetrl_trainer

        lines.append(f"trl_compat: JetGRPOTrainer, strategy {s} {STRATEGIES[s]}, from {Path(jetrl_trainer.__file__).parent}")
    else:
        lines.append("trl_compat: trl.GRPOTrainer (reference run)")
    lines.append(f"trl_compat: vocabularies {_vocab_mode()}" + (
        " (full-vocabulary stand-ins for the tests that hard-code Qwen token ids)" if _vocab_mode() == "compact" else ""))
    if _score_valid_only():
        lines.append("trl_compat: TRL_COMPAT_SCORE_VALID_ONLY=1 (fused lm_head log-probs over completion positions only)")
    shims = getattr(config, "_trl_compat_shims", [])
    if shims:
        lines.append(f"trl_compat: added to trl.import_utils (missing in the installed trl): {', '.join(shims)}")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    kept, dropped = [], []
    for item in items:
        (dropped if _deselect_reason(item) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    config._trl_compat_items = list(items)
    if _jet_enabled():
        for item in items:
            _swap_module_globals(getattr(item, "module", None))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _vocab_mode() == "compact":
        full = [item.nodeid.split("::", 1)[-1] for item in terminalreporter.config._trl_compat_items
                if needs_full_vocab(item)]
        terminalreporter.section("trl_compat full-vocabulary tests")
        for nodeid in full:
            terminalreporter.write_line(nodeid)
    reasons: dict[str, int] = {}
    for item in terminalreporter.stats.get("deselected", []):
        reason = _deselect_reason(item) or "?"
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("trl_compat deselected")
        for reason, n in reasons.items():
            terminalreporter.write_line(f"{n:4d}  {reason}")
