"""jetrl_trainer.study and examples/compare_strategies.py: names, spec, a --fast CLI run, resume, LLaDA.

Sizes are the smallest that still train: the whole file runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from jetrl_trainer import _choices, study
from jetrl_trainer._choices import STUDY_STRATEGIES, STUDY_STRATEGIES_NVFP4
from jetrl_trainer.study import Strategy, StudySpec, TinyModel, parse_strategies, parse_strategy, run_study

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "compare_strategies.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
FAST_ARGS = ("--fast", "--num_threads", "1")


def _script_module(script: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------- strategy names


def test_parse_strategy_normalises():
    assert parse_strategy(" BF16/FP8+AIS ") == Strategy("bf16", "fp8", "ais")
    assert parse_strategy("fp8/fp8+none") == parse_strategy("fp8/fp8") == Strategy("fp8", "fp8", "none")
    assert parse_strategy("fp8/fp8").name == "fp8/fp8" and parse_strategy("bf16/nvfp4+ais").slug == "bf16-nvfp4-ais"
    assert parse_strategy("bf16/fp8+tis").config_kwargs() == dict(train_precision="bf16", rollout_precision="fp8",
                                                                  corrector="tis")  # fmt: skip


def test_exact_and_plain_pin_the_exact_log_probs_of_a_unified_strategy():
    exact, plain, auto = parse_strategy(" FP8/FP8 @ Exact"), parse_strategy("fp8/fp8@plain"), parse_strategy("fp8/fp8")
    assert exact == Strategy("fp8", "fp8", "none", "exact") and exact.name == "fp8/fp8@exact"
    assert (exact.slug, plain.slug, auto.slug) == ("fp8-fp8-exact", "fp8-fp8-plain", "fp8-fp8")
    assert exact.config_kwargs()["exact_logprobs"] is True and plain.config_kwargs()["exact_logprobs"] is False
    assert "exact_logprobs" not in auto.config_kwargs()  # the trainer's auto
    assert parse_strategy("bf16/bf16+ais@plain").name == "bf16/bf16+ais@plain"


def test_default_sets_parse_to_their_own_names():
    assert study.STUDY_STRATEGIES is STUDY_STRATEGIES and study.TINY_ARCHS is _choices.TINY_ARCHS  # one definition
    assert study.GPU_STUDY_STRATEGIES is _choices.GPU_STUDY_STRATEGIES
    every = STUDY_STRATEGIES + STUDY_STRATEGIES_NVFP4 + _choices.GPU_STUDY_STRATEGIES
    for name in every:
        assert parse_strategy(name).name == name
    assert len({parse_strategy(n).slug for n in every}) == len(set(every)) == 13  # folders differ


@pytest.mark.parametrize(
    "name, match",
    [
        ("bf16", "must read 'train_precision/rollout_precision"),
        ("bf16/", "must read"),
        ("/fp8", "must read"),
        ("bf16/fp8+", "must read"),
        ("fp16/fp8", "train precision of strategy 'fp16/fp8' must be one of bf16, fp8, nvfp4; got 'fp16'"),
        ("bf16/int4", "rollout precision of strategy 'bf16/int4' must be one of"),
        ("bf16/fp8+clip", "corrector of strategy 'bf16/fp8\\+clip' must be one of ais, is, mis, none, tis"),
        ("fp8/fp8@on", "after '@' write 'exact' or 'plain'"),
        ("bf16/fp8@exact", "applies to the unified flow only .* 'fp8/fp8@exact'.* drop '@exact'"),
        (3, "a strategy is a string"),
    ],
)
def test_parse_strategy_errors(name, match):
    with pytest.raises(ValueError, match=match):
        parse_strategy(name)


def test_parse_strategies_lists_and_duplicates():
    assert [s.name for s in parse_strategies("bf16/bf16, fp8/fp8+ais,")] == ["bf16/bf16", "fp8/fp8+ais"]
    with pytest.raises(ValueError, match="'bf16/fp8' is listed twice"):
        parse_strategies(["bf16/fp8", "BF16/FP8+none"])
    with pytest.raises(ValueError, match="no strategies given"):
        parse_strategies(" , ")


def test_spec_validation():
    assert StudySpec(task="countdown", strategies=("BF16/FP8+none",)).strategies == ("bf16/fp8",)
    assert StudySpec(task="countdown", steps=12).window == 2
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        StudySpec(task="chess")
    with pytest.raises(ValueError, match="seeds must be distinct"):
        StudySpec(task="countdown", seeds=(1, 1))
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        StudySpec(task="countdown", num_generations=1)
    with pytest.raises(ValueError, match="eval_phase must be one of train, rollout"):
        StudySpec(task="countdown", eval_phase="eval")
    with pytest.raises(ValueError, match=r"trainer_kwargs must not set \['corrector'\]"):
        StudySpec(task="countdown", trainer_kwargs={"corrector": "tis"})
    with pytest.raises(ValueError, match=r"eval_samples must be a count >= 0 \(0: greedy evaluation only\)"):
        StudySpec(task="countdown", eval_samples=-1)
    # The default leaves a run's recorded settings as they were before the field existed, so finished runs
    # from then still resume and tabulate; asking for sampled scores makes it part of the run's identity.
    assert "eval_samples" not in StudySpec(task="countdown").run_settings()
    assert StudySpec(task="countdown", eval_samples=4).run_settings()["eval_samples"] == 4


# ---------------------------------------------------------------------------------- the CLI


def test_help_answers_without_importing_torch(tmp_path):
    code = ("import runpy, sys; sys.argv = ['compare_strategies.py', '--help']\n"
            f"try: runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            "except SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--fast" in done.stdout and "--stress" in done.stdout and "Comma-separated" in done.stdout
    assert done.stdout.rstrip().endswith("NO TORCH")


def test_presets_and_flags():
    cli = _script_module()
    fast = cli.parse(["--fast", "--steps", "5"])
    assert fast.steps == 5 and fast.seeds == "0" and fast.strategies.count(",") == 1  # the flag beats the preset
    spec, model = cli.build(cli.parse(["--stress", "--task", "sudoku", "--difficulty", "holes=8"]))
    assert spec.strategies == STUDY_STRATEGIES and spec.seeds == (0, 1, 2) and spec.difficulty == {"holes": 8}
    assert spec.temperature > 1.0 and spec.completion_length() > 24  # sudoku's own budget is 24
    assert isinstance(model, TinyModel) and model.warm_start_steps < cli.FULL["warm_start_steps"]
    assert len(cli.build(cli.parse(["--nvfp4"]))[0].strategies) == len(STUDY_STRATEGIES) + 2
    long = cli.build(cli.parse(["--task", "reverse", "--difficulty", "min_digits=150,max_digits=200"]))[0]
    assert long.completion_length() == 208  # the task's budget follows its length knob
    budget = cli.build(cli.parse(["--task", "reverse", "--max_completion_length", "64"]))[0]
    assert budget.completion_length() == 64
    chain = cli.build(cli.parse(["--task", "chain", "--difficulty", "min_terms=3,max_terms=4,digits=2"]))[0]
    assert chain.difficulty == {"min_terms": 3, "max_terms": 4, "digits": 2} and chain.completion_length() == 44


def test_the_gpu_preset_describes_a_local_03b_model_on_the_engine():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from jetrl_trainer.tiny import build_tiny_tokenizer

    cli = _script_module()
    args = cli.parse(["--gpu", "--device", "cpu", "--seeds", "3"])
    spec, model = cli.build(args)
    assert spec.trainer_kwargs == {"rollout_backend": "engine"} and spec.completion_length() == 256
    assert args.checkpoint_every == 10 and cli.parse([]).checkpoint_every is None  # runs longer than one call resume
    assert cli.parse(["--stop_after_seconds", "540"]).stop_after_seconds == 540
    assert spec.seeds == (3,) and spec.strategies == _choices.GPU_STUDY_STRATEGIES  # exactness pinned on CUDA
    assert cli.build(cli.parse(["--gpu", "--device", "cpu", "--strategies", "fp8/fp8@plain"]))[0].strategies == (
        "fp8/fp8@plain",)  # flags still beat the preset
    # 256 is a floor: chain's default answers need 266; a flag still sets any budget
    assert cli.parse(["--gpu", "--task", "chain"]).max_completion_length == 266
    assert cli.parse(["--gpu", "--task", "chain", "--max_completion_length", "100"]).max_completion_length == 100
    assert cli.parse(["--gpu", "--stress", "--task", "chain"]).max_completion_length == 64
    assert isinstance(model, TinyModel) and model.dtype == "bfloat16" and model.device == "cpu"
    overrides = dict(model.config_overrides)
    assert overrides["hidden_size"] == 1024 and overrides["num_hidden_layers"] == 24
    tokenizer = build_tiny_tokenizer()
    with torch.device("meta"):  # count the parameters without allocating them
        net = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), **overrides))
    assert sum(p.numel() for p in net.parameters()) > 0.3e9
    with pytest.raises(SystemExit, match="k=v pairs"):
        cli.build(cli.parse(["--model_overrides", "hidden_size"]))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            cli.build(cli.parse(["--gpu"]))


def test_model_overrides_build_a_larger_tiny_model_where_asked():
    import torch

    from jetrl_trainer.tasks import get_task

    model, _ = TinyModel("qwen3", warm_start_steps=0, config_overrides=(("num_hidden_layers", 3),))(
        seed=0, task=get_task("countdown"), max_completion_length=8, sft_dataset=None
    )
    assert model.config.num_hidden_layers == 3 and next(model.parameters()).device == torch.device("cpu")


@pytest.fixture(scope="module")
def fast_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), *FAST_ARGS, "--output_dir", str(out)], cwd=out.parent,
                          env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done


def _table(out: Path) -> dict[str, list[str]]:
    cells = {}
    for line in (out / "study.md").read_text().splitlines():
        match = re.match(r"\| `([^`]+)` \|(.*)\|$", line)
        if match:
            cells[match.group(1)] = [c.strip() for c in match.group(2).split("|")]
    return cells


def _untimed(rows: list[dict]) -> list[dict]:
    """A run's logged rows without the clock readings (step_time: TRL's), which no two runs share."""
    timing = ("time/step_s", "time/rollout_s", "time/train_s", "step_time")
    return [{k: v for k, v in r.items() if k not in timing} for r in rows]


def _read(folder: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((folder / "result.json").read_text())


def test_fast_run_writes_runs_table_and_plot(fast_study):
    out, done = fast_study
    assert "bf16/fp8+ais seed 0" in done.stderr and "fp8/fp8 seed 0" in done.stderr  # one tqdm bar per run
    assert (out / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = _table(out)
    assert list(table) == ["bf16/fp8+ais", "fp8/fp8"]
    for name, slug in (("bf16/fp8+ais", "bf16-fp8-ais"), ("fp8/fp8", "fp8-fp8")):
        rows, result = _read(out / slug / "seed0")
        assert [r["step"] for r in rows] == [1, 2, 3] and result["rows"] == 3 and result["strategy"] == name
        # every number of the row, recomputed from the metrics file and the result
        final = statistics.fmean(r["reward"] for r in rows[-1:])  # window = max(1, 3 // 5)
        seeds, reward, before, after, gain, eval_reward, dmean, dmax, rollout, train = table[name]
        assert seeds == "1" and reward == f"{final:.3f} ± 0.000"
        assert before == f"{result['eval_before']['accuracy']:.3f} ± 0.000"
        assert after == f"{result['eval_after']['accuracy']:.3f} ± 0.000" and result["eval_after"]["n"] == 16
        assert gain == f"{100 * (result['eval_after']['accuracy'] - result['eval_before']['accuracy']):+.1f}"
        assert eval_reward == f"{result['eval_after']['reward']:.3f} ± 0.000"
        assert dmean == f"{statistics.fmean(r['mismatch/logp_abs_diff_mean'] for r in rows):.2e}"
        assert dmax == f"{max(r['mismatch/logp_abs_diff_max'] for r in rows):.2e}"
        assert rollout == f"{statistics.median(r['time/rollout_s'] for r in rows):.2f}"
        assert train == f"{statistics.median(r['time/train_s'] for r in rows):.2f}"
        for r in rows:
            assert 0 < r["time/rollout_s"] < r["time/step_s"]
            assert r["time/train_s"] == pytest.approx(r["time/step_s"] - r["time/rollout_s"])
    ais_rows, _ = _read(out / "bf16-fp8-ais" / "seed0")
    unified_rows, _ = _read(out / "fp8-fp8" / "seed0")
    assert all(0 <= r["corrector/alpha"] <= 1 for r in ais_rows)
    assert min(r["mismatch/logp_abs_diff_mean"] for r in ais_rows) > 10 * max(
        r["mismatch/logp_abs_diff_mean"] for r in unified_rows
    )  # BF16 learner / FP8 sampler against the unified flow
    # Same seed, same warm start, same prompts, same FP8 sampler at step 1: the same completions.
    for key in ("reward", "completions/mean_length", "num_tokens"):
        assert ais_rows[0][key] == unified_rows[0][key], key


def test_the_accuracy_gain_is_paired_by_seed_with_a_student_t_interval():
    """Three seeds whose starts differ: the gain is each seed's after minus its own before (mean 12 points,
    not the difference of the means' spreads), its interval t(0.975, 2) = 4.303 x sd / sqrt(3); one seed
    gives no interval; a run without sampled answers leaves the sampled gain out."""
    from jetrl_trainer.study.summary import Run, format_row, mean_interval, summarize

    def run(seed: int, before: float, after: float, sampled: tuple[float, float] | None) -> Run:
        drawn = (lambda x: {"sampled_accuracy": x}) if sampled else (lambda x: {})
        rows = [{"reward": 0.5, "time/rollout_s": 1.0, "time/train_s": 1.0}]
        result = {"eval_before": {"accuracy": before, "reward": before, **drawn(sampled and sampled[0])},
                  "eval_after": {"accuracy": after, "reward": after, **drawn(sampled and sampled[1])}}  # fmt: skip
        return Run("bf16/bf16", seed, rows, result)

    runs = [run(0, 0.30, 0.40, (0.2, 0.3)), run(1, 0.50, 0.64, (0.3, 0.5)), run(2, 0.40, 0.52, (0.25, 0.4))]
    (row,) = summarize(runs, window=1)
    mean, half = row.eval_gain
    assert mean == pytest.approx(0.12) and half == pytest.approx(4.303 * 0.02 / 3**0.5)
    assert row.sampled_gain[0] == pytest.approx(0.15) and row.sampled_gain[1] == pytest.approx(4.303 * 0.05 / 3**0.5)
    cells = format_row(row, sampled=True).split(" | ")
    assert cells[5] == "+12.0 ± 5.0" and cells[9] == "+15.0 ± 12.4"
    assert mean_interval([0.1]) == (0.1, None) and format_row(summarize(runs[:1], 1)[0]).split(" | ")[5] == "+10.0"
    (row,) = summarize([run(0, 0.3, 0.4, None)], window=1)
    assert row.sampled_gain is None
    assert mean_interval([1.0] * 40)[1] == 0.0 and mean_interval([0.0, 1.0] * 20)[1] == pytest.approx(
        2.042 * statistics.stdev([0.0, 1.0] * 20) / 40**0.5)  # beyond 30 degrees of freedom: the value at 30


def test_resume_skips_finished_runs_and_redoes_unfinished_ones(fast_study, capsys, one_thread):
    out, _ = fast_study
    cli = _script_module()
    done_run, redo_run = out / "bf16-fp8-ais" / "seed0", out / "fp8-fp8" / "seed0"
    stamp = (done_run / "metrics.jsonl").stat().st_mtime_ns
    (redo_run / "result.json").unlink()  # as if killed before its done-marker
    assert cli.main([*FAST_ARGS, "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ran 1, skipped 1 finished" in printed
    assert (done_run / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert _read(redo_run)[1]["rows"] == 3
    assert cli.main([*FAST_ARGS, "--output_dir", str(out)]) == 0
    assert "ran 0, skipped 2 finished" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"finished run with another settings \(steps\)"):
        cli.main([*FAST_ARGS, "--output_dir", str(out), "--steps", "4"])
    with pytest.raises(SystemExit, match="finished run with another model"):
        cli.main([*FAST_ARGS, "--output_dir", str(out), "--warm_start_steps", "11"])


def _copy_without(out: Path, tmp_path: Path, unfinished: str) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / unfinished / "seed0" / "result.json").unlink()
    return copy


def test_report_only_runs_nothing_and_names_the_missing_runs(fast_study, tmp_path, capsys, one_thread):
    copy = _copy_without(fast_study[0], tmp_path, "fp8-fp8")
    stamp = (copy / "fp8-fp8" / "seed0" / "metrics.jsonl").stat().st_mtime_ns
    assert _script_module().main([*FAST_ARGS, "--output_dir", str(copy), "--report_only"]) == 0
    assert "ran 0, skipped 1 finished" in capsys.readouterr().out
    assert list(_table(copy)) == ["bf16/fp8+ais"]
    assert "**Not run:** fp8/fp8 seed 0 (this table covers the finished runs only)." in (copy / "study.md").read_text()
    assert (copy / "fp8-fp8" / "seed0" / "metrics.jsonl").stat().st_mtime_ns == stamp


def test_a_call_past_its_deadline_starts_no_run_and_says_how_to_continue(tmp_path, capsys, one_thread):
    out = tmp_path / "late"
    assert _script_module().main([*FAST_ARGS, "--output_dir", str(out), "--stop_after_seconds", "0"]) == 0
    printed = capsys.readouterr().out
    assert "stopped after 0 s; not finished: bf16/fp8+ais seed 0, fp8/fp8 seed 0" in printed
    assert "ran 0, skipped 0 finished, stopped 2 (run again to continue)" in printed
    assert not (out / "bf16-fp8-ais").exists() and "**Not run:**" in (out / "study.md").read_text()


def test_runs_record_their_start_and_a_differing_rebuilt_start_is_flagged(fast_study, tmp_path, capsys, one_thread):
    out = fast_study[0]
    starts = {_read(out / slug / "seed0")[1]["start_fingerprint"] for slug in ("bf16-fp8-ais", "fp8-fp8")}
    assert len(starts) == 1 and re.fullmatch(r"[0-9a-f]{16}", starts.pop())  # one warm start per seed
    copy = _copy_without(out, tmp_path, "fp8-fp8")
    cli = _script_module()
    assert cli.main([*FAST_ARGS, "--output_dir", str(copy)]) == 0  # the CPU warm start rebuilds bit for bit
    assert "differs" not in capsys.readouterr().out and "Warning" not in (copy / "study.md").read_text()
    finished = copy / "bf16-fp8-ais" / "seed0" / "result.json"
    finished.write_text(json.dumps({**json.loads(finished.read_text()), "start_fingerprint": "0" * 16}))
    (copy / "fp8-fp8" / "seed0" / "result.json").unlink()
    assert cli.main([*FAST_ARGS, "--output_dir", str(copy)]) == 0
    printed = capsys.readouterr().out
    assert "warning: seed 0's rebuilt start differs from the one its finished runs began with" in printed
    assert "**Warning:** the runs of seed(s) 0 began from different weights" in (copy / "study.md").read_text()


# ---------------------------------------------------------------------------------- LLaDA


def test_llada_study(tmp_path, one_thread):
    spec = StudySpec(task="countdown", strategies=("bf16/fp8+ais", "fp8/fp8"), seeds=(0,), steps=2, prompts_per_step=2,
                     num_generations=4, eval_prompts=8, sft_examples=64, max_completion_length=8,
                     trainer_kwargs={"diffusion_steps": 4})  # fmt: skip
    out = run_study(spec, TinyModel("llada", warm_start_steps=5), tmp_path, progress=False, log=lambda _: None)
    assert out.ran == ("bf16/fp8+ais seed 0", "fp8/fp8 seed 0") and out.plot.exists()
    mixed, _ = _read(tmp_path / "bf16-fp8-ais" / "seed0")
    unified, result = _read(tmp_path / "fp8-fp8" / "seed0")
    assert result["model"]["arch"] == "llada" and result["eval_after"]["n"] == 8
    # the diffusion scorer evaluates both phases on the same mask: the unified flow is exactly 0
    assert all(r["mismatch/logp_abs_diff_mean"] == 0.0 for r in unified)
    assert all(r["mismatch/logp_abs_diff_mean"] > 0 and "corrector/alpha" in r for r in mixed)
    assert all(r["time/rollout_s"] > 0 for r in mixed + unified)
    assert set(_table(tmp_path)) == {"bf16/fp8+ais", "fp8/fp8"}


# ---------------------------------------------------------------------------------- a checkpoint


def test_a_checkpoint_folder_is_loaded_as_it_is(tmp_path, one_thread):
    from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_qwen3(tokenizer).save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    spec = StudySpec(task="arithmetic", strategies=("bf16/fp8",), seeds=(0,), steps=1, prompts_per_step=2,
                     num_generations=2, eval_prompts=4, sft_examples=8)  # fmt: skip
    out = run_study(spec, str(tmp_path / "ckpt"), tmp_path / "out", progress=False, log=lambda _: None)
    rows, result = _read(tmp_path / "out" / "bf16-fp8" / "seed0")
    assert out.ran == ("bf16/fp8 seed 0",) and len(rows) == 1 and rows[0]["mismatch/logp_abs_diff_mean"] > 0
    assert result["model"] == {"builder": "jetrl_trainer.study.models.PretrainedModel",
                               "model_id": str(tmp_path / "ckpt"), "dtype": "bfloat16"}  # fmt: skip


def test_a_run_interrupted_after_a_checkpoint_continues_from_it_to_the_uninterrupted_runs_numbers(
        tmp_path, monkeypatch, one_thread):  # fmt: skip
    """``checkpoint_every=2``: a run killed at step 3 resumes from checkpoint-2 (its metrics up to there kept,
    steps 3-4 run again) and ends with every logged number and the final accuracy of a run never stopped; the
    finished run keeps its two files only. ``stop_after_seconds``: a run past the deadline saves a checkpoint,
    stops, and continues on the next call alike. Checkpoints of another run's settings are refused."""
    from jetrl_trainer.study import recorder as recorder_module

    spec = StudySpec(task="arithmetic", strategies=("bf16/bf16",), seeds=(0,), steps=4, prompts_per_step=2,
                     num_generations=2, eval_prompts=4, sft_examples=8, learning_rate=1e-3)  # fmt: skip
    model = TinyModel("qwen3", warm_start_steps=2, warm_start_batch_size=4)
    quiet = dict(progress=False, log=lambda _: None)
    run_study(spec, model, tmp_path / "whole", **quiet)
    whole_rows, whole = _read(tmp_path / "whole" / "bf16-bf16" / "seed0")

    class Killed(Exception):
        pass

    real_end = recorder_module.RunRecorder.on_step_end

    def killed_at_step_3(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise Killed
        return real_end(self, args, state, control, **kwargs)

    monkeypatch.setattr(recorder_module.RunRecorder, "on_step_end", killed_at_step_3)
    with pytest.raises(Killed):
        run_study(spec, model, tmp_path / "parts", checkpoint_every=2, **quiet)
    folder = tmp_path / "parts" / "bf16-bf16" / "seed0"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "checkpoint-2", "eval_before.json",
                                                        "started.json"]  # + model card  # fmt: skip
    monkeypatch.setattr(recorder_module.RunRecorder, "on_step_end", real_end)
    from jetrl_trainer.study import evaluate as evaluate_module

    evaluated = []  # the resume reads the start's evaluation back: it evaluates the end only
    real_evaluate = evaluate_module.evaluate_policy
    monkeypatch.setattr(evaluate_module, "evaluate_policy", lambda *a, **k: evaluated.append(1) or real_evaluate(*a, **k))
    run_study(spec, model, tmp_path / "parts", checkpoint_every=2, **quiet)
    assert len(evaluated) == 1
    rows, result = _read(folder)
    assert result["resumed_after_step"] == 2 and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert _untimed(rows) == _untimed(whole_rows)
    assert all(r[k] > 0 for r in rows for k in ("time/step_s", "time/rollout_s"))
    assert result["eval_before"] == whole["eval_before"] and result["eval_after"] == whole["eval_after"]
    assert result["start_fingerprint"] == whole["start_fingerprint"]
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.jsonl", "result.json"]

    # A sitting of known length: the clock passes the deadline during step 2; the run saves checkpoint-2 and
    # stops, and calling again continues it to the same numbers.
    from jetrl_trainer.study import runner

    clock = [0.0]
    monkeypatch.setattr(runner, "_now", lambda: clock[0])

    def deadline_in_step_2(self, args, state, control, **kwargs):
        clock[0] = 1000.0 if state.global_step == 2 else clock[0]
        return real_end(self, args, state, control, **kwargs)

    monkeypatch.setattr(recorder_module.RunRecorder, "on_step_end", deadline_in_step_2)
    out = run_study(spec, model, tmp_path / "timed", stop_after_seconds=100, **quiet)
    timed = tmp_path / "timed" / "bf16-bf16" / "seed0"
    assert out.stopped == ("bf16/bf16 seed 0",) and out.ran == () and "checkpoint-2" in {p.name for p in timed.iterdir()}
    assert "**Not run:** bf16/bf16 seed 0" in out.table.read_text()
    monkeypatch.setattr(recorder_module.RunRecorder, "on_step_end", real_end)
    again = run_study(spec, model, tmp_path / "timed", stop_after_seconds=100, **quiet)  # a new sitting of 100 s
    assert again.ran == ("bf16/bf16 seed 0",) and again.stopped == ()
    rows, result = _read(timed)
    assert result["resumed_after_step"] == 2 and result["eval_after"] == whole["eval_after"]
    assert _untimed(rows) == _untimed(whole_rows)

    other = tmp_path / "other" / "bf16-bf16" / "seed0"
    shutil.copytree(tmp_path / "whole", tmp_path / "other")
    (other / "result.json").unlink()
    (other / "checkpoint-2").mkdir()
    with pytest.raises(ValueError, match="checkpoints of a run with other settings.*no started.json"):
        run_study(spec, model, tmp_path / "other", checkpoint_every=2, **quiet)
    with pytest.raises(ValueError, match="checkpoint_every must be a step count"):
        run_study(spec, model, tmp_path / "other", checkpoint_every=-1, **quiet)
    with pytest.raises(ValueError, match="stop_after_seconds must be"):
        run_study(spec, model, tmp_path / "other", stop_after_seconds=-5, **quiet)


# ---------------------------------------------------------------------------------- start cache


def test_a_start_cache_builds_each_seeds_start_once_and_loads_it_bit_for_bit(tmp_path, monkeypatch, one_thread):
    """Two threads (as two processes would) ask for seed 0's start at once: one warm-starts and saves it,
    the other waits on the lock and loads it; both hold the same bits, which equal an uncached build's.
    Another learning rate shares the start; another warm-start length does not."""
    import dataclasses
    import threading

    import torch

    from jetrl_trainer import tiny
    from jetrl_trainer.study.runner import weights_fingerprint
    from jetrl_trainer.study.start_cache import cached_start, start_key
    from jetrl_trainer.tasks import get_task

    warm_starts = []
    real = tiny.warm_start
    monkeypatch.setattr(tiny, "warm_start", lambda *a, **k: warm_starts.append(k["seed"]) or real(*a, **k))
    spec = StudySpec(task="arithmetic", strategies=("bf16/bf16",), seeds=(0,), steps=1, sft_examples=64)
    builder = TinyModel("qwen3", warm_start_steps=3, warm_start_batch_size=4)
    task = get_task(spec.task)
    sft = task.make_dataset(64, seed=0)

    def build(b):
        return b(seed=0, task=task, max_completion_length=spec.completion_length(), sft_dataset=sft)

    starts = []
    threads = [threading.Thread(target=lambda: starts.append(
        cached_start(builder, spec, 0, tmp_path, build, weights_fingerprint)[0])) for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(warm_starts) == 1 and len(starts) == 2
    reference = build(builder)[0]
    assert {weights_fingerprint(m) for m in starts} == {weights_fingerprint(reference)}
    assert all(torch.equal(a, b) for a, b in zip(starts[1].state_dict().values(), reference.state_dict().values()))
    assert start_key(builder, dataclasses.replace(spec, learning_rate=1e-6)) == start_key(builder, spec)
    assert start_key(dataclasses.replace(builder, warm_start_steps=4), spec) != start_key(builder, spec)


def test_a_start_cache_refuses_a_builder_it_cannot_rebuild(tmp_path):
    from jetrl_trainer.study.start_cache import cached_start

    spec = StudySpec(task="arithmetic", strategies=("bf16/bf16",), seeds=(0,), steps=1)
    with pytest.raises(ValueError, match="start_cache rebuilds a TinyModel"):
        cached_start(lambda **_: None, spec, 0, tmp_path, lambda b: b(), str)


def test_processes_sharing_a_start_cache_record_the_same_start(tmp_path, one_thread):
    """The CLI's --start_cache: two studies of one seed in separate output folders (as parallel processes
    would run them) begin from the same weights, the second without a warm start of its own."""
    cli = _script_module()
    args = [*FAST_ARGS, "--steps", "1", "--start_cache", str(tmp_path / "starts")]
    assert cli.main([*args, "--output_dir", str(tmp_path / "a"), "--strategies", "bf16/bf16"]) == 0
    assert cli.main([*args, "--output_dir", str(tmp_path / "b"), "--strategies", "fp8/fp8"]) == 0
    first = _read(tmp_path / "a" / "bf16-bf16" / "seed0")[1]["start_fingerprint"]
    assert _read(tmp_path / "b" / "fp8-fp8" / "seed0")[1]["start_fingerprint"] == first
    assert len(list((tmp_path / "starts").glob("*/seed0/start.json"))) == 1


# ---------------------------------------------------------------------------------- sweep report


def test_sampled_evaluation_scores_drawn_answers_and_leaves_the_training_as_it_was(tmp_path, one_thread):
    """``eval_samples=3``: each run's result holds the accuracy and reward of 3 sampled completions per held-out
    prompt beside the greedy ones, the same draws before and after (a rerun gives the same figures), the table
    shows them, and the training logs every number of a run without it: the draws come from a forked RNG."""
    common = dict(task="arithmetic", strategies=("bf16/bf16",), seeds=(0,), steps=3, prompts_per_step=2,
                  num_generations=2, eval_prompts=6, sft_examples=8, learning_rate=1e-3)  # fmt: skip
    model = TinyModel("qwen3", warm_start_steps=2, warm_start_batch_size=4)
    quiet = dict(progress=False, log=lambda _: None)
    run_study(StudySpec(**common), model, tmp_path / "greedy", **quiet)
    sampled_spec = StudySpec(**common, eval_samples=3)
    run_study(sampled_spec, model, tmp_path / "sampled", **quiet)
    greedy_rows, greedy = _read(tmp_path / "greedy" / "bf16-bf16" / "seed0")
    rows, result = _read(tmp_path / "sampled" / "bf16-bf16" / "seed0")
    assert _untimed(rows) == _untimed(greedy_rows)
    for when in ("eval_before", "eval_after"):
        evaluation = result[when]
        assert {k: evaluation[k] for k in ("reward", "accuracy", "n")} == greedy[when]  # the greedy part unchanged
        assert evaluation["samples"] == 3 and 0 <= evaluation["sampled_accuracy"] <= 1
        # 18 draws: accuracy is a multiple of 1/18
        assert round(evaluation["sampled_accuracy"] * 18, 9) == round(evaluation["sampled_accuracy"] * 18)
        assert 0 <= evaluation["sampled_reward"] <= 1
    assert result["settings"]["eval_samples"] == 3
    cells = _table(tmp_path / "sampled")["bf16/bf16"]
    before, after = result["eval_before"]["sampled_accuracy"], result["eval_after"]["sampled_accuracy"]
    assert cells[6:9] == [f"{before:.3f} ± 0.000", f"{after:.3f} ± 0.000", f"{100 * (after - before):+.1f}"]
    assert "sampled acc. after RL" in (tmp_path / "sampled" / "study.md").read_text()
    assert "sampled acc." not in (tmp_path / "greedy" / "study.md").read_text()
    shutil.rmtree(tmp_path / "sampled" / "bf16-bf16")
    run_study(sampled_spec, model, tmp_path / "sampled", **quiet)  # the same draws again
    assert _read(tmp_path / "sampled" / "bf16-bf16" / "seed0")[1]["eval_after"] == result["eval_after"]


def test_gradient_checkpointing_runs_log_the_numbers_of_runs_without_it(tmp_path, monkeypatch, one_thread):
    """``--gradient_checkpointing`` (the memory that lets GPU runs sit side by side) reaches each run's trainer,
    which enables it on the model, and on CPU the run logs every number of the same run without it."""
    import transformers

    cli = _script_module()
    spec, _ = cli.build(cli.parse(["--fast", "--gradient_checkpointing"]))
    assert spec.trainer_kwargs == {"gradient_checkpointing": True}
    assert cli.build(cli.parse(["--fast"]))[0].trainer_kwargs == {}
    enabled = []
    real_enable = transformers.PreTrainedModel.gradient_checkpointing_enable

    def recording_enable(self, *args, **kwargs):
        enabled.append(type(self).__name__)
        return real_enable(self, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "gradient_checkpointing_enable", recording_enable)
    common = dict(task="arithmetic", strategies=("bf16/bf16",), seeds=(0,), steps=3, prompts_per_step=2,
                  num_generations=2, eval_prompts=6, sft_examples=8, learning_rate=1e-3)  # fmt: skip
    model = TinyModel("qwen3", warm_start_steps=2, warm_start_batch_size=4)
    quiet = dict(progress=False, log=lambda _: None)
    run_study(StudySpec(**common), model, tmp_path / "plain", **quiet)
    assert not enabled
    run_study(StudySpec(**common, trainer_kwargs={"gradient_checkpointing": True}), model, tmp_path / "gc", **quiet)
    assert enabled
    plain_rows, plain = _read(tmp_path / "plain" / "bf16-bf16" / "seed0")
    rows, result = _read(tmp_path / "gc" / "bf16-bf16" / "seed0")
    assert _untimed(rows) == _untimed(plain_rows)
    assert result["eval_after"] == plain["eval_after"]
    assert result["settings"]["trainer_kwargs"] == {"gradient_checkpointing": True}


def _fake_run(folder: Path, lr: float, rewards: list[float], before: float, after: float,
              sampled: tuple[float, float] | None = None) -> None:  # fmt: skip
    from jetrl_trainer.study._files import write_run

    rows = [{"step": i + 1, "reward": r, "completions/mean_length": 200.0 + i, "time/step_s": 1.0 + i % 2}
            for i, r in enumerate(rewards)]  # fmt: skip
    settings = {"learning_rate": lr, "temperature": 0.7, "prompts_per_step": 8, "steps": len(rewards)}

    def drawn(when: int) -> dict:
        return {"sampled_accuracy": sampled[when]} if sampled else {}

    write_run(folder / "bf16-bf16" / "seed0", rows, {
        "strategy": "bf16/bf16", "seed": 0, "settings": settings, "rows": len(rows),
        "eval_before": {"accuracy": before, "reward": 0.0, "n": 256, **drawn(0)},
        "eval_after": {"accuracy": after, "reward": 0.0, "n": 256, **drawn(1)},
    })  # fmt: skip


def test_the_sweep_report_computes_every_figure_from_the_runs_files(tmp_path, capsys):
    _fake_run(tmp_path / "lr1e-6", 1e-6, [0.1, 0.2, 0.3, 0.4], before=0.40, after=0.45)
    _fake_run(tmp_path / "lr5e-6", 5e-6, [0.5, 0.1, 0.1, 0.1], before=0.40, after=0.30)
    (tmp_path / "lr5e-6" / "fp8-fp8" / "seed0").mkdir(parents=True)  # unfinished: no result.json, not listed
    cli = _script_module(SCRIPT.parent / "sweep_report.py")
    out = tmp_path / "report" / "lr"
    assert cli.main([str(tmp_path / "lr1e-6"), str(tmp_path / "lr5e-6"), "--out", str(out), "--window", "2"]) == 0
    figures = json.loads(out.with_suffix(".json").read_text())
    assert [f["folder"] for f in figures] == ["lr1e-6", "lr5e-6"]
    first = figures[0]
    assert first["settings"] == {"learning_rate": 1e-6, "temperature": 0.7, "prompts_per_step": 8, "steps": 4}
    assert first["reward_first"] == pytest.approx(0.15) and first["reward_last"] == pytest.approx(0.35)
    assert first["mean_completion_tokens"] == pytest.approx(201.5) and first["seconds_per_step"] == 1.5
    assert (first["accuracy_before"], first["accuracy_after"], first["eval_prompts"]) == (0.40, 0.45, 256)
    table = out.with_suffix(".md").read_text()
    row = "| lr1e-6 | `bf16/bf16` | 0 | 1e-06 | 0.7 | 8 × 4 | 40.0% → **45.0%** (n=256) | 0.150 → 0.350 | 202 | 1.50 |"
    assert row in table
    assert "40.0% → **30.0%**" in table and table in capsys.readouterr().out
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="holds no finished run"):
        cli.main([str(tmp_path / "report"), "--out", str(out)])
    # A run that scored sampled answers adds that column; a run that did not shows a dash in it.
    _fake_run(tmp_path / "t1.3", 1e-6, [0.1, 0.2, 0.3, 0.4], before=0.40, after=0.41, sampled=(0.20, 0.31))
    assert cli.main([str(tmp_path / "lr1e-6"), str(tmp_path / "t1.3"), "--out", str(out), "--window", "2"]) == 0
    table = out.with_suffix(".md").read_text()
    assert "| sampled accuracy before → after |" in table
    assert "| 40.0% → **41.0%** (n=256) | 20.0% → **31.0%** | 0.150 → 0.350 |" in table
    assert "| 40.0% → **45.0%** (n=256) | – | 0.150 → 0.350 |" in table
    assert json.loads(out.with_suffix(".json").read_text())[1]["sampled_after"] == 0.31
