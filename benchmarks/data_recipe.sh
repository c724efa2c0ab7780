#!/usr/bin/env bash
# Issue 22's training data for smollm2-135m: the target's own answers to the training prompt mix (never the
# Spec-Bench evaluation split), kept as compressed token chunks in data/answers/smollm2-135m (committed: a few
# MB), then turned into feature shards by one prefill pass when a head is trained. Every step resumes where the
# last run stopped (chunks are written atomically; finished (uid, tag) pairs are skipped). Run it in the
# background:  (setsid nohup nice -n 19 benchmarks/data_recipe.sh >> out/data-recipe.log 2>&1 &)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-data/answers/smollm2-135m}
common=(--target smollm2-135m --answers --out "$OUT" --dtype auto --max-new-tokens 256 --batch-size 48
        --shard-size 256 --num-fortunes 100000)
# 1. greedy: Spec-Bench train, HumanEval, every fortune (14,834 prompts)
"$PY" -m draftwise train-data "${common[@]}" --sources spec-bench,human-eval,fortunes
# 2. greedy: 5,000 Magpie prompts the target writes itself (kept in $OUT/magpie.jsonl)
"$PY" -m draftwise train-data "${common[@]}" --sources magpie --num-magpie 5000
# 3. sampled (T=1): 7,500 prompts of the same mix
"$PY" -m draftwise train-data "${common[@]}" --sources spec-bench,human-eval,fortunes,magpie --num-magpie 5000 \
    --temperature 1.0 --limit 7500
echo "data recipe: done"
