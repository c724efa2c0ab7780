"""`draftwise serve` under load, and its overhead against calling the engine directly.

What it measures, and how: draftwise/server/load_bench.py.

Reportable figures need a quiet machine (nothing else on the cores). Default settings take about
25-35 minutes on a 2-core CPU:

    .venv/bin/python benchmarks/server_load.py --json benchmarks/results/server-load.json

A quick check that it runs (tiny models written by the tests' `save_pair`, raw text prompts):

    .venv/bin/python benchmarks/server_load.py --target /tmp/tiny/target --draft /tmp/tiny/draft --no-chat \\
        --prompts-file prompts.txt --concurrency 1,4 --num-requests 4 --overhead-prompts 2 --repeats 1 \\
        --max-tokens 16 --json /tmp/server-load.json
"""

from __future__ import annotations

import argparse

from draftwise.bench import scripts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=None, help="draft for sd (default: the registry's)")
    parser.add_argument("--methods", default="ar,sd,prompt-lookup")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--num-requests", type=int, default=32, help="requests per method and concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--overhead-prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="overhead repeats (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads, here and in the server (0: default)")
    parser.add_argument("--no-chat", dest="chat", action="store_false", help="raw text prompts, /v1/completions")
    parser.add_argument("--prompts-file", default=None, help="prompts (default: Spec-Bench evaluation prompts)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the load part, all levels")
    parser.add_argument("--skip", default="", help="comma list: load,overhead")
    parser.add_argument("--json", default="benchmarks/results/server-load.json")
    args = scripts.parse(parser)
    from draftwise.cli.generate import read_prompts_file
    from draftwise.server.load_bench import run

    run(args, read_prompts_file(args.prompts_file) if args.prompts_file else None)


if __name__ == "__main__":
    main()
