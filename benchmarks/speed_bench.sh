#!/bin/sh
# Issue 12 before/after, tokens/s: autoregressive and DFlash (cpu-trained draft, blocks 16 and 8) on the
# chat and HumanEval sets. "before" = the previous paths (torch matmul for float32, float32 draft);
# "after" = the defaults. Usage: sh benchmarks/speed_bench.sh [LIMIT] [MAX_NEW_TOKENS]
set -e
LIMIT=${1:-4}
MAX=${2:-64}
OUT=benchmarks/results
for set in chat humaneval; do
  HETERO_SD_GEMM=torch python -m hetero_sd.cli bench --dataset $set --limit $LIMIT --max-new-tokens $MAX \
    --blocks 16,8 --draft-dtype float32 --json $OUT/speed_before_$set.json
  python -m hetero_sd.cli bench --dataset $set --limit $LIMIT --max-new-tokens $MAX \
    --blocks 16,8 --json $OUT/speed_after_$set.json
done
