"""Every method's speed on two checkouts of draftwise, before and after a change, in one run (issue 21).

What it measures and how: draftwise/bench/trees/.

    .venv/bin/python benchmarks/compare_trees.py --before /tmp/old --after . --out out/compare_trees.json
"""

from __future__ import annotations

import argparse
import sys

from draftwise.bench.trees.compare import Fail, run


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # noqa: D102 - argparse's usage block is replaced by one line
        raise Fail(message)


def main() -> int:
    parser = OneLineParser(prog="compare_trees.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="checkout of the earlier tree")
    parser.add_argument("--after", required=True, help="checkout of the later tree")
    parser.add_argument("--out", required=True, help="JSON report (written atomically, after every worker)")
    parser.add_argument("--methods", default="all", help="all, or a comma list")
    parser.add_argument("--batch-sizes", default="1,4", help="for every method (1: each prompt alone)")
    parser.add_argument("--extra", default="mtad:16,mtjd:16", help="METHOD:BATCH pairs added for selected methods")
    parser.add_argument("--prompts", type=int, default=4, help="Spec-Bench prompts (a batch of B > N decodes B)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="workers per tree, alternating before / after")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default="smollm2-135m", help="registry target (the registry's default)")
    parser.add_argument("--dtype", default=None, help="passed to load_model (unset: generate's own choice)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    parser.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of each warm-up call")
    try:
        return run(parser.parse_args())
    except Fail as error:
        print(f"compare_trees.py: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("compare_trees.py: interrupted (the JSON holds the workers that finished)", file=sys.stderr)
        return 130
    except OSError as error:
        print(f"compare_trees.py: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
