#!/usr/bin/env bash
# Train (or resume) the default draft's recipe on the self-distillation shards, in the background, one
# torch thread, nice 19: every anchor of 4 sequences per step, split attention, target features kept on
# disk in $FEATURES (each sequence's target forward runs once, in the first epoch). ARM=soft adds --soft 0.5
# (soft labels run the target every time: no feature cache). Checkpoints stay in $OUT (outside git).
#   ARM=hard PY=.venv/bin/python bash benchmarks/train_draft.sh   # STEPS, LR, OUT, FEATURES, INIT, THREADS, EVAL, VOCAB_K, HELD_OUT,
#   ACCUMULATE (sequences per optimizer step, default 4), ANCHORS (blocks per sequence, 0: all), BLOCK (16; 8: gamma 4), GAMMA (the loss's position decay),
#   SHORT (share of blocks trained at a random shorter length, for the block-size controller's short blocks)
#   LAYERS (the draft's layers, 2; above the INIT draft's: a deeper draft grown from it, new layers starting as identities)
#   MORE_DATA (further --distill stores beside the float32 shards, space-separated; each keeps its own held-out rows),
#   FEATURE_NUMERICS (float32, or int8: the runtime's target; FEATURES must then be a store of int8 features)
# Resumes from $OUT/checkpoint.pt when it exists (the same command). Stop with: kill $(cat $OUT/pid)
set -euo pipefail
cd "$(dirname "$0")/.."
ARM=${ARM:-hard}
case "$ARM" in hard) SOFT=0 ;; soft) SOFT=0.5 ;; *) echo "ARM is hard or soft" >&2; exit 2 ;; esac
OUT=${OUT:-/work/train-out/$ARM}
FEATURES=${FEATURES:-/work/train-out/features}
PY=${PY:-python}
RESUME=""; [ -f "$OUT/checkpoint.pt" ] && RESUME=--resume
mkdir -p "$OUT"
# glibc keeps freed memory in the process: a step allocates and frees tensors of tens of MB ([1024 rows x ~10k]
# logits, attention scores), each a fresh mmap that page-faults as it is first written; with these settings a
# G4 step took 0.89x the time (40 steps, 3 alternating runs each, 2-core Zen 5, 27 Nov; benchmarks/TRAINING.md).
# glibc accepts a threshold above 32 MB from the environment only (mallopt refuses it).
MALLOC="MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456"
nice -n 19 nohup env $MALLOC PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m hetero_sd.cli train-draft \
    --target default --distill benchmarks/distill-data/SmolLM2-135M-Instruct $(for d in ${MORE_DATA:-}; do printf -- '--distill %s ' "$d"; done) --out "$OUT" \
    --init-from "${INIT:-cpu-trained}" --layers "${LAYERS:-2}" --block-size "${BLOCK:-16}" --steps "${STEPS:-6000}" --lr "${LR:-1e-3}" \
    ${GAMMA:+--gamma "$GAMMA"} ${SHORT:+--short-blocks "$SHORT"} --accumulate "${ACCUMULATE:-4}" --anchors "${ANCHORS:-0}" --vocab-frequent "${VOCAB_K:-8192}" --feature-cache "$FEATURES" --feature-numerics "${FEATURE_NUMERICS:-float32}" --held-out "${HELD_OUT:-256}" \
    --soft "$SOFT" --eval-every "${EVAL:-10}" --threads "${THREADS:-1}" $RESUME >> "$OUT/train.log" 2>&1 &
echo $! > "$OUT/pid"
echo "train-$ARM $(cat "$OUT/pid"): log $OUT/log.jsonl, $OUT/train.log"
