#!/usr/bin/env bash
# The field on our draft, in one run: llama.cpp's own DFlash (`llama.cpp-dflash`) and its autoregressive decoding
# (binaries built once by build_llama_cpp.sh, ~15-40 min on 2 cores), and z-lab's reference DFlash loop
# (`zlab-reference`, installed by `make setup`), on HumanEval, with loop shares and the decode floor; then
# benchmarks/RESULTS.md regenerated. DRAFT (cpu-trained), LIMIT prompts (6), TOKENS new tokens (128).
#   bash benchmarks/field.sh          (BIN: the venv's bin folder, .venv/bin)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
PYTHON="$BIN/python" bash benchmarks/build_llama_cpp.sh
mkdir -p benchmarks/results/field
"$BIN/hetero-sd" bench --draft "${DRAFT:-cpu-trained}" --dataset humaneval --limit "${LIMIT:-6}" --max-new-tokens "${TOKENS:-128}" \
  --peers llama.cpp-dflash,zlab-reference,llama.cpp --floor --json benchmarks/results/field/humaneval.json
"$BIN/python" benchmarks/results_md.py
