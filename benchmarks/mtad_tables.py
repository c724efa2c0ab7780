"""MTAD tables from `draftwise bench` JSON (the MTAD paper Table 4, Table 7, Figure 3).

    python benchmarks/mtad_tables.py benchmarks/results/mtad-t1.json \
        --ablation benchmarks/results/mtad-ablation-t1.json --plot benchmarks/results/mtad-ablation-t1.png \
        --out benchmarks/results/mtad-t1.txt

Table 4: the columns of `draftwise.bench.report.baseline_table`; the ablation file holds `mtad/num_beams=W` and
`mtad/tau=T` columns next to `sd` (`plot_mtad_ablation`). Nothing is recomputed: every number is read from the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftwise.bench.report import baseline_table, plot_mtad_ablation, setting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("main", help="bench JSON with sd, bild, mtad, mtjd")
    parser.add_argument("--ablation", help="bench JSON with mtad/num_beams=... and mtad/tau=... columns")
    parser.add_argument("--plot", help="PNG of the ablations")
    parser.add_argument("--out", help="also write the tables here")
    args = parser.parse_args()
    results = json.loads(Path(args.main).read_text())
    cfg = results["config"]
    parts = [f"Table 4 style: {len(cfg['prompts'])} prompts x {cfg['repeats']} repeats, {cfg['max_new_tokens']} new "
             f"tokens, T={cfg['temperature']} top-k {cfg['top_k']} top-p {cfg['top_p']}, gamma {cfg['gamma']}",
             baseline_table(results)]
    if args.ablation:
        ablation = json.loads(Path(args.ablation).read_text())
        names = list(ablation["methods"])
        beams = [n for n in names if setting(n, "num_beams") is not None]
        taus = [n for n in names if setting(n, "tau") is not None]
        acfg = ablation["config"]
        parts += [f"\nAblations: {len(acfg['prompts'])} prompts x {acfg['repeats']} repeat(s), {acfg['max_new_tokens']} "
                  "new tokens; number of beams (Table 7)", baseline_table(ablation, ["sd"] + beams),
                  "\nthreshold tau (Figure 3)", baseline_table(ablation, ["sd"] + taus)]
        if args.plot:
            plot_mtad_ablation(ablation, args.plot)
    text = "\n".join(parts)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
