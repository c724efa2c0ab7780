#!/usr/bin/env bash
# The seeds' comparisons, re-run on the registry's helpers (issue 22): one command per table, each writing JSON.
#   benchmarks/seed_tables.sh                       # every table, in order
#   TABLES="sprinter mtad" benchmarks/seed_tables.sh
# Tables: cascades (Narasimhan et al. Table 2's two views: quality against latency), sprinter (speed at matched
# quality: the threshold sweep beside the lossless stop rules), mtad (Table 4: speed and perplexity against sd;
# Table 7 / Figure 3's beams and tau), sv (goodput against batch size, and batch 1). The SV paper's information
# gain is printed by `draftwise profile-sv` when the shipped profiles are rebuilt (benchmarks/README.md).
# A table whose JSON is in $OUT is skipped, so a cut-short run resumes at the next table. Run it alone on the
# cores: every figure is a ratio to `ar` (or `sd`) timed in the same run, and a second job skews it.
# PAIR=1: the Qwen2.5-Coder pair (issue 36): the 1.5B as target, the 0.5B as every table's draft, HumanEval as
# the prompts (pass@1 by running each answer's tests: the quality axis of every table), answers up to 256 tokens,
# JSON in out/seed-tables-pair. The sprinter table needs the pair's verifiers (`draftwise train-verifier`, see
# benchmarks/README.md) and the sv table its profiles; cascades and mtad need no trained helper.
set -euo pipefail
cd "$(dirname "$0")/.."
DW=${DW:-.venv/bin/draftwise}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/seed-tables}
DTYPE=${DTYPE:-auto}        # the default format (on a CPU with native bf16: the GGUF's int4)
export DRAFTWISE_PROGRESS=${DRAFTWISE_PROGRESS:-1}  # progress bars in the log: a nohup run shows how far it is
THREADS=${THREADS:-2}       # 1 where other work keeps a core busy: a second thread then waits at every parallel region
TABLES=${TABLES:-"sprinter mtad cascades sv"}
TARGET=smollm2-135m
DRAFT=smollm2-135m-draft    # the independent draft: SPRINTER's verifiers, MTAD's beams and SV's goodput use it
data=()                     # Spec-Bench (every category), the sweep its summarisation and translation
sweep_data=(--categories summarization,translation)
TOKENS=1                    # answer lengths: the tables' own (x1), or 256 on HumanEval
if [ "${PAIR:-0}" = 1 ]; then
    TARGET=qwen2.5-coder-1.5b DRAFT=qwen2.5-coder-0.5b TOKENS=256
    [ "$OUT" != out/seed-tables ] || OUT=out/seed-tables-pair
    data=(--dataset humaneval) sweep_data=(--dataset humaneval)
fi
tokens() { [ "$TOKENS" = 1 ] && echo "$1" || echo "$TOKENS"; }
[ -z "${PAIR_TOKENS:-}" ] || [ "$TOKENS" = 1 ] || TOKENS=$PAIR_TOKENS   # PAIR=1's answer length (256)
# QUICK=1: fewer prompts, one repeat and coarser grids (about 35 minutes on 2 cores instead of about 2 hours)
# SMALL=1 (with QUICK=1): the pair's cascades and MTAD in about 90 minutes on 2 cores that other work shares:
# one temperature, the token-specific rule against lossy SD and BiLD, 6 problems, 192-token answers, no ablation.
# Every grid below is also an environment setting (SWEEP_TEMPS, SWEEP_METHODS, MTAD_METHODS, MTAD_ABLATION=0, ...).
if [ "${SMALL:-0}" = 1 ]; then
    QUICK=1 SWEEP_TEMPS=${SWEEP_TEMPS:-0.5} SWEEP_PROMPTS=${SWEEP_PROMPTS:-6} MTAD_PROMPTS=${MTAD_PROMPTS:-6}
    SWEEP_METHODS=${SWEEP_METHODS:-cascade:token-v3,cascade:bild,lossy} ALPHAS=${ALPHAS:-0.3,0.7}
    BILD_GRID=${BILD_GRID:-2,6} MTAD_METHODS=${MTAD_METHODS:-ar,sd,mtad} MTAD_ABLATION=${MTAD_ABLATION:-0}
    [ "$TOKENS" = 1 ] || TOKENS=${PAIR_TOKENS:-192}
fi
if [ "${QUICK:-0}" = 1 ]; then
    SPRINTER_PROMPTS=10 SPRINTER_REPEATS=1 MTAD_PROMPTS=${MTAD_PROMPTS:-12} ABLATION_PROMPTS=8
    ABLATION=ar,sd,mtad/num_beams=2,mtad/num_beams=8,mtad/tau=0,mtad/tau=0.9
    SWEEP_PROMPTS=${SWEEP_PROMPTS:-8} ALPHAS=${ALPHAS:-0,0.5,0.9} OPT_GRID=0,0.5,1 BILD_GRID=${BILD_GRID:-2,6}
    TC_GRID=0.1,0.5 SV_BATCH_SIZES=4,16 SV_PROMPTS=16
fi
SPRINTER_PROMPTS=${SPRINTER_PROMPTS:-16} SPRINTER_REPEATS=${SPRINTER_REPEATS:-2}
MTAD_PROMPTS=${MTAD_PROMPTS:-24} ABLATION_PROMPTS=${ABLATION_PROMPTS:-12}
ABLATION=${ABLATION:-ar,sd,mtad/num_beams=2,mtad/num_beams=4,mtad/num_beams=6,mtad/num_beams=8,mtad/tau=0,mtad/tau=0.1,mtad/tau=0.3,mtad/tau=0.7,mtad/tau=0.9}
SWEEP_PROMPTS=${SWEEP_PROMPTS:-12} ALPHAS=${ALPHAS:-0,0.3,0.6,0.9} OPT_GRID=${OPT_GRID:-0,0.3,0.6,1}
BILD_GRID=${BILD_GRID:-2,4,6,8} TC_GRID=${TC_GRID:-0.1,0.3,0.5,0.7}
SV_BATCH_SIZES=${SV_BATCH_SIZES:-4,16,32} SV_PROMPTS=${SV_PROMPTS:-32}
SWEEP_TEMPS=${SWEEP_TEMPS:-"1 0.5"} MTAD_ABLATION=${MTAD_ABLATION:-1}
SWEEP_METHODS=${SWEEP_METHODS:-cascade:token-v3,cascade:opt,cascade:bild,lossy,token-cascade}
MTAD_METHODS=${MTAD_METHODS:-ar,sd,cascade:bild@2,mtad,mtjd}
grids=()                    # the per-method grids of the methods swept (sweep refuses a grid for one not swept)
for pair in cascade:opt="$OPT_GRID" cascade:bild="$BILD_GRID" token-cascade="$TC_GRID"; do
    case ",$SWEEP_METHODS," in *",${pair%%=*},"*) grids+=(--grid "$pair") ;; esac
done
mkdir -p "$OUT"
common=(--target "$TARGET" --dtype "$DTYPE" --threads "$THREADS" "${data[@]}")

run() {  # $1: the JSON; the rest: the command, which writes it with --json
    local json=$1; shift
    if [ -s "$json" ]; then echo "seed tables: $json is there, skipped"; return; fi
    echo "seed tables: $json ($(date -u +%FT%TZ))"
    "$@" --json "$json"
}

for table in $TABLES; do
    case $table in
        sprinter)
            for T in 1 0; do
                run "$OUT/sprinter-t$T.json" "$DW" bench "${common[@]}" --draft "$DRAFT" \
                    --methods ar,sd,sprinter,sprinter/tau=0.7,sprinter/tau=0.9,sprinter/tau=0.95,adaedl,specdec++,lossy \
                    --compare-to sd --num-prompts "$SPRINTER_PROMPTS" --max-new-tokens "$(tokens 48)" --temperature $T --gamma 3 \
                    --repeats "$SPRINTER_REPEATS"
            done ;;
        mtad)
            run "$OUT/mtad-t1.json" "$DW" bench "${common[@]}" --draft "$DRAFT" \
                --methods "$MTAD_METHODS" --num-prompts "$MTAD_PROMPTS" --max-new-tokens "$(tokens 128)" --repeats 1 \
                --temperature 1 --top-k 10 --top-p 0.9 --gamma 4 --compare-to sd
            ablation=()
            if [ "$MTAD_ABLATION" = 1 ]; then
                run "$OUT/mtad-ablation-t1.json" "$DW" bench "${common[@]}" --draft "$DRAFT" \
                    --methods "$ABLATION" --num-prompts "$ABLATION_PROMPTS" --max-new-tokens "$(tokens 128)" --repeats 1 --temperature 1 --top-k 10 --top-p 0.9 --gamma 4 \
                    --compare-to sd
                ablation=(--ablation "$OUT/mtad-ablation-t1.json" --plot "$OUT/mtad-ablation-t1.png")
            fi
            [ -s "$OUT/mtad-t1.txt" ] || "$PY" benchmarks/mtad_tables.py "$OUT/mtad-t1.json" "${ablation[@]}" \
                --out "$OUT/mtad-t1.txt" ;;
        cascades)
            sweeps=()   # one JSON per temperature: a cut-short sweep resumes at the next temperature
            for T in $SWEEP_TEMPS; do
                run "$OUT/sweep-t$T.json" "$DW" sweep --target "$TARGET" --draft "$DRAFT" --dtype "$DTYPE" --threads "$THREADS" \
                    --methods "$SWEEP_METHODS" --alpha-grid "$ALPHAS" "${grids[@]}" "${sweep_data[@]}" \
                    --num-prompts "$SWEEP_PROMPTS" --max-new-tokens "$(tokens 64)" --repeats 1 --gamma 4 --temperatures $T
                sweeps+=("$OUT/sweep-t$T.json")
            done
            [ -s "$OUT/sweep-cascades.json" ] || "$PY" benchmarks/merge_sweeps.py "${sweeps[@]}" \
                --json "$OUT/sweep-cascades.json" --plot "$OUT/sweep-cascades.png" ;;
        sv)
            for T in 1 0; do
                run "$OUT/sv-batched-t$T.json" "$DW" bench "${common[@]}" --draft "$DRAFT" \
                    --methods ar,sd,adaptive-verify,svip,smartspec,staged,sv --batch-sizes "$SV_BATCH_SIZES" --num-prompts "$SV_PROMPTS" \
                    --max-new-tokens 32 --temperature $T --gamma 4 --repeats 1
                run "$OUT/sv-batch1-t$T.json" "$DW" bench "${common[@]}" --draft "$DRAFT" \
                    --methods ar,sd,adaptive-verify,sv --batch-sizes 1 --num-prompts 8 --max-new-tokens 32 \
                    --temperature $T --gamma 4 --repeats 2
            done ;;
        *) echo "seed tables: unknown table $table (choose from: sprinter mtad cascades sv)" >&2; exit 2 ;;
    esac
done
"$PY" benchmarks/seed_plots.py "$OUT"   # one PNG per seed whose JSON is there (seed-*.png)
echo "seed tables: done ($(date -u +%FT%TZ))"
