#!/usr/bin/env bash
# The full comparison on this machine in one command, then RESULTS.md and the chart regenerated from
# the JSON. Peers that are not installed are skipped with a note; for all of them:
#   pip install llama-cpp-python mlx-lm     (llama-cpp-python builds llama.cpp from source, ~5 min)
# DRAFT: the draft (default: the shipped one, else pass a folder or `random`). LIMIT prompts per set.
# PLACEMENTS (target/draft devices) x TEMPS (temperatures): every pair is a full run on the same prompts.
# PEERS: which peers (mlx-lm on Linux is MLX's slow CPU build: ~1.6 tok/s, so it is off by default there).
set -euo pipefail
DRAFT=${DRAFT:-default}
LIMIT=${LIMIT:-4}
TOKENS=${TOKENS:-128}
PLACEMENTS=${PLACEMENTS:-cpu/cpu,cpu/ane-sim}
TEMPS=${TEMPS:-0,1}
if [[ "$(uname)" == Darwin ]]; then PEERS=${PEERS:-all}; else PEERS=${PEERS:-transformers,transformers-lookup,llama.cpp}; fi
OUT=benchmarks/results
hetero-sd bench --draft "$DRAFT" --dataset chat,math,summarize --limit "$LIMIT" --max-new-tokens "$TOKENS" \
  --placements "$PLACEMENTS" --temperature "$TEMPS" --seed 0 --peers "$PEERS" --floor \
  --json "$OUT/full_chat_math_summarize.json"
hetero-sd bench --draft "$DRAFT" --dataset humaneval --limit "$LIMIT" --max-new-tokens "$TOKENS" \
  --temperature "$TEMPS" --seed 0 --peers "$PEERS" --floor --json "$OUT/full_humaneval.json"
python benchmarks/results_md.py "$OUT"/full_chat_math_summarize.json "$OUT"/full_humaneval.json \
  --out benchmarks/RESULTS.md --chart "$OUT/full.png"
