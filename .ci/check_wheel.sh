#!/usr/bin/env bash
# What a user installs: build the wheel, install it non-editable into a fresh virtual environment,
# and use it from outside the checkout (STYLE rule 12). Usage: .ci/check_wheel.sh [workdir]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [ -n "${1:-}" ]; then
  work="$1"
else  # a folder of our own: removed on exit (a wheel venv with torch is a few GB)
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work/dist" "$work/outside"

python3 -m pip wheel -q --no-deps "$repo" -w "$work/dist"
wheel="$(ls "$work"/dist/jetrl_trainer-*.whl)"

# Every folder of Python files in the mapped source roots must be in the wheel, whatever setup.py found.
python3 - "$repo" "$wheel" <<'PY'
import os, sys, zipfile
repo, wheel = sys.argv[1:]
names = set(zipfile.ZipFile(wheel).namelist())
roots = {"jetrl_trainer": "jetrl_trainer", "quant": "jetrl_trainer/quant",
         "kernels": "jetrl_trainer/kernels", "correctors": "jetrl_trainer/correctors"}
missing = []
for src, dst in roots.items():
    for folder, _, files in os.walk(os.path.join(repo, src)):
        rel = os.path.relpath(folder, os.path.join(repo, src))
        for f in files:
            if f.endswith(".py"):
                want = os.path.normpath(os.path.join(dst, rel, f))
                if want not in names:
                    missing.append(want)
if missing:
    sys.exit(f"the wheel lacks {len(missing)} module(s): {', '.join(sorted(missing))}")
print(f"wheel holds every module of the source tree ({os.path.basename(wheel)})")
PY

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0  # the CPU build on disk (see .ci/run)
"$py" -m pip install -q "$wheel"

cd "$work/outside"  # nothing of the checkout on sys.path
"$py" - "$work/venv" <<'PY'
import os, sys
import jetrl_trainer
from jetrl_trainer import JetGRPOConfig, JetGRPOTrainer
import jetrl_trainer.correctors, jetrl_trainer.diffusion, jetrl_trainer.kernels, jetrl_trainer.quant
import jetrl_trainer.rollout, jetrl_trainer.tasks, jetrl_trainer.tiny
where = os.path.realpath(jetrl_trainer.__file__)
if not where.startswith(os.path.realpath(sys.argv[1])):
    sys.exit(f"jetrl_trainer was imported from {where}, not from the installed wheel")
print(f"public API imports from the installed wheel: {os.path.dirname(where)}")
PY
"$py" "$repo/examples/quickstart.py" --fast --output_dir "$work/outside/quickstart"
test -s "$work/outside/quickstart/metrics.jsonl"
echo "wheel check passed"
