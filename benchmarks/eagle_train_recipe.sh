#!/usr/bin/env bash
# The 1.5B's EAGLE-3 head, trained on this CPU from the feature shards of benchmarks/eagle_data_recipe.sh, in
# resumable chunks. Each chunk is one `draftwise train-eagle3` run of MINUTES minutes: it reads every shard there is
# (the data job may still be writing more), resumes from OUT/checkpoint.pt, trains, checkpoints, exports OUT/head
# and writes OUT/distill-report.json with the held-out agreement (steps 1..5 of the training-time test). A held-out
# sequence is chosen by a hash of its uid, so it stays held out while the shards grow. Chunks follow each other
# until STEPS steps are done. The draft vocabulary is the registry's 32k for the 1.5B
# (draftwise/weights/vocab/qwen2.5-coder-1.5b.json: the tokens most frequent in the target's answers); its logits
# are the target's own LM-head rows, frozen. bf16 autocast where bf16 is native (AVX512-BF16 / AMX), float32 elsewhere.
# The target loads as it serves (--dtype auto: the GGUF's blocks; the head reads its embedding and LM-head rows from
# them, no float copy of the model). While the data job runs (its PID file names a live process), the training waits
# for it, checking every 5 minutes (WAIT_FOR_DATA=0: start now): on 2 cores the two slow each other far more than 2x.
# Cost, measured on a 2-core Zen 3 with the data job sharing the cores: 50-100 s a step at batch 2 of 1,024-token
# sequences. Alone on a 2-core Zen 4 (bf16 autocast): 17 s a step at batch 4 with the 5-step training-time test,
# 2.9 s with --ttt-steps 1 (sequences of 545 tokens on average). From scratch, the 5-step test learned slowly
# there (held-out step-1 agreement 0.10 after 75 steps, 21 min); 500 steps of --ttt-steps 1 from that head
# (--init-from) reached 0.45 in 31 min, but only 0.12 at step 2: a head that drafts chains needs the 5-step test
# after it (benchmarks/README.md, issue 52's first head).
#   mkdir -p out && (setsid nohup nice -n 19 benchmarks/eagle_train_recipe.sh >> out/eagle-train.log 2>&1 &)
#   kill -STOP $(cat out/eagle-train.pid)   # while timing something; kill -CONT ... to go on
#   kill $(cat out/eagle-train.pid)         # stop: the chunk in flight keeps its last checkpoint; re-run to resume
# Progress: OUT/train-log.jsonl (loss, agreement per step), OUT/chunks.jsonl (one line a chunk).
# Extra arguments go to `draftwise train-eagle3` (--batch-size, --lr, --intermediate-size, --max-examples, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-out/eagle-data}
OUT=${OUT:-out/eagle-head}
STEPS=${STEPS:-800}
BATCH=${BATCH:-4}
MINUTES=${MINUTES:-20}
PIDFILE=${PIDFILE:-out/eagle-train.pid}
DATA_PIDFILE=${DATA_PIDFILE:-out/eagle-data.pid}
WAIT_FOR_DATA=${WAIT_FOR_DATA:-1}
NICE=${NICE:-19}  # niced however it was started: it shares the cores with interactive work
renice -n "$NICE" $$ >/dev/null 2>&1 || true
# Linux groups processes by session (sched_autogroup): nice orders processes within one session only, and a
# job started with setsid competes with every other session as an equal. The group's own nice fixes that.
echo "$NICE" 2>/dev/null > /proc/self/autogroup || true
mkdir -p "$(dirname "$PIDFILE")" "$OUT"
if [ -s "$PIDFILE" ] && grep -qs eagle_train_recipe "/proc/$(cat "$PIDFILE")/cmdline"; then
    echo "eagle train recipe: already running as PID $(cat "$PIDFILE") ($PIDFILE)" >&2
    exit 1
fi
if ! ls "$DATA"/shard-*.safetensors >/dev/null 2>&1; then
    echo "eagle train recipe: no feature shards in $DATA (run benchmarks/eagle_data_recipe.sh first)" >&2
    exit 2
fi
echo $$ > "$PIDFILE"
while [ "$WAIT_FOR_DATA" = 1 ] && [ -s "$DATA_PIDFILE" ] && grep -qsa -e eagle_data -e train-data "/proc/$(cat "$DATA_PIDFILE")/cmdline"; do
    echo "eagle train recipe: the data job (PID $(cat "$DATA_PIDFILE")) is running; waiting for it, $(date -Is)"
    sleep 300
done
trap 'kill $child 2>/dev/null; wait $child 2>/dev/null; exit 130' TERM INT
echo "eagle train recipe: PID $$, data $DATA, output $OUT, $STEPS steps of $BATCH in chunks of $MINUTES minutes, $(date -Is)"
while true; do
    "$PY" -m draftwise train-eagle3 --target qwen2.5-coder-1.5b --dtype auto --data "$DATA" --out "$OUT" \
        --steps "$STEPS" --batch-size "$BATCH" --minutes "$MINUTES" \
        --vocab-file draftwise/weights/vocab/qwen2.5-coder-1.5b.json "$@" &
    child=$!
    wait $child
    if "$PY" - "$OUT" <<'PY'
import json, sys, time
from pathlib import Path
out = Path(sys.argv[1])
report = json.loads((out / "distill-report.json").read_text())
line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": report["steps"], "finished": report["finished"],
        "train_answer_tokens": report["train_answer_tokens"], "val_examples": report["val_examples"],
        "validation": report["validation"]}
with open(out / "chunks.jsonl", "a") as f:
    f.write(json.dumps(line) + "\n")
print(json.dumps(line), flush=True)
sys.exit(0 if report["finished"] else 3)
PY
    then break; fi
done
echo "eagle train recipe: done, $(date -Is)"
