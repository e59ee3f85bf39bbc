#!/usr/bin/env bash
# The shipped draft's recipe (docs/training.md), as background jobs that resume where they stopped.
#
#   bash benchmarks/train_draft.sh data [FLAGS]    self-distillation answers into $OUT's shards
#   bash benchmarks/train_draft.sh train           train (or resume) a draft on the shards
#
# data: `hetero-sd train-draft --generate-only`, nice 19, $THREADS torch threads (1), $SLOTS rows at once (48);
#   OUT (benchmarks/distill-data/SmolLM2-135M-Instruct, committed); FLAGS go to train-draft, e.g. the second store:
#     OUT=benchmarks/distill-data/SmolLM2-135M-Instruct-int8-turns HETERO_SD_KV=float16 bash benchmarks/train_draft.sh \
#         data --gen-dtype int8 --sharegpt-turns all --skip-answered benchmarks/distill-data/SmolLM2-135M-Instruct
#   (that store was answered with K in float16: its manifest refuses answers of another K cache).
#   Progress: $OUT/progress.json; stop with kill $(cat $OUT/datagen.pid) (SIGTERM writes finished answers first).
# train: every anchor of $ACCUMULATE sequences per step (4), split attention, target features kept in $FEATURES
#   (each sequence's target forward runs once). Variables: OUT (/tmp/train-out/$ARM), INIT (cpu-trained), LAYERS (2),
#   BLOCK (16), STEPS (6000), LR (1e-3), GAMMA (the loss's position decay), SHORT (share of short blocks), ANCHORS
#   (0: all), VOCAB_K (8192), HELD_OUT (256), EVAL (10), THREADS (1), MORE_DATA (further --distill stores),
#   FEATURE_NUMERICS (float32, or int8: the runtime's target), ARM (hard, or soft: --soft 0.5, no feature cache).
#   Checkpoints stay in $OUT (outside git); the same command resumes from $OUT/checkpoint.pt. Stop: kill $(cat $OUT/pid)
# PY chooses the interpreter (python).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
[ $# -gt 0 ] && shift
PY=${PY:-python}
case "$MODE" in
data)
  OUT=${OUT:-benchmarks/distill-data/SmolLM2-135M-Instruct}
  mkdir -p "$OUT"
  # One thread: on 2 shared cores a second thread mostly waits at barriers when other jobs run.
  nice -n 19 nohup env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m hetero_sd.cli train-draft \
      --target default --distill "$OUT" --generate-only --threads "${THREADS:-1}" \
      --gen-batch-size "${SLOTS:-48}" "$@" > "$OUT/datagen.log" 2>&1 &
  echo $! > "$OUT/datagen.pid"
  echo "data job $(cat "$OUT/datagen.pid"): log $OUT/datagen.log, progress $OUT/progress.json"
  ;;
train)
  ARM=${ARM:-hard}
  case "$ARM" in hard) SOFT=0 ;; soft) SOFT=0.5 ;; *) echo "error: ARM=$ARM is not an arm; fix: ARM=hard or ARM=soft" >&2; exit 2 ;; esac
  OUT=${OUT:-/tmp/train-out/$ARM}
  FEATURES=${FEATURES:-/tmp/train-out/features}
  RESUME=""; [ -f "$OUT/checkpoint.pt" ] && RESUME=--resume
  mkdir -p "$OUT"
  # glibc hands each freed tensor of tens of MB back and page-faults the next one in; these thresholds keep the
  # memory in the process (a step took 0.89x the time). glibc takes a threshold above 32 MB from the environment only.
  MALLOC="MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456"
  nice -n 19 nohup env $MALLOC PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m hetero_sd.cli train-draft \
      --target default --distill benchmarks/distill-data/SmolLM2-135M-Instruct $(for d in ${MORE_DATA:-}; do printf -- '--distill %s ' "$d"; done) --out "$OUT" \
      --init-from "${INIT:-cpu-trained}" --layers "${LAYERS:-2}" --block-size "${BLOCK:-16}" --steps "${STEPS:-6000}" --lr "${LR:-1e-3}" \
      ${GAMMA:+--gamma "$GAMMA"} ${SHORT:+--short-blocks "$SHORT"} --accumulate "${ACCUMULATE:-4}" --anchors "${ANCHORS:-0}" \
      --vocab-frequent "${VOCAB_K:-8192}" --feature-cache "$FEATURES" --feature-numerics "${FEATURE_NUMERICS:-float32}" \
      --held-out "${HELD_OUT:-256}" --soft "$SOFT" --eval-every "${EVAL:-10}" --threads "${THREADS:-1}" $RESUME >> "$OUT/train.log" 2>&1 &
  echo $! > "$OUT/pid"
  echo "train-$ARM $(cat "$OUT/pid"): log $OUT/log.jsonl, $OUT/train.log"
  ;;
*)
  echo "error: '${MODE}' is not a stage; fix: bash benchmarks/train_draft.sh data|train (see the script's header)" >&2
  exit 2
  ;;
esac
