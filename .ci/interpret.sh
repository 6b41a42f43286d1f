#!/usr/bin/env bash
# The Triton kernels without a GPU: the tests marked `interpreter` run the kernels' @triton.jit and launch
# code on CPU tensors in Triton's interpreter, and those marked `sm90` compile every kernel ahead of time
# for the H100/H200's sm_90 (tests/conftest.py skips each unless its variable is set), so indexing,
# masking, tiling and compilability are checked on every commit, not only in sessions with a GPU. A step
# of its own, after the core suite: it installs Triton (the version the GPU image runs) into the core
# suite's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "triton==3.6.0"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

# The tests marked $1, from the files that hold them only: a module that skips as a whole (the vLLM
# tests without vLLM) would count as a skip even when none of its tests is selected.
run_marked() {
  local files
  files=$(python3 -m pytest -q --collect-only -p no:cacheprovider -m "$1" tests | grep "::" | cut -d: -f1 | sort -u)
  python3 -m pytest -q -rs -p no:cacheprovider -m "$1" $files
}
(export TRITON_INTERPRET=1; run_marked interpreter) | tee "$log"
(export JETRL_COMPILE_SM90=1; run_marked sm90) | tee -a "$log"
# Every selected test must run: a skip fails the step.
if grep -qE "[0-9]+ skipped" "$log"; then echo "kernel step: tests were skipped" >&2; exit 1; fi
