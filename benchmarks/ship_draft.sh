#!/usr/bin/env bash
# Evaluate a training run's current draft against the shipped default, and (INSTALL=1) ship it: the checks every
# shipped step of the default draft went through (docs/training.md), as one command. Run it with the trainer
# stopped (it times real decoding) and nothing else running.
#   RUN=/tmp/train-out/e2 TAG=20700 [LIMIT=6] [CURVE=e2] [FEATURES=dir] [INSTALL=1] PY=.venv/bin/python bash benchmarks/ship_draft.sh
# (FEATURES: the held-out rows' target features kept between evaluations)
# 1. a snapshot of the run's draft (model, config, training record, log) in /tmp/ship-$TAG;
# 2. held-out simulated decoding at blocks of 2 and 8, each appended to its learning curve
#    (benchmarks/results/training/$CURVE{-block2,}-curve.json: a run that starts its step count anew, e.g. from
#    a shipped draft, gets its own CURVE name) and written to $SCRATCH/heldout_block{2,8}.json;
# 3. its reduced head (`hetero-sd draft-vocab --k 8192`, as the default ships);
# 4. real decoding, shipped default vs this draft, chat and HumanEval, blocks 2, 8 and auto, one bench per
#    draft and set ($SCRATCH/{set}_{shipped,new}.json), then a summary;
# 5. with INSTALL=1: the draft's files copied over hetero_sd/data/drafts/SmolLM2-135M-Instruct-cpu-trained/, and
#    the installed draft's held-out figures into benchmarks/results/heldout/ and the folder's held_out.json.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RUN:?RUN=the training run folder}" "${TAG:?TAG=a name for this snapshot, e.g. its step}"
PY=${PY:-python}
BIN=$(dirname "$PY")
LIMIT=${LIMIT:-6}
SNAP=/tmp/ship-$TAG
VOCAB=/tmp/ship-$TAG-vocab
OUT=benchmarks/results/training
SCRATCH=${SCRATCH:-/tmp/ship-$TAG-results}
SHIPPED=hetero_sd/data/drafts/SmolLM2-135M-Instruct-cpu-trained
mkdir -p "$SNAP" "$SCRATCH"
cp "$RUN"/model.safetensors "$RUN"/config.json "$RUN"/training.json "$RUN"/log.jsonl "$SNAP"/
for block in 2 8; do
  curve=$OUT/${CURVE:-e2}-curve.json; [ "$block" = 2 ] && curve=$OUT/${CURVE:-e2}-block2-curve.json
  "$PY" benchmarks/eval_heldout.py --block-size "$block" --run "$SNAP" --curve "$curve" --json "$SCRATCH/heldout_block${block}.json" \
      ${FEATURES:+--feature-cache "$FEATURES"}
done
rm -rf "$VOCAB"
"$BIN/hetero-sd" draft-vocab --draft "$SNAP" --k 8192 --out "$VOCAB"
for set in chat humaneval; do
  for which in shipped new; do
    draft=default; [ "$which" = new ] && draft=$VOCAB
    "$BIN/hetero-sd" bench --dataset "$set" --draft "$draft" --limit "$LIMIT" --max-new-tokens 128 --blocks 2,8,auto \
        --json "$SCRATCH/${set}_${which}.json" > /dev/null
  done
done
"$PY" - "$SCRATCH" <<'EOF'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("*_*.json")):
    if path.stem.startswith("heldout"):
        continue
    d = json.loads(path.read_text())
    print(f"{path.stem:20s}", "  ".join(f"block {s['block']}: tau {s['tau']:.3f} {s['speedup']:.3f}x{'' if s['lossless'] else ' NOT LOSSLESS'}"
                                       for s in d["schedules"]))
EOF
if [ "${INSTALL:-0}" = 1 ]; then
  cp "$VOCAB"/config.json "$VOCAB"/model.safetensors "$VOCAB"/hetero_sd.json "$VOCAB"/training.json "$VOCAB"/draft_vocab.json "$SHIPPED"/
  chmod 644 "$SHIPPED"/*
  "$PY" - "$SHIPPED/draft_vocab.json" "$RUN" <<'EOF'
import json, sys
path, run = sys.argv[1], sys.argv[2]
d = json.load(open(path))
d["source_draft"] = run  # the training run, not the /tmp snapshot
json.dump(d, open(path, "w"), indent=1)
EOF
  # the load note's figures (hetero_sd/loading/loader.py, cpu_trained_note): the installed draft as the runtime
  # loads it (its reduced head), simulated decoding at blocks of 2 without and with the lookup
  "$PY" benchmarks/eval_heldout.py --draft "$SHIPPED" --block-size 2 --json benchmarks/results/heldout/block2.json \
      ${FEATURES:+--feature-cache "$FEATURES"} > /dev/null
  "$PY" benchmarks/eval_heldout.py --draft "$SHIPPED" --block-size 2 --lookup 0.4 --json benchmarks/results/heldout/block2_lookup.json \
      ${FEATURES:+--feature-cache "$FEATURES"} > /dev/null
  "$PY" benchmarks/eval_heldout.py --draft "$SHIPPED" --block-size 8 --json benchmarks/results/heldout/block8.json \
      ${FEATURES:+--feature-cache "$FEATURES"} > /dev/null
  "$PY" - "$SHIPPED" benchmarks/results/heldout/block2.json benchmarks/results/heldout/block2_lookup.json <<'EOF'
import json, sys, time
folder, plain, lookup = sys.argv[1], *(json.load(open(p)) for p in sys.argv[2:])
key = next(k for k in plain if isinstance(plain[k], dict) and "sharegpt" in plain[k] and k != "ngram_floor")
right = lambda d: {"chat": d[key]["sharegpt"]["position_1_right"], "code": d[key]["stdlib"]["position_1_right"]}
json.dump({"what": "simulated greedy decoding on the 256 held-out rows (benchmarks/eval_heldout.py), this draft as the runtime loads it",
           "measured": time.strftime("%Y-%m-%d"), "block_size": 2, "position_1_right": right(plain),
           "position_1_right_with_lookup": {**right(lookup), "lookup": 0.4},
           "ngram_floor": {"chat": plain["ngram_floor"]["sharegpt"]["position_1_right"],
                           "code": plain["ngram_floor"]["stdlib"]["position_1_right"]}},
          open(f"{folder}/held_out.json", "w"), indent=1)
EOF
  echo "installed into $SHIPPED: run the tests that read it (test_default_draft, test_draft_int8, test_quant8, test_draft_vocab, test_lossless, test_short_blocks)"
fi
