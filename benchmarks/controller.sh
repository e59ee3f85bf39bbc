#!/usr/bin/env bash
# The block-size controller against plain decoding and fixed block sizes (issue 14), T=0, one bench run
# per draft and prompt set, plus the stretch-oracle run. Writes benchmarks/results/controller_*.json.
#   bash benchmarks/controller.sh [LIMIT] [MAX_NEW_TOKENS]
set -euo pipefail
LIMIT=${1:-4}
MAX_NEW=${2:-128}
OUT=benchmarks/results
hetero-sd bench --draft random --dataset chat --limit "$LIMIT" --max-new-tokens "$MAX_NEW" \
  --blocks 16,8,4,auto --json "$OUT/controller_random_chat.json"
for DATASET in chat humaneval; do
  hetero-sd bench --draft cpu-trained --dataset "$DATASET" --limit "$LIMIT" --max-new-tokens "$MAX_NEW" \
    --blocks 16,8,4,auto --json "$OUT/controller_cputrained_${DATASET}.json"
done
python benchmarks/controller_oracle.py --dataset humaneval --limit "$LIMIT" --max-new-tokens 192 --stretch 32 \
  --json "$OUT/controller_oracle.json"
python benchmarks/controller_sim.py --costs "$OUT/controller_oracle.json" --json "$OUT/controller_sim.json"
