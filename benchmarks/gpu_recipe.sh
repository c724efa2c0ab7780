#!/usr/bin/env bash
# Issue 22's answers and helpers on one CUDA GPU: the same commands as data_recipe.sh and helpers_recipe.sh with
# --device "$DEVICE", ordered so the greedy head comes first (a lent GPU can go away at any time). The prompt mix is
# written on the CPU machine, where the fortune packages and the docstrings live:
#   draftwise train-data --answers --out data/answers/smollm2-135m --dtype auto --num-magpie 12000 \
#       --sources spec-bench,human-eval,magpie,fortunes,german,docs --num-fortunes 6000 --num-german 3000 \
#       --num-docs 2000 --write-prompts out/prompts/all.jsonl
# then, on the GPU machine: PROMPTS=out/prompts/all.jsonl benchmarks/gpu_recipe.sh
# Every step resumes (answers skip finished uids, feature shards finished answers, training its checkpoint). What
# comes back to the CPU machine is packed in $RES as it finishes: the new answer chunks, each helper's directory.
# The answers are the GPU's: the GGUF's weights dequantised to bf16 (the CPU's `auto` runs them as int4 groups
# with bf16 activations), so a greedy answer can part from the CPU's at a near-tie; each chunk's meta says which.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PROMPTS=${PROMPTS:?PROMPTS: a train-data --write-prompts file}
ANSWERS=${ANSWERS:-data/answers/smollm2-135m}
WORK=${WORK:-out/helpers}
RES=${RES:-$WORK/results}
BATCH=${BATCH:-256}                # answers decoded at once
ANSWER_MINUTES=${ANSWER_MINUTES:-8}
T1_LIMIT=${T1_LIMIT:-6000}         # sampled answers: the first N prompts of the mix
HEAD_STEPS=${HEAD_STEPS:-5000}
HEAD_BATCH=${HEAD_BATCH:-16}
DRAFT_STEPS=${DRAFT_STEPS:-6000}
DRAFT_BATCH=${DRAFT_BATCH:-32}
MAX_LEN=${MAX_LEN:-1536}
DEVICE=${DEVICE:-cuda}
ANSWER_LIMIT=${ANSWER_LIMIT:-0}    # greedy: the first N prompts of the mix (0: all)
STAGES=${STAGES:-"answers-t0 head-t0 answers-t1 head-t1 draft companion"}
mkdir -p "$RES" "$WORK"
RES=$(cd "$RES" && pwd)
stamp=$(cd "$WORK" && pwd)/.started
[ -e "$stamp" ] || touch "$stamp"

say() { echo "gpu recipe: $* ($(date -u +%T))"; }
answers() {
    "$PY" -m draftwise train-data --target smollm2-135m --answers --out "$ANSWERS" --device "$DEVICE" --dtype auto \
        --max-new-tokens 256 --batch-size "$BATCH" --shard-size 256 --prompts "$PROMPTS" \
        --minutes "$ANSWER_MINUTES" "$@"
}
pack_answers() {  # $1: tag; the chunks this recipe wrote, with the progress log
    (cd "$ANSWERS" && find . -name "answers-$1-*.npz" -newer "$stamp" | sort \
        | tar -cf "$RES/answers-$1.tar" -T - progress.jsonl train-data-report-*.json)
}
features() {  # $1: tag, $2: shard directory
    "$PY" -m draftwise train-data --target smollm2-135m --features-from "$ANSWERS" --tags "$1" --out "$2" \
        --device "$DEVICE" --dtype auto --shard-size 256
}
train_head() {  # $1: shard directories, $2: output directory
    "$PY" -m draftwise train-eagle3 --target smollm2-135m --device "$DEVICE" --data "$1" --out "$2" --steps "$HEAD_STEPS" \
        --warmup 100 --lr 1e-3 --batch-size "$HEAD_BATCH" --ttt-steps 5 --draft-vocab 8192 --checkpoint-every 250 \
        --max-len "$MAX_LEN" \
        && tar -C "$2" -cf "$RES/$(basename "$2").tar" head distill-report.json train-log.jsonl
}
train_draft() {  # $1: output directory, then the model's shape
    local out=$1; shift
    "$PY" -m draftwise distill --target smollm2-135m --device "$DEVICE" --bf16 --data "$WORK/features-t0,$WORK/features-t1" \
        --out "$out" --steps "$DRAFT_STEPS" --batch-size "$DRAFT_BATCH" --max-len "$MAX_LEN" --checkpoint-every 500 \
        --output-vocab 8192 "$@" \
        && tar -C "$out" --exclude checkpoint.pt -cf "$RES/$(basename "$out").tar" .
}

for stage in $STAGES; do
    say "$stage"
    case $stage in
        answers-t0) answers --limit "$ANSWER_LIMIT"; pack_answers greedy ;;
        head-t0) features greedy "$WORK/features-t0" && train_head "$WORK/features-t0" "$WORK/head-t0" ;;
        answers-t1) answers --temperature 1.0 --limit "$T1_LIMIT"; pack_answers t1 ;;
        head-t1) features t1 "$WORK/features-t1" && train_head "$WORK/features-t1,$WORK/features-t0" "$WORK/head-t1" ;;
        draft) train_draft "$WORK/draft" --hidden-size 160 --num-layers 2 --num-heads 4 --intermediate-size 480 ;;
        companion) train_draft "$WORK/companion" --hidden-size 96 --num-layers 2 --num-heads 3 --intermediate-size 288 ;;
        *) say "unknown stage $stage"; exit 2 ;;
    esac || say "FAILED $stage"
done
say "done"
