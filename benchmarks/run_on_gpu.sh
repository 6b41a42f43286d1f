#!/usr/bin/env bash
# One full GPU session (run from the repo root on the device machine): install, GPU tests, benchmarks.
# Usage: bash benchmarks/run_on_gpu.sh OUT_DIR [tests|bench|all] [pytest -k expression]
set -o pipefail
OUT=${1:-/tmp/out}; WHAT=${2:-all}; KEXPR=${3:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation -e . -q >"$OUT/install.log" 2>&1 || {
  # Fallback: the package-dir mapping by symlinks (quant/, kernels/, correctors/ inside jetrl_trainer).
  mkdir -p /tmp/pkg && cp -r jetrl_trainer /tmp/pkg/ && for d in quant kernels correctors; do ln -sfn "$PWD/$d" /tmp/pkg/jetrl_trainer/$d; done
  export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}; echo "editable install failed; using /tmp/pkg" | tee -a "$OUT/install.log"; }
python3 -c "import torch, triton, jetrl_trainer.kernels as k; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(), k.available_gemm_backends('cuda'))" 2>&1 | tee "$OUT/env.log"
if [ "$WHAT" != bench ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -n 8 ${KEXPR:+-k "$KEXPR"} \
    tests/test_kernels_gpu.py tests/test_gemm_backends_gpu.py tests/test_cuda_graphs_gpu.py tests/test_quant_linear_gpu.py \
    tests/test_kernels_cpu.py tests/test_gemm_backend.py tests/test_quant_linear.py tests/test_fused.py \
    2>&1 | tee "$OUT/tests.log" | tail -60
fi
if [ "$WHAT" != tests ]; then
  timeout ${BENCH_TIMEOUT:-270} python3 benchmarks/run_all.py "$OUT" ${BENCH_NAMES:-} 2>&1 | tee "$OUT/bench.log" | tail -80
fi
