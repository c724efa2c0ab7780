#!/usr/bin/env bash
# Issue 36's training data for the Qwen2.5-Coder pair: the 1.5B's own answers, written by the batched engine from
# the file's Q4_K_M blocks (the format it serves), kept as compressed token chunks in
# data/answers/qwen2.5-coder-1.5b (a few MB, committed), then turned into feature shards by one prefill pass when
# a helper is trained. Every step resumes where the last run stopped (chunks are written atomically, finished
# (uid, tag) pairs are skipped), so run it in the background and re-run it after an interruption:
#   (setsid nohup nice -n 19 benchmarks/pair_data_recipe.sh >> out/pair-data-recipe.log 2>&1 &)
# Needs the pair (`make pair`) and Debian's fortunes and fortunes-de packages.
#
# HumanEval is left out of every step: its 164 problems are the pair's pass@1 evaluation (`draftwise bench
# --quality pass@1`), so no helper of the pair is trained on them. The Spec-Bench evaluation split is never used.
# Targets: at least 1M greedy and 300k sampled answer tokens (issue 36); 2 CPU threads write about 100k answer
# tokens an hour at batch 16 (data/answers/qwen2.5-coder-1.5b/progress.jsonl logs the rate of each run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-data/answers/qwen2.5-coder-1.5b}
BATCH=${BATCH:-16}
common=(--target qwen2.5-coder-1.5b --answers --out "$OUT" --max-new-tokens 256 --batch-size "$BATCH"
        --shard-size 32)  # a chunk of 32 answers: a session cut off loses at most the answers in flight
# 1. greedy: Spec-Bench's train split (384 prompts, every category)
"$PY" -m draftwise train-data "${common[@]}" --sources spec-bench
# 2. greedy: 1,500 prompts the 1.5B writes itself from its user-turn prefix (Magpie; kept in $OUT/magpie.jsonl):
#    a coder model writes mostly programming requests, the code the pair will serve, without HumanEval's problems
"$PY" -m draftwise train-data "${common[@]}" --sources magpie --num-magpie 1500
# 3. greedy: long passages (docstrings asked as summaries and passage questions), German-to-English translation
#    and fortunes asked as Spec-Bench's tasks are
"$PY" -m draftwise train-data "${common[@]}" --sources docs,german,fortunes --num-docs 1200 --num-german 800 \
    --num-fortunes 1500
# 4. sampled (T=1): 1,500 prompts of the same mix (the sampled-answer head's data); SAMPLED=0 stops before it
[ "${SAMPLED:-1}" = 1 ] || { echo "pair data recipe: greedy done"; exit 0; }
"$PY" -m draftwise train-data "${common[@]}" --sources spec-bench,magpie,docs,german,fortunes --num-magpie 1500 \
    --num-docs 1200 --num-german 800 --num-fortunes 1500 --temperature 1.0 --limit 1500
echo "pair data recipe: done"
