#!/usr/bin/env bash
# Issue "Train the default draft": a trained draft for SmolLM2 against the autoregressive baseline,
# torch backend, float32 for both, 256 new tokens, T=0 (HumanEval and chat) and T=1 (HumanEval).
# Each bench runs the baseline and speculative decoding alternately on the same prompts in one process.
#   DRAFT=path/to/draft TAG=name [BLOCKS=16,4,auto] bash benchmarks/default_draft.sh [LIMIT] [BLOCK]
# BLOCKS: extra block settings measured on the HumanEval T=0 run (the first one is the headline row).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
DRAFT=${DRAFT:-default}
TAG=${TAG:-default_draft}
LIMIT=${1:-20}
BLOCK=${2:-16}
BLOCKS=${BLOCKS:-$BLOCK}
OUT=benchmarks/results
run() { "$BIN/hetero-sd" bench --draft "$DRAFT" --block-size "$BLOCK" --max-new-tokens 256 --limit "$LIMIT" "$@"; }
run --dataset humaneval --blocks "$BLOCKS" --json "$OUT/${TAG}_b${BLOCK}_humaneval_t0.json"
run --dataset chat --json "$OUT/${TAG}_b${BLOCK}_chat_t0.json"
run --dataset humaneval --temperature 1.0 --seed 0 --json "$OUT/${TAG}_b${BLOCK}_humaneval_t1.json"
