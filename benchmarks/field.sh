#!/usr/bin/env bash
# The field's best on our draft, in one run (issue 15): llama.cpp's own DFlash and its autoregressive
# decoding (binaries built once by build_llama_cpp.sh, ~15-40 min on 2 cores), and z-lab's reference
# DFlash loop (`pip install --no-deps dflash`), on HumanEval, with loop shares. RESULTS.md is then
# regenerated from the full_*.json already in benchmarks/results plus this run.
# DRAFT (default cpu-trained), LIMIT prompts (default 6), TOKENS new tokens (default: bench's).
set -euo pipefail
DRAFT=${DRAFT:-cpu-trained}
LIMIT=${LIMIT:-6}
OUT=benchmarks/results
PYTHON=${PYTHON:-python} bash benchmarks/build_llama_cpp.sh
hetero-sd bench --draft "$DRAFT" --dataset humaneval --limit "$LIMIT" ${TOKENS:+--max-new-tokens "$TOKENS"} \
  --peers llama.cpp-dflash,zlab-reference,llama.cpp --floor --json "$OUT/field_humaneval.json"
python benchmarks/results_md.py "$OUT"/full_chat_math_summarize.json "$OUT"/full_humaneval.json \
  "$OUT/field_humaneval.json" --out benchmarks/RESULTS.md --chart "$OUT/full.png"
