#!/usr/bin/env bash
# Issue-4 checks on this machine: the draft in emulated fp16 (ane-sim) with its drift against the float32
# draft, and MLX placements (on Linux MLX runs on its slow CPU build: these runs check correctness, not speed).
# DRAFT: a trained draft folder for the ane-sim drift run (default: random).
set -euo pipefail
DRAFT=${DRAFT:-random}
TAG=${TAG:-random}
OUT=benchmarks/results
hetero-sd bench --draft "$DRAFT" --draft-device ane-sim --dataset humaneval --limit 4 --max-new-tokens 128 \
  --json "$OUT/ane_sim_${TAG}_humaneval.json"
hetero-sd bench --draft random --draft-device ane-sim --limit 2 --max-new-tokens 64 --json "$OUT/ane_sim_random_chat.json"
hetero-sd bench --draft random --draft-device mlx --limit 2 --max-new-tokens 32 --json "$OUT/mlx_draft_random.json"
hetero-sd bench --draft random --target-device mlx --draft-device mlx --limit 1 --max-new-tokens 16 \
  --json "$OUT/mlx_target_draft_random.json"
