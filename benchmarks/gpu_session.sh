#!/usr/bin/env bash
# A lent GPU's session (the `device` tool: 15 minutes, one call at most 64 MiB of files, nothing installed
# there but torch/transformers/...): the CUDA test paths, then the default draft trained at scale on CUDA.
# The embedded GGUF (98 MB) is over one call's 64 MiB, so it travels in two xz parts, one per call, and
# the machine must stay warm between the two calls (30 s).
#   here:   PY=.venv/bin/python bash benchmarks/gpu_session.sh pack  # .lease/a (GGUF part 1, gguf wheel), .lease/b (part 2, init draft, rows)
#   call 1: bash benchmarks/gpu_session.sh stash        # carry .lease/a (~60 MB): part 1 into /tmp, nvidia-smi (~40 s with the start)
#           (&& bash benchmarks/gpu_session.sh profile: a step timed per attention group and loss chunk; the
#           fastest becomes call 2's --attention-group/--ce-chunk)
#   call 2, AT ONCE: LAYERS="4 2" MINUTES=8 TRAIN_S=560 bash benchmarks/gpu_session.sh train   # carry .lease/b; timeout_s 590
#           (PACK sequences per forward and ACCUMULATE per step: 8 and 8; LR 2.5e-4; LAYERS 4 grown from the init draft)
#   call 3, if >= ~2 minutes are left: TEST_S=100 bash benchmarks/gpu_session.sh tests   # tests/test_cuda.py
# Training comes first (the guide's order for a lent GPU); call 1 only stages what does not fit call 2.
# The tree that travels must be small (~2 MB): run it from a branch without benchmarks/results,
# benchmarks/distill-data and the shipped draft's weights (benchmarks/TRAINING.md, "A lent GPU"); the init
# draft and the stores' rows (packed by benchmarks/lease_rows.py: their prompt texts come from packages the
# machine lacks) travel in .lease/b. What comes back from call 2: the draft (in <16 MiB parts: join with cat),
# its config, training.json, log.jsonl, train.log, stages.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LEASE=/tmp/lease
STORES="benchmarks/distill-data/SmolLM2-135M-Instruct benchmarks/distill-data/SmolLM2-135M-Instruct-int8-turns"

stage() { echo "$(date +%T) $*" | tee -a "${OUT:-/tmp}/stages.log"; }  # where a cut-off call stopped

setup() {  # the package as the venv sees it (backends/, ane_compiler/, tui/ inside the namespace), gguf
    for d in backends ane_compiler tui; do [ -e hetero_sd/$d ] || ln -s ../$d hetero_sd/$d; done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$1"/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
}

case "${1:-}" in
pack)
    G=$("${PY:-.venv/bin/python}" -c "from hetero_sd.loading.default_model import embedded_gguf; print(embedded_gguf())")
    INIT=${INIT:-hetero_sd/data/drafts/SmolLM2-135M-Instruct-cpu-trained}
    rm -rf .lease && mkdir -p .lease/a .lease/b/init
    grep -qx '/.lease/' .git/info/exclude || echo /.lease/ >> .git/info/exclude
    xz -T2 -6 -c "$G" > /tmp/gguf.xz
    split -b ${PART_A_BYTES:-60000000} -d /tmp/gguf.xz /tmp/gguf.xz.part-
    mv /tmp/gguf.xz.part-00 .lease/a/ && mv /tmp/gguf.xz.part-01 .lease/b/
    sha256sum "$G" | cut -d' ' -f1 > .lease/b/gguf.sha256
    "${PY:-.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: -d .lease/a "gguf==$("${PY:-.venv/bin/python}" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    cp .lease/a/*.whl .lease/b/
    cp "$INIT"/config.json "$INIT"/model.safetensors .lease/b/init/
    "${PY:-.venv/bin/python}" benchmarks/lease_rows.py pack $STORES /tmp/rows.npz && xz -T2 -9 -c /tmp/rows.npz > .lease/b/rows.npz.xz
    du -sh .lease/a .lease/b
    ;;
stash)  # call 1: part 1 of the GGUF kept in /tmp for call 2, the wheel installed, the machine described
    stage stash
    mkdir -p $LEASE && cp .lease/a/gguf.xz.part-* $LEASE/ && cp .lease/a/*.whl $LEASE/
    setup $LEASE
    { nvidia-smi; "$PY" -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/env.txt"
    ;;
profile)  # after stash, same call: a step timed per split-attention group and loss chunk on the GPU itself
    # (benchmarks/train_step_profile.py); the fastest becomes the train call's default (/tmp/lease/best.env)
    stage profile
    setup $LEASE
    L=${LAYERS:-4}; L=${L%% *}
    timeout "${PROFILE_S:-150}" "$PY" benchmarks/train_step_profile.py --device "${DEVICE:-cuda}" --layers "$L" \
        --pack "${PACK:-32}" --forwards $(( ${ACCUMULATE:-64} / ${PACK:-32} )) --groups "${ATT_GROUPS:-32,256,1024}" \
        --chunks "${CHUNKS:-1024,16384}" --steps 3 --out "$OUT/step_profile.json" --trace "$OUT/step_profile.txt" || exit 1
    "$PY" -c "import json, sys; f = json.load(open(sys.argv[1]))['fastest']; print(f'ATTENTION_GROUP={f[\"group\"]} CE_CHUNK={f[\"chunk\"]}')" \
        "$OUT/step_profile.json" | tee $LEASE/best.env
    ;;
tests)  # call 3 (what device time is left): nothing carried
    stage tests
    setup $LEASE
    HETERO_SD_FAILLOG="$OUT/cuda-failures.log" timeout "${TEST_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -rs --tb=short --timeout 40 --durations=0 tests/test_cuda.py 2>&1 | tee "$OUT/cuda-tests.log"
    ;;
train)
    stage train: join the GGUF
    cp .lease/b/gguf.xz.part-* $LEASE/ || exit 1
    cat $LEASE/gguf.xz.part-* | xz -dc > $LEASE/target.gguf
    [ "$(sha256sum $LEASE/target.gguf | cut -d' ' -f1)" = "$(cat .lease/b/gguf.sha256)" ] || { echo "GGUF parts do not join"; exit 1; }
    setup .lease/b
    stage train: rows
    xz -dc .lease/b/rows.npz.xz > $LEASE/rows.npz && "$PY" benchmarks/lease_rows.py unpack $LEASE/rows.npz $LEASE/rows.jsonl || exit 1
    [ -z "${ATTENTION_GROUP:-}" ] && [ -f $LEASE/best.env ] && . $LEASE/best.env  # the profile's choice, unless set here
    # one run per draft depth in LAYERS (e.g. "4 2"), side by side on the one GPU (these small drafts leave it
    # mostly idle between launches): each its own folder and home, each back as model parts and one tarball
    for L in ${LAYERS:-4}; do
        RUN=$LEASE/run$L
        stage train: train-draft, $L layers
        ( HETERO_SD_HOME=$LEASE/home$L timeout "${TRAIN_S:-540}" "$PY" -m hetero_sd.cli train-draft --target $LEASE/target.gguf \
            --data $LEASE/rows.jsonl --out $RUN --init-from .lease/b/init --layers "$L" --block-size 8 --gamma 2 --short-blocks 0.5 \
            --steps 1000000 --minutes "${MINUTES:-7}" --lr "${LR:-2.5e-4}" --accumulate "${ACCUMULATE:-8}" --pack "${PACK:-8}" --vocab-frequent 8192 \
            --attention-group "${ATTENTION_GROUP:-0}" --ce-chunk "${CE_CHUNK:-0}" --held-out 256 --eval-every "${EVAL:-250}" --device "${DEVICE:-cuda}" 2>&1 | tr '\r' '\n' | grep -v "━" > $LEASE/train$L.log ) &
    done
    wait
    for L in ${LAYERS:-4}; do
        RUN=$LEASE/run$L
        stage train: copy back, $L layers
        mkdir -p $RUN && cp $LEASE/train$L.log $RUN/train.log
        tar -czf "$OUT/run$L.tgz" -C $RUN train.log $(cd $RUN && ls config.json training.json log.jsonl 2>/dev/null)
        [ -f $RUN/model.safetensors ] && split -b 15000000 -d $RUN/model.safetensors "$OUT/run$L.model.safetensors.part-"
        tail -2 $RUN/log.jsonl; tail -3 $LEASE/train$L.log
    done
    ;;
*) echo "usage: gpu_session.sh pack|stash|profile|train|tests" >&2; exit 2 ;;
esac
