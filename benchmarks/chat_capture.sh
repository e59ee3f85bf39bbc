#!/usr/bin/env bash
# The chat app's streaming as seen in a terminal (issue 27: "unchanged to the eye"): runs `hetero-sd chat`
# in a detached 120x40 tmux session on the default target and draft, asks one question, and saves the
# pane every CAPTURE_EVERY seconds while the answer streams, and once more 20 s later.
#   bash benchmarks/chat_capture.sh [OUT_DIR]      (default: benchmarks/results/chat_capture)
set -euo pipefail
OUT=${1:-benchmarks/results/chat_capture}
HSD=${HSD:-.venv/bin/hetero-sd}
EVERY=${CAPTURE_EVERY:-2}
SESSION=hsd-chat-capture-$$
PROMPT=${PROMPT:-Write a short poem about the sea.}
mkdir -p "$OUT"
CMD="$HSD chat --target default --draft default --max-new-tokens 96 --temperature 0"
tmux new-session -d -s "$SESSION" -x 120 -y 40 "$CMD"
trap 'tmux kill-session -t "$SESSION" 2>/dev/null || true' EXIT
# wait for the models to load: the prompt box is enabled and the status line says so
for _ in $(seq 1 300); do
  sleep 1
  if tmux capture-pane -p -t "$SESSION" | grep -q "Ask something"; then break; fi
done
tmux capture-pane -p -t "$SESSION" > "$OUT/0-loaded.txt"
tmux send-keys -t "$SESSION" "$PROMPT" Enter
for i in $(seq 1 12); do
  sleep "$EVERY"
  tmux capture-pane -p -t "$SESSION" > "$OUT/$i-streaming.txt"
done
sleep 20
tmux capture-pane -p -t "$SESSION" > "$OUT/13-streaming.txt"  # 20 s later (still streaming on a loaded CPU)
{ echo "command: $CMD"; echo "prompt: $PROMPT"; echo "tmux: 120x40, captures every ${EVERY}s after Enter";
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse --short HEAD)";
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg) (other jobs running)"; } > "$OUT/README.txt"
