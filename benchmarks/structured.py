"""Structured output under speculation: does every answer parse, and what does the grammar cost?

The same chat prompts (each asks for a JSON object) are decoded with a JSON schema and without one, by the
same method on the batched engine, in alternating rounds after a warm-up; each request has its own seed.
Reports the share of constrained answers that parse and match the schema (of all, and of those that ended
at EOS rather than at max_new_tokens), new tokens per second with and without the schema (median of the
rounds) and their ratio, and the speculative counters of both. At a batch above 1, answers of different
lengths leave rows idle at a group's end, so the throughput ratio is fairest at --batch 1.
Writes JSON:

    python benchmarks/structured.py --json benchmarks/results/structured.json
"""

from __future__ import annotations

import json
import statistics
import sys
from functools import partial

from draftwise.bench import scripts
from draftwise.bench.structured import prompts, run, summary, valid
from draftwise.bench.timing import once
from draftwise.heads.loading import load_draft
from draftwise.models.loading import load_model


def main() -> int:
    parser = scripts.parser(__doc__, threads=None)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=None, help="default: the registry's draft for the method")
    parser.add_argument("--method", default="sd")
    parser.add_argument("--requests", type=int, default=208, help="constrained requests in all (parse rate)")
    parser.add_argument("--rounds", type=int, default=13, help="alternating rounds with and without the schema")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = scripts.parse(parser)

    target = load_model(args.target)
    draft = load_draft(args.draft, target) if args.draft else None
    per_round = max(1, args.requests // args.rounds)
    run(target, draft, prompts(2), method=args.method, seed=0, schema=True, max_new_tokens=16, batch=2)  # warm-up
    run(target, draft, prompts(2), method=args.method, seed=0, schema=False, max_new_tokens=16, batch=2)
    rates: dict[bool, list[float]] = {True: [], False: []}
    stats: dict[bool, list] = {True: [], False: []}
    for r in range(args.rounds):
        chats = prompts(per_round)
        order = (True, False) if r % 2 == 0 else (False, True)  # alternating: neither always goes first
        runs = once({schema: partial(run, target, draft, chats, method=args.method, seed=1000 * r, schema=schema,
                                     max_new_tokens=args.max_new_tokens, batch=args.batch) for schema in order})
        for schema, (seconds, out) in runs.items():
            rates[schema].append(sum(len(g.token_ids) for g in out) / seconds)
            stats[schema] += out
        print(f"round {r + 1}/{args.rounds}: {rates[True][-1]:.1f} tok/s with the schema, "
              f"{rates[False][-1]:.1f} without", file=sys.stderr)

    parsed = sum(valid(g.text) for g in stats[True])
    ended = [g for g in stats[True] if g.stats["finish_reason"] == "eos"]  # not cut by max_new_tokens
    with_schema, without = statistics.median(rates[True]), statistics.median(rates[False])
    report = {
        "target": args.target, "method": args.method, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds, "requests_per_round": per_round,
        "parsed": parsed, "constrained_requests": len(stats[True]), "parse_rate": parsed / len(stats[True]),
        "ended_at_eos": len(ended), "parse_rate_of_those": sum(valid(g.text) for g in ended) / max(len(ended), 1),
        "unconstrained_parse_rate": sum(valid(g.text) for g in stats[False]) / len(stats[False]),
        "tokens_per_s_with_schema": with_schema, "tokens_per_s_without": without,
        "throughput_ratio": with_schema / without,
        "with_schema": summary(stats[True]), "without_schema": summary(stats[False]),
        "example": stats[True][0].text,
    }
    report["decode_throughput_ratio"] = (report["with_schema"]["decode_tokens_per_s"]
                                         / report["without_schema"]["decode_tokens_per_s"])
    print(json.dumps({k: v for k, v in report.items() if k not in ("with_schema", "without_schema")}, indent=2))
    scripts.finish(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
