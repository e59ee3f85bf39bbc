#!/usr/bin/env bash
# Start, or resume, the self-distillation data job for the default target in the background.
# Shards go to benchmarks/distill-data/SmolLM2-135M-Instruct/ (committed); a restart skips every
# prompt already answered there. Progress: $OUT/progress.json; log: $LOG; the job's PID: $PIDFILE.
#   bash benchmarks/distill_data.sh            # PY=... to choose the interpreter, THREADS=1 by default
# Stop it with: kill $(cat $PIDFILE)   (SIGTERM: it writes its finished answers first)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/distill-data/SmolLM2-135M-Instruct}
LOG=${LOG:-/work/jobs/datagen.log}
PIDFILE=${PIDFILE:-/work/jobs/datagen.pid}
PY=${PY:-python}
mkdir -p "$(dirname "$LOG")" "$(dirname "$PIDFILE")"
# One thread: on 2 shared cores a second thread mostly waits at barriers when other jobs run.
nice -n 19 nohup env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m hetero_sd.cli train-draft \
    --target default --distill "$OUT" --generate-only --threads "${THREADS:-1}" \
    --gen-batch-size "${SLOTS:-48}" "$@" > "$LOG" 2>&1 &
echo $! > "$PIDFILE"
echo "data job $(cat "$PIDFILE"): log $LOG, progress $OUT/progress.json"
