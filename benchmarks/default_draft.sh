#!/usr/bin/env bash
# Issue "Train the default draft": the shipped SmolLM2 draft against the autoregressive baseline,
# torch backend, float32 for both, block 16, 256 new tokens, T=0 and T=1. Each bench runs the
# baseline and speculative decoding alternately on the same prompts in one process.
#   bash benchmarks/default_draft.sh [HUMANEVAL_LIMIT]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
LIMIT=${1:-20}
OUT=benchmarks/results
"$BIN/hetero-sd" bench --draft default --dataset humaneval --limit "$LIMIT" --max-new-tokens 256 \
    --json "$OUT/default_draft_humaneval_t0.json"
"$BIN/hetero-sd" bench --draft default --dataset chat --max-new-tokens 256 \
    --json "$OUT/default_draft_chat_t0.json"
"$BIN/hetero-sd" bench --draft default --dataset humaneval --limit "$LIMIT" --max-new-tokens 256 \
    --temperature 1.0 --seed 0 --json "$OUT/default_draft_humaneval_t1.json"
