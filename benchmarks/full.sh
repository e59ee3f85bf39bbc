#!/usr/bin/env bash
# The full comparison on this machine in one command, then RESULTS.md and the chart regenerated from
# the JSON. Peers that are not installed are skipped with a note; for all of them:
#   pip install llama-cpp-python mlx-lm     (llama-cpp-python builds llama.cpp from source, ~5 min)
# DRAFT: the draft (default: the shipped one, else pass a folder or `random`). LIMIT prompts per set.
set -euo pipefail
DRAFT=${DRAFT:-default}
LIMIT=${LIMIT:-4}
TOKENS=${TOKENS:-128}
OUT=benchmarks/results
hetero-sd bench --draft "$DRAFT" --dataset chat,math,summarize --limit "$LIMIT" --max-new-tokens "$TOKENS" \
  --peers all --floor --json "$OUT/full_chat_math_summarize.json"
hetero-sd bench --draft "$DRAFT" --dataset humaneval --limit "$LIMIT" --max-new-tokens "$TOKENS" \
  --peers all --floor --json "$OUT/full_humaneval.json"
hetero-sd bench --draft "$DRAFT" --dataset chat --limit "$LIMIT" --max-new-tokens "$TOKENS" --temperature 1.0 \
  --seed 0 --json "$OUT/full_chat_t1.json"
python benchmarks/results_md.py "$OUT"/full_chat_math_summarize.json "$OUT"/full_humaneval.json \
  "$OUT"/full_chat_t1.json --out benchmarks/RESULTS.md --chart "$OUT/full.png"
