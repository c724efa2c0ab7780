"""Memory under load: `draftwise serve` as a process, its resident memory (RSS) every 200 requests.

Short and long prompts (one in ten fills most of the window), streamed and not, one client in seven
disconnecting after a random number of bytes, from 8 client threads. By default the tiny test models, so
the figure is the server's own bookkeeping, not a model's; `--target smollm2-135m` serves the registry model
(its default draft), whose KV buffers and prefix cache are real. The criterion (issue 39): RSS after
2,000 more requests within 5% of RSS after the first 200. Writes JSON:

    .venv/bin/python benchmarks/soak.py --rounds 11 --json benchmarks/results/soak.json
    .venv/bin/python benchmarks/soak.py --rounds 11 --target smollm2-135m --json benchmarks/results/soak-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftwise.atomic import write_json  # noqa: E402

KEY, MODEL = "soak-key-0123456789", "tiny"  # the served model's API key and name


def main() -> int:
    from draftwise.models.tiny import save_pair, word_prompt
    from draftwise.server.loadtest import raw_post

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds of 200 requests")
    parser.add_argument("--arena-max", type=int, default=None, help="MALLOC_ARENA_MAX for the server process")
    parser.add_argument("--target", default=None, help="what the server serves (default: the tiny test pair)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.target:
        models = ["--target", args.target]
    else:
        target, draft = save_pair(Path(tempfile.mkdtemp()))
        models = ["--target", target, "--draft", draft]
    env = {**os.environ, "DRAFTWISE_API_KEY": KEY}
    if args.arena_max:
        env["MALLOC_ARENA_MAX"] = str(args.arena_max)
    process = subprocess.Popen(
        [sys.executable, "-m", "draftwise", "serve", *models, "--port", "0",
         "--served-model-name", MODEL, "--log-level", "warning", "--threads", "1", "--no-access-log",
         "--max-batch-size", "8"], stderr=subprocess.PIPE, text=True, env=env)
    url = "http://127.0.0.1:" + re.search(r":(\d+)/v1", process.stderr.readline()).group(1)
    rng = random.Random(1)
    long_prompt = " ".join(["the cat sat on the mat and the dog sat on the log"] * 5)

    def one(i: int) -> bytes:
        body = {"model": MODEL, "prompt": long_prompt if i % 10 == 0 else word_prompt(i), "max_tokens": 8,
                "temperature": 1.0, "seed": i, "stream": i % 2 == 0}
        return raw_post(url, json.dumps(body).encode(), api_key=KEY, read=None if i % 7 else rng.randint(1, 200))

    def rss_kib() -> int:
        with open(f"/proc/{process.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))

    rss = []
    try:
        with ThreadPoolExecutor(8) as pool:
            for k in range(args.rounds):
                list(pool.map(one, range(k * 200, (k + 1) * 200)))
                time.sleep(1)
                rss.append(rss_kib())
                print(f"{(k + 1) * 200} requests: RSS {rss[-1] / 1024:.1f} MB", file=sys.stderr, flush=True)
    finally:
        process.kill()
        process.wait()
    growth = {f"{200 * (k + 1)}->{200 * (k + 1) + 600}": rss[k + 3] / rss[k] - 1 for k in range(len(rss) - 3)}
    report = {"target": args.target or "tiny test pair", "rss_kib_every_200_requests": rss,
              "arena_max": args.arena_max, "growth_over_600_requests": growth}
    if len(rss) >= 11:
        report["growth_200_to_2200"] = rss[10] / rss[0] - 1
    print(json.dumps(report, indent=1))
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
