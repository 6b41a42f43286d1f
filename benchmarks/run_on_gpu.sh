#!/usr/bin/env bash
# One GPU session (run from the repo root on the device machine): install, GPU tests, examples, benchmarks.
# Usage: bash benchmarks/run_on_gpu.sh OUT_DIR [tests|examples|bench|all] [pytest -k expression]
# Wheels the GPU image lacks (trl, datasets): put them in .whl/ beforehand; they are installed from there, offline.
# BENCH_NAMES picks run_all.py benchmarks; BENCH_ROLLOUT_ARGS are passed to bench_rollout.py.
set -o pipefail
OUT=${1:-/tmp/out}; WHAT=${2:-all}; KEXPR=${3:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install --no-deps --no-build-isolation -e . -q >"$OUT/install.log" 2>&1 || {
  # Fallback: the package-dir mapping by symlinks (quant/, kernels/, correctors/ inside jetrl_trainer).
  mkdir -p /tmp/pkg && cp -r jetrl_trainer /tmp/pkg/ && for d in quant kernels correctors; do ln -sfn "$PWD/$d" /tmp/pkg/jetrl_trainer/$d; done
  export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}; echo "editable install failed; using /tmp/pkg" | tee -a "$OUT/install.log"; }
python3 -c "import torch, triton, transformers, jetrl_trainer.kernels as k; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.get_device_name(), k.auto_gemm_backends('cuda'))" 2>&1 | tee "$OUT/env.log"
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -n ${TEST_WORKERS:-8} -m gpu -rs ${KEXPR:+-k "$KEXPR"} tests \
    2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [ "$WHAT" = examples ] || [ "$WHAT" = all ]; then
  for ex in "examples/quickstart.py --fast" "examples/train_llada.py --fast"; do
    timeout 240 python3 $ex --output_dir /tmp/ex_$(basename ${ex%% *} .py) >"$OUT/ex_$(basename ${ex%% *} .py).log" 2>&1
    echo "$ex -> exit $? ($(tail -1 "$OUT/ex_$(basename ${ex%% *} .py).log"))"
  done
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  [ -n "${BENCH_NAMES:-}" ] && timeout ${BENCH_TIMEOUT:-270} python3 benchmarks/run_all.py "$OUT" $BENCH_NAMES 2>&1 | tee "$OUT/bench.log" | tail -40
  (cd benchmarks && timeout ${ROLLOUT_TIMEOUT:-420} python3 bench_rollout.py ${BENCH_ROLLOUT_ARGS:-} 2>&1 | tee "$OUT/bench_rollout.log" | tail -60)
fi
