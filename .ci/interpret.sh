#!/usr/bin/env bash
# The Triton kernels without a GPU: the decode kernels' @triton.jit and launch code on CPU tensors in
# Triton's interpreter (tests/test_kernels_interpreted.py), and every kernel compiled ahead of time for
# the H200's sm_90 (tests/test_kernels_compile_sm90.py), so indexing, masking, tiling and compilability
# are checked on every commit, not only in sessions with a GPU. A step of its own, after the core suite: it installs
# Triton (the version the GPU image runs) into the core suite's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "triton==3.6.0"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
TRITON_INTERPRET=1 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_interpreted.py | tee "$log"
JETRL_COMPILE_SM90=1 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_compile_sm90.py | tee -a "$log"
# Every test here must run: a skip fails the step.
if grep -qE "[0-9]+ skipped" "$log"; then echo "kernel step: tests were skipped" >&2; exit 1; fi
