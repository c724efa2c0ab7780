"""Merge `draftwise sweep` results run separately per temperature (e.g. in parallel processes)
into one JSON, print the tables and draw the combined plot.

    python benchmarks/merge_sweeps.py out/sweep-t1.json out/sweep-t0.5.json \
        --json benchmarks/results/sweep.json --plot benchmarks/results/sweep.png
"""

from __future__ import annotations

import argparse
import json

from draftwise.atomic import write_json
from draftwise.errors import DraftwiseError
from draftwise.bench.sweep import format_sweep, merge_sweeps, plot_sweep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    try:
        merged = merge_sweeps([json.load(open(path)) for path in args.inputs])
    except DraftwiseError as error:
        raise SystemExit(str(error)) from None
    print(format_sweep(merged))
    write_json(merged, args.json)
    if args.plot:
        plot_sweep(merged, args.plot)


if __name__ == "__main__":
    main()
