#!/usr/bin/env bash
# The README's results table: the default pair with default flags on the chat and HumanEval sets at T=0 and T=1,
# LIMIT prompts (6) x TOKENS new tokens (128), plain and speculative decoding alternating prompt by prompt in one
# process, RUNS rounds (3), round r sampling with --seed r (at T=1 each round draws other answers: three samples, not
# one measured three times); then the draft on ane-sim (the emulated Neural Engine) on chat, and
# benchmarks/RESULTS.md regenerated from every file it cites. Run it with nothing else on the machine: the
# speedups are ratios within a run, but a busy neighbour still moves them.
#   bash benchmarks/decode.sh          (BIN: the venv's bin folder, .venv/bin)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=benchmarks/results/decode
mkdir -p "$OUT"
for r in $(seq 1 "${RUNS:-3}"); do
  for set in chat humaneval; do
    "$BIN/hetero-sd" bench --dataset "$set" --limit "${LIMIT:-6}" --max-new-tokens "${TOKENS:-128}" --temperature 0,1 \
        --seed "$r" --json "$OUT/${set}_r$r.json"
  done
done
"$BIN/hetero-sd" bench --draft-device ane-sim --dataset chat --limit "${LIMIT:-6}" --json "$OUT/ane_sim_chat.json"
"$BIN/python" benchmarks/results_md.py
