"""JetGRPOTrainer on two processes (issue 7, CPU part), and the FP8 weight cache under ZeRO-3.

The launched tests run ``accelerate launch`` with 2 processes over gloo on the CPU (tests/trainer/dist_worker.py
records what each rank saw) for DDP and, when DeepSpeed is importable, ZeRO-2 and ZeRO-3. They check:

* parameters are bit-identical on both ranks after every step, although the ranks train on different
  completions (so unsynchronised training would diverge);
* the logged ``mismatch/*`` and ``corrector/*`` figures are the figures over both ranks' tokens,
  recomputed from the per-rank sums, and differ from some rank's local-only figure;
* the FP8 weight cache is invalidated on both ranks after each update: every `QuantLinear` quantizes
  its weight exactly once per step (the first forward after the update), and right after the
  optimizer step every cached entry is out of date.
* no rank finalizes Python while gloo's threads are alive (the cause of a rare SIGABRT at exit).

The first DeepSpeed launch on a machine JIT-builds DeepSpeed's shared-memory comm op (about 90 s on
2 cores); later launches reuse it from the torch-extensions cache.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from jetrl_trainer.correctors import merge_sums, metrics_from_sums
from jetrl_trainer.quant import PrecisionPhases, QuantLinear, WeightCacheRefresh, quantize_fp8_blocks

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
CONFIGS = ROOT / "examples" / "configs"

FP8_AIS, BF16_TIS = "fp8:fp8:ais", "bf16:fp8:tis"
# name -> (accelerate config, strategies, optimizer steps, DeepSpeed)
LAUNCHES: dict[str, tuple[str, tuple[str, ...], int, bool]] = {
    "ddp": ("accelerate_cpu_2proc.yaml", (FP8_AIS, BF16_TIS), 3, False),
    "zero2": ("accelerate_zero2.yaml", (FP8_AIS, BF16_TIS), 2, True),
    "zero3": ("accelerate_zero3.yaml", (FP8_AIS, BF16_TIS), 2, True),
}
RUNS = [(launch, strategy) for launch, (_, strategies, _, _) in LAUNCHES.items() for strategy in strategies]
N_QUANT_LINEAR = 2 * 7  # tiny Qwen3: 2 layers x (q, k, v, o, gate, up, down); lm_head stays nn.Linear


def _has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails at import
        return False
    return True


def _free_port() -> int:
    # Other sessions may run the suite at the same time: never rely on accelerate's default 29500.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model and tokenizer, saved once so that both ranks load the same weights."""
    from jetrl_trainer.tiny import build_tiny_qwen3, build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_qwen3")
    tokenizer = build_tiny_tokenizer()
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class LaunchFailed(Exception):
    """A launch that exited non-zero or timed out; the message carries both ranks' own output."""


def _rank_logs(log_dir: Path) -> str:
    """Each rank's own stderr and stdout (torchrun ``--tee``), tails only: which rank died, and how."""
    parts = []
    for path in sorted(log_dir.glob("**/attempt_*/*/std*.log")):
        tail = path.read_text(errors="replace")[-3000 if path.name == "stderr.log" else -1000 :]
        parts.append(f"--- rank {path.parent.name} {path.name} (tail):\n{tail}")
    return "\n".join(parts) or f"(no rank logs under {log_dir})"


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    """``launched(name) -> {strategy: [rank0 record, rank1 record], "finalized": [...]}``; each launch
    runs once per module. A failed launch is not run again by the next test: all its tests report the
    same failure, so a flaky launch cannot fail once and then pass behind a relaunch."""
    records: dict[str, dict[str, list]] = {}
    failures: dict[str, str] = {}

    def get(name: str) -> dict[str, list]:
        if LAUNCHES[name][3] and not _has_deepspeed():
            pytest.skip("deepspeed is not importable (pip install deepspeed); the DDP launch still runs")
        if name not in records and name not in failures:
            try:
                records[name] = _launch(name, model_dir, tmp_path_factory.mktemp(name))
            except LaunchFailed as e:
                failures[name] = str(e)
        if name in failures:
            pytest.fail(failures[name], pytrace=False)
        return records[name]

    return get


def _launch(name: str, model_dir: Path, out: Path) -> dict[str, list]:
    config, strategies, steps, deepspeed = LAUNCHES[name]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(CONFIGS / config),
        "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(_free_port()),
        "--tee", "3", "--log_dir", str(out / "logs"),  # per-rank stdout/stderr files, for the failure report
        str(WORKER), "--model", str(model_dir), "--out", str(out), "--steps", str(steps),
        *(arg for s in strategies for arg in ("--strategy", s)),
        *(["--deepspeed"] if deepspeed else []),
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # two processes on a 2-core machine
        "DS_ACCELERATOR": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",  # a CPU test, also on a machine with GPUs
    }
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=480)
        status, stderr = f"rc={proc.returncode}", proc.stderr
    except subprocess.TimeoutExpired as e:
        err = e.stderr or ""
        status, stderr = "timed out after 480 s", err if isinstance(err, str) else err.decode(errors="replace")
    if status != "rc=0":
        raise LaunchFailed(
            f"{name} launch failed ({status}). The end of the launcher's stderr names the failed rank and its "
            f"exit code (-6: SIGABRT).\n=== ranks\n{_rank_logs(out / 'logs')}\n"
            f"=== launcher stderr (tail)\n{stderr[-4000:]}"
        )
    launch = {
        s: [json.loads((out / s.replace(":", "-") / f"rank{r}.json").read_text()) for r in (0, 1)] for s in strategies
    }
    finalized = [out / f"rank{r}.finalized.json" for r in (0, 1)]  # written only if a rank finalized Python
    launch["finalized"] = [json.loads(f.read_text()) if f.exists() else None for f in finalized]
    return launch


def _sums(call: dict[str, list]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(value, dtype=getattr(torch, dtype)) for k, (value, dtype) in call.items()}


def _figures(logs: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in logs.items() if k.startswith(("mismatch/", "corrector/"))}


# ------------------------------------------------------------------ launched runs


@pytest.mark.parametrize("launch,strategy", RUNS)
def test_two_processes_ran_every_step(launched, launch, strategy):
    _, _, steps, deepspeed = LAUNCHES[launch]
    ranks = launched(launch)[strategy]
    assert [r["rank"] for r in ranks] == [0, 1]
    for record in ranks:
        assert record["world_size"] == 2
        assert record["distributed_type"] == ("DistributedType.DEEPSPEED" if deepspeed else "DistributedType.MULTI_CPU")
        assert record["zero_stage"] == {"zero2": 2, "zero3": 3}.get(launch)
        assert record["n_quant_linear"] == N_QUANT_LINEAR
        assert [s["step"] for s in record["steps"]] == list(range(1, steps + 1))
        assert len(record["logs"]) == len(record["sums"]) == steps  # one generation, one corrector call per step
        assert all(log["jetrl/skipped_steps"] == 0 for log in record["logs"])


@pytest.mark.parametrize("launch,strategy", RUNS)
def test_parameters_identical_on_both_ranks_after_every_step(launched, launch, strategy):
    rank0, rank1 = launched(launch)[strategy]
    assert rank0["initial_sha256"] == rank1["initial_sha256"]
    hashes = [rank0["initial_sha256"]]
    for s0, s1, data0, data1 in zip(rank0["steps"], rank1["steps"], rank0["train_logp_sums"], rank1["train_logp_sums"]):
        assert s0["param_sha256"] == s1["param_sha256"], f"ranks diverged at step {s0['step']}"
        # The ranks trained on different completions: without gradient sync they would diverge.
        assert data0 != pytest.approx(data1, rel=1e-6)
        hashes.append(s0["param_sha256"])
    assert len(set(hashes)) == len(hashes), "every step must change the parameters"


@pytest.mark.parametrize("launch,strategy", RUNS)
def test_mismatch_and_corrector_figures_are_over_both_ranks_tokens(launched, launch, strategy):
    rank0, rank1 = launched(launch)[strategy]
    distinct_steps = 0
    for step, (log0, log1, call0, call1) in enumerate(zip(rank0["logs"], rank1["logs"], rank0["sums"], rank1["sums"])):
        logged = _figures(log0)
        assert logged == _figures(log1), "both ranks log the same figures"
        both = metrics_from_sums(merge_sums(_sums(call0), _sums(call1)))
        assert set(both) == set(logged) and len(logged) >= 10
        assert logged == pytest.approx(both, rel=1e-6, abs=1e-12), f"step {step + 1}"
        # By hand: a token mean over both ranks is (sum0 + sum1) / (n0 + n1); a max is the larger max.
        mean = (call0["abs_diff_sum"][0] + call1["abs_diff_sum"][0]) / (call0["n_tokens"][0] + call1["n_tokens"][0])
        assert logged["mismatch/logp_abs_diff_mean"] == pytest.approx(mean, rel=1e-6)
        top = max(call0["abs_diff_max"][0], call1["abs_diff_max"][0])
        assert logged["mismatch/logp_abs_diff_max"] == pytest.approx(top, rel=1e-6)
        # ... and, when the ranks' sums differ, it is not what some rank would log from its own tokens.
        if call0 != call1:
            distinct_steps += 1
            local = [metrics_from_sums(_sums(call)) for call in (call0, call1)]
            assert any(logged[k] != pytest.approx(figs[k], rel=1e-4, abs=0) for figs in local for k in logged)
    assert distinct_steps >= 1, "no step where the ranks' sums differ: the check above never ran"


@pytest.mark.parametrize("launch,strategy", RUNS)
def test_fp8_weight_cache_invalidated_on_both_ranks_after_each_update(launched, launch, strategy):
    for record in launched(launch)[strategy]:
        for step in record["steps"]:
            begin, end = step["quantizations_begin"], step["quantizations_end"]
            assert len(end) == N_QUANT_LINEAR
            # Exactly one quantization per layer per step: 0 would mean a stale cache served the
            # updated weights, 2+ a cache that misses within a step (e.g. ZeRO-3 gathers by data_ptr).
            per_layer = {name: end[name] - begin[name] for name in end}
            assert set(per_layer.values()) == {1}, f"rank {record['rank']} step {step['step']}: {per_layer}"
            assert step["stale_after_update"], f"rank {record['rank']} step {step['step']}: cache not invalidated"


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_no_rank_finalizes_python_with_gloo_threads_alive(launched, launch):
    """No rank starts interpreter finalization while gloo's worker threads live. One of them still
    releasing a finished collective's tensors then takes the GIL, is unwound out of a noexcept
    destructor, and the rank aborts ("terminate called without an active exception", SIGABRT).
    That race is rare in a launch; its precondition is checked on every launch."""
    for rank, record in enumerate(launched(launch)["finalized"]):
        assert record is None or not record["gloo_threads"], (
            f"rank {rank} began interpreter finalization with gloo threads alive: {record['gloo_threads']}"
        )


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_unified_flow_stays_at_the_floor_across_processes(launched, launch):
    """fp8/fp8: rollout and training share the cached FP8 weights, so the mismatch stays at the
    KV-cache summation-order floor (~1e-7), also when ZeRO-3 gathers the weights for each forward."""
    for record in launched(launch)[FP8_AIS]:
        for log in record["logs"]:
            assert log["mismatch/logp_abs_diff_mean"] < 1e-5
    if BF16_TIS in LAUNCHES[launch][1]:
        assert all(log["mismatch/logp_abs_diff_mean"] > 1e-3 for log in launched(launch)[BF16_TIS][0]["logs"])


# ------------------------------------------------------------------ ZeRO-3 weight cache (simulated gather)

FP8 = {"train": "fp8", "rollout": "fp8"}


class _Zero3Sim:
    """What ZeRO-3 does to a parameter, on the CPU: ``ds_id``/``ds_shape`` set, a 0-size local shard,
    and a fresh tensor (new storage, same values) put into ``.data`` by every gather."""

    def __init__(self, layer: QuantLinear, ds_id: int = 7) -> None:
        self.layer, self.full = layer, layer.weight.detach().clone()
        layer.weight.ds_id, layer.weight.ds_shape = ds_id, self.full.shape
        self.gathered: list[torch.Tensor] = []  # kept alive so every gather gets a new data_ptr
        self.release()

    def gather(self) -> None:
        self.gathered.append(self.full.clone())
        self.layer.weight.data = self.gathered[-1]

    def release(self) -> None:
        self.layer.weight.data = torch.empty(0, dtype=self.full.dtype)


def _layer(seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    return QuantLinear.from_linear(nn.Linear(256, 192), FP8)


def _reference(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ref = _layer()
    with torch.no_grad():
        ref.weight.copy_(weight)
        return ref(x)


def test_zero3_gathered_weight_is_quantized_once_per_optimizer_step():
    layer, x = _layer(), torch.randn(5, 256)
    sim = _Zero3Sim(layer)
    outputs = []
    for phase in ("rollout", "train", "train"):  # rollout, old log-probs, loss forward: one gather each
        sim.gather()
        with PrecisionPhases(layer).use(phase), torch.no_grad():
            outputs.append(layer(x))
        sim.release()
    assert layer.weight_quantizations == 1
    assert all(torch.equal(y, outputs[0]) for y in outputs)
    assert torch.equal(outputs[0], _reference(sim.full, x))
    # The optimizer updates the shard (ZeRO-3 writes the new values back through .data, no _version bump);
    # the refresh registered on its torch.optim optimizer bumps the cache generation.
    shard = nn.Parameter(torch.zeros(3))
    shard.grad = torch.ones(3)
    optimizer = torch.optim.SGD([shard], lr=0.1)
    WeightCacheRefresh(layer, optimizer)
    optimizer.step()
    sim.full -= 0.05
    sim.gather()
    with torch.no_grad():
        updated = layer(x)
    assert layer.weight_quantizations == 2
    assert torch.equal(updated, _reference(sim.full, x)) and not torch.equal(updated, outputs[0])


def test_zero3_cache_key_differs_from_a_plain_parameter():
    """The same swap of ``.data`` on a parameter without ``ds_id`` re-quantizes (key by data_ptr), as
    it must for arbitrary user code: only ZeRO-3's own parameters are keyed by the step."""
    layer, x = _layer(), torch.randn(2, 256)
    sim = _Zero3Sim(layer)
    del layer.weight.ds_id
    for _ in range(2):
        sim.gather()
        with torch.no_grad():
            layer(x)
    assert layer.weight_quantizations == 2


def test_zero3_shard_outside_its_gather_is_refused():
    layer, x = _layer(), torch.randn(2, 256)
    sim = _Zero3Sim(layer)
    with pytest.raises(ValueError, match="ZeRO-3"):
        layer(x)
    sim.gather()
    with torch.no_grad():
        layer(x)
    sim.release()  # a filled cache must not be served to the 0-size shard either
    with pytest.raises(ValueError, match="inside the parameter gather"):
        layer(x)
    assert layer.weight_quantizations == 1


def test_from_linear_accepts_a_zero3_partitioned_linear():
    linear = nn.Linear(256, 192)
    full_shape = linear.weight.shape
    linear.weight.ds_id, linear.weight.ds_shape = 3, full_shape
    linear.weight.data = torch.empty(0)
    layer = QuantLinear.from_linear(linear, FP8)
    assert (layer.out_features, layer.in_features) == tuple(full_shape)


def test_quantize_fp8_blocks_of_the_gathered_weight_is_what_the_layer_uses():
    """The cached tensors are the blockwise FP8 quantization of the gathered (full) weight."""
    layer = _layer()
    sim = _Zero3Sim(layer)
    sim.gather()
    w_q, w_s = layer.quantized_weight(layer.recipes["train"])
    ref_q, ref_s = quantize_fp8_blocks(sim.full)
    assert w_q.shape == (192, 256) and torch.equal(w_q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(w_s, ref_s)


def test_exit_process_without_a_process_group_is_sys_exit():
    """A single process (or NCCL) ends as ``sys.exit`` would, finalizing Python and running atexit."""
    from jetrl_trainer import exit_process

    with pytest.raises(SystemExit) as exited:
        exit_process(3)
    assert exited.value.code == 3
