"""Merge `draftwise sweep` results run separately per temperature (e.g. in parallel processes)
into one JSON, print the tables and draw the combined plot.

    python benchmarks/merge_sweeps.py out/sweep-t1.json out/sweep-t0.5.json \
        --json benchmarks/results/sweep.json --plot benchmarks/results/sweep.png
"""

from __future__ import annotations

import argparse
import json

from draftwise.atomic import write_json
from draftwise.bench.sweep import format_sweep, plot_sweep


def merge(results: list[dict]) -> dict:
    base = results[0]
    same = {k: v for k, v in base["config"].items() if k != "temperatures"}
    for other in results[1:]:
        theirs = {k: v for k, v in other["config"].items() if k != "temperatures"}
        if theirs != same:
            raise SystemExit("these sweeps differ in more than their temperatures; refusing to merge")
    merged = {**base, "config": {**base["config"], "temperatures": []}, "temperatures": {}, "runs": {}}
    for r in results:
        merged["config"]["temperatures"] += r["config"]["temperatures"]
        merged["temperatures"].update(r["temperatures"])
        merged["runs"].update(r["runs"])
    return merged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    merged = merge([json.load(open(path)) for path in args.inputs])
    print(format_sweep(merged))
    write_json(merged, args.json)
    if args.plot:
        plot_sweep(merged, args.plot)


if __name__ == "__main__":
    main()
