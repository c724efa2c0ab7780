"""What the scripts in benchmarks/ share: their common options (`parser`), the thread count, the bench's prompts
encoded for a target, a target with the draft a method runs with, a run's speculative counters, and the JSON they
write. Each script is its own command line over these and the other modules of `draftwise.bench`."""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Sequence

import torch

from draftwise.atomic import write_json
from draftwise.bench.datasets import load_prompts
from draftwise.bench.harness import encode_bench_prompt


def parser(doc: str | None, *, threads: int | None = 2, json: bool | None = False) -> argparse.ArgumentParser:
    """An ArgumentParser described by the first line of `doc`, with `--threads` (torch threads; that default, 0 for
    torch's own; None: no option) and `--json` (where the results go; True: required, None: no option)."""
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads, help="torch threads (0: torch's default)")
    if json is not None:
        p.add_argument("--json", required=json, default=None, help="write the results here (JSON)")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed arguments, with torch's thread count set from `--threads` where it is not 0."""
    args = p.parse_args(argv)
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    return args


def encoded_prompts(target: Any, num_prompts: int | None, *, split: str = "eval") -> list[list[int]]:
    """The bench's Spec-Bench prompts (round-robin over its tasks), chat-formatted for `target` as `bench` feeds them."""
    return [encode_bench_prompt(target, p) for p in load_prompts(split=split, num_prompts=num_prompts)]


def target_and_draft(target: str, method: str, draft: str | None = None, **load: Any) -> tuple[Any, Any]:
    """The target loaded (`load`: load_model's options) and the draft `method` runs with: `draft` when given, else
    the registry's default for the method (None where it needs none)."""
    from draftwise import plan
    from draftwise.heads.loading import load_draft
    from draftwise.models.loading import load_model

    model = load_model(target, **load)
    spec = draft or plan.default_draft(model, method)
    return model, load_draft(spec, model) if spec else None


def speculation(stats: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The speculative counters of several generations' stats, summed: acceptance rate (accepted / drafted), mean
    accepted length (new tokens / target calls, as bench.metrics reports it), the first drafted position's
    acceptance, target calls per token."""
    steps, accepted, drafted = (sum(s[k] for s in stats) for k in ("steps", "accepted", "drafted"))
    calls, new_tokens = (sum(s[k] for s in stats) for k in ("target_calls", "new_tokens"))
    first = sum(s["accepted_per_position"][0] for s in stats if s["accepted_per_position"])
    first_drafted = sum(s["drafted_per_position"][0] for s in stats if s["drafted_per_position"])
    return {"mean_accepted_length": new_tokens / calls if calls else 0.0, "acceptance_rate": accepted / max(drafted, 1),
            "step1_acceptance": first / max(first_drafted, 1), "drafted": drafted, "accepted": accepted, "steps": steps,
            "target_calls_per_token": calls / max(1, new_tokens)}


def speedups(baseline: Sequence[float], times: Sequence[float]) -> float:
    """The median over prompts of baseline time / time (both per new token, prompt by prompt)."""
    return statistics.median(a / b for a, b in zip(baseline, times))


def finish(report: dict[str, Any], path: str | None) -> None:
    """Write `report` to `path` (JSON, atomically) when one was given."""
    if path:
        write_json(report, path)
        print(f"wrote {path}")
