#!/usr/bin/env bash
# The accelerator check in one call on a GPU machine (nothing to install there but this tree: the machine's
# python3 has torch and transformers). Writes $OUT (or benchmarks/results/gpu)/gpu_check.json and .log: gpu_check.py.
#   device call:  bash benchmarks/gpu_check.sh            (timeout_s 560; the check stops starting rows at 440 s)
#   then, if time is left, the CUDA tests:  bash benchmarks/gpu_check.sh tests
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
# the package as an install sees it: backends/, ane_compiler/ and tui/ inside the hetero_sd namespace
for d in backends ane_compiler tui; do [ -e hetero_sd/$d ] || ln -s ../$d hetero_sd/$d; done
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu_check.log"
case "${1:-check}" in
check) shift || true; "$PY" benchmarks/gpu_check.py --out "$OUT" "$@" ;;
tests) timeout "${TEST_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -rs --tb=short tests/test_cuda.py tests/test_fixed_steps.py \
           tests/test_device_costs.py 2>&1 | tee "$OUT/cuda-tests.log" ;;
*) echo "usage: gpu_check.sh [check|tests] [gpu_check.py options]" >&2; exit 2 ;;
esac
