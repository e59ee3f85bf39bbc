#!/usr/bin/env bash
# Fixed block sizes vs the auto controller, in one bench run per draft and prompt set (T=0, 64 tokens).
# DRAFT: a draft folder (default: random, the untrained 2-layer draft). TAG names the JSON files.
set -euo pipefail
DRAFT=${DRAFT:-random}
TAG=${TAG:-random}
LIMIT=${1:-4}
OUT=benchmarks/results
for DATASET in chat humaneval; do
  hetero-sd bench --draft "$DRAFT" --dataset "$DATASET" --limit "$LIMIT" --max-new-tokens 64 \
    --blocks 16,8,4,2,auto --json "$OUT/blocks_${TAG}_${DATASET}.json"
done
