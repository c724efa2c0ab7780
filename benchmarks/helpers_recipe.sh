#!/usr/bin/env bash
# Issue 22's helpers for smollm2-135m, trained on the regenerated answers of benchmarks/data_recipe.sh.
# Every stage resumes where the last run stopped: feature shards skip the answers already done, and each training
# run goes on from its checkpoint in chunks of $CHUNK minutes (a session that ends mid-chunk loses that chunk at
# most). Run it in the background, alone on the cores:
#   (setsid nohup nice -n 19 benchmarks/helpers_recipe.sh >> out/helpers-recipe.log 2>&1 &)
# STAGES picks what runs (default: all, in order): features-t0 head-t0 features-t1 head-t1 draft companion.
# PAIR=1: the Qwen2.5-Coder pair's helpers (issue 36) from benchmarks/pair_data_recipe.sh's answers: the 1.5B's
# features in its own Q4_K_M blocks, EAGLE-3 heads with a 32,768-token draft vocabulary (of 151,936), and the
# companion (the pair's draft is the 0.5B, so no draft is trained); work in out/helpers-pair. On 2 CPU cores the
# features alone are one forward of the 1.5B over every answer (about 30 tokens/s at 2 threads here): hours.
# Installing the results into draftwise/weights/ and retraining what depends on the draft (SPRINTER verifiers,
# SpecDec++ heads, SV profiles) are the commands of benchmarks/README.md, run after this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET=smollm2-135m DRAFT_VOCAB=8192 DEFAULT_STAGES="features-t0 head-t0 features-t1 head-t1 draft companion"
if [ "${PAIR:-0}" = 1 ]; then
    TARGET=qwen2.5-coder-1.5b DRAFT_VOCAB=32768 DEFAULT_STAGES="features-t0 head-t0 features-t1 head-t1 companion"
    ANSWERS=${ANSWERS:-data/answers/qwen2.5-coder-1.5b} WORK=${WORK:-out/helpers-pair}
fi
ANSWERS=${ANSWERS:-data/answers/smollm2-135m}
WORK=${WORK:-out/helpers}
CHUNK=${CHUNK:-30}              # minutes per training chunk
HEAD_STEPS=${HEAD_STEPS:-6000}  # batches of 8 answers: about 2 epochs of 3M answer tokens
DRAFT_STEPS=${DRAFT_STEPS:-6000}
# positions a sequence keeps in training: Spec-Bench's summarisation and RAG prompts run to 700-1,000 tokens,
# which the first heads (640) never saw; the docstring prompts of the data recipe reach that far
MAX_LEN=${MAX_LEN:-1536}
STAGES=${STAGES:-$DEFAULT_STAGES}

features() {  # $1: answer tag, $2: shard directory
    "$PY" -m draftwise train-data --target "$TARGET" --features-from "$ANSWERS" --tags "$1" --out "$2" \
        --dtype auto --shard-size 256
}

until_finished() {  # run a resumable training command in chunks until its report says it finished
    local report=$1; shift
    while true; do
        "$@" --minutes "$CHUNK"
        "$PY" - "$report" <<'EOF' && break
import json, sys
r = json.load(open(sys.argv[1]))
sys.exit(0 if r.get("finished") or r.get("stopped_early") is False else 1)
EOF
    done
}

train_head() {  # $1: shard directories, $2: output directory
    until_finished "$2/distill-report.json" "$PY" -m draftwise train-eagle3 --target "$TARGET" --data "$1" \
        --out "$2" --threads 2 --steps "$HEAD_STEPS" --warmup 50 --lr 1e-3 --batch-size 8 --ttt-steps 5 \
        --draft-vocab "$DRAFT_VOCAB" --checkpoint-every 50 --max-len "$MAX_LEN"
}

draft() {  # $1: output directory, then the model's shape
    local out=$1; shift
    until_finished "$out/distill-report.json" "$PY" -m draftwise distill --target "$TARGET" \
        --data "$WORK/features-t0,$WORK/features-t1" --out "$out" --steps "$DRAFT_STEPS" --max-len "$MAX_LEN" \
        --checkpoint-every 200 --output-vocab 8192 "$@"
}

for stage in $STAGES; do
    echo "helpers recipe: $stage ($(date -u +%FT%TZ))"
    case $stage in
        features-t0) features greedy "$WORK/features-t0" ;;
        features-t1) features t1 "$WORK/features-t1" ;;
        head-t0) train_head "$WORK/features-t0" "$WORK/head-t0" ;;
        head-t1) train_head "$WORK/features-t1,$WORK/features-t0" "$WORK/head-t1" ;;
        draft) draft "$WORK/draft" --hidden-size 160 --num-layers 2 --num-heads 4 --intermediate-size 480 ;;
        companion) draft "$WORK/companion" --hidden-size 96 --num-layers 2 --num-heads 3 --intermediate-size 288 ;;
        *) echo "unknown stage $stage" >&2; exit 2 ;;
    esac
done
echo "helpers recipe: done"
