#!/usr/bin/env bash
# A benchmark at a reference tree and at this checkout, on one machine in one session, alternating:
# the comparison a change that should cost nothing needs (run-to-run spread on a lent GPU is a few %).
# Usage (repo root): bash benchmarks/against_ref.sh REF_DIR OUT_DIR ROUNDS -- BENCH_SCRIPT [ARGS...]
#   REF_DIR: an exported tree of the reference, e.g. `git archive pre-structure | tar -x -C .ref`
#   writes OUT_DIR/<script>_{ref,head}_<round>.out (its stdout, JSON last) and .err (its stderr).
# Each tree is imported from a folder of its own (no install), so the two never mix.
set -uo pipefail
REF=$(realpath "$1"); OUT=$2; ROUNDS=$3; shift 3
[ "$1" = "--" ] && shift
SCRIPT=$1; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

package() {  # package SRC DEST: DEST/jetrl_trainer laid out as setup.py's package-dir mapping installs it
  rm -rf "$2" && mkdir -p "$2/jetrl_trainer"
  for f in "$1"/jetrl_trainer/*; do ln -s "$(realpath "$f")" "$2/jetrl_trainer/"; done
  for d in quant kernels correctors; do ln -s "$(realpath "$1/$d")" "$2/jetrl_trainer/$d"; done
}
package "$REF" /tmp/against_ref/ref
package "$PWD" /tmp/against_ref/head
name=$(basename "$SCRIPT" .py)
for round in $(seq 1 "$ROUNDS"); do
  for tree in ref head; do
    src=$([ "$tree" = ref ] && echo "$REF" || echo "$PWD")
    (cd "$src/benchmarks" && PYTHONPATH="/tmp/against_ref/$tree${PYTHONPATH:+:$PYTHONPATH}" \
      python3 "$(basename "$SCRIPT")" "$@" >"$OUT/${name}_${tree}_${round}.out" 2>"$OUT/${name}_${tree}_${round}.err")
    echo "$name $tree round $round -> exit $?"
  done
done
