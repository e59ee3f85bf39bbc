#!/usr/bin/env bash
# Train (or resume) one arm of the default draft's recipe on the self-distillation shards, in the
# background, one torch thread, nice 19. The arms differ only in --soft (hard labels: 0; soft: 0.5), so
# running both side by side is the hard/soft ablation at equal compute (each log records CPU seconds).
#   ARM=hard bash benchmarks/train_draft.sh     # or ARM=soft; STEPS, LR, OUT, PY, THREADS, INIT to override
# Resumes from $OUT/checkpoint.pt when it exists. Stop with: kill $(cat /work/jobs/train-$ARM.pid)
set -euo pipefail
cd "$(dirname "$0")/.."
ARM=${ARM:-hard}
case "$ARM" in hard) SOFT=0 ;; soft) SOFT=0.5 ;; *) echo "ARM is hard or soft" >&2; exit 2 ;; esac
OUT=${OUT:-/work/jobs/train-$ARM}
PY=${PY:-python}
RESUME=""; [ -f "$OUT/checkpoint.pt" ] && RESUME=--resume
mkdir -p "$OUT" /work/jobs
nice -n 19 nohup env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m hetero_sd.cli train-draft \
    --target default --distill benchmarks/distill-data/SmolLM2-135M-Instruct --out "$OUT" \
    --init-from "${INIT:-cpu-trained}" --layers 2 --block-size 16 --steps "${STEPS:-1500}" --lr "${LR:-6e-4}" \
    --soft "$SOFT" --eval-every 100 --snapshots --threads "${THREADS:-1}" $RESUME > "$OUT/train.log" 2>&1 &
echo $! > "/work/jobs/train-$ARM.pid"
echo "train-$ARM $(cat /work/jobs/train-$ARM.pid): log $OUT/train.log"
