"""Every method's speed on two checkouts of draftwise, before and after a change (`benchmarks/compare_trees.py`, issue
21): the parent's side (`run`). The workers (`worker.py`) import `draftwise` from the tree they measure, each in its own
process (`run_child`), and print one JSON line; here their runs are summarized per (method, batch size): each tree's median
tokens/s over its repeats, the ratio after / before, and whether the after tree's token ids equal the before tree's
(`summarize`). Token ids are kept aside under "_ids" for that comparison and stored as a digest per request
(`strip_ids`, `for_json`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from draftwise.atomic import write_json
from draftwise.bench.trees import worker
from draftwise.bench.trees.worker import RESULT_PREFIX

WORKER = worker.__file__

SPEC_BENCH = Path("draftwise") / "data" / "spec_bench" / "question.jsonl"
TREES = ("before", "after")


class Fail(Exception):
    """A one-line error for the user."""


def _digest(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def run_child(script: str, mode: str, tree: str, stdin: str, label: str, prefix: str) -> dict:
    """One worker process (`script MODE TREE`, in TREE); its stderr echoed (prefixed with `label`), its one stdout
    line starting with `prefix` parsed as JSON."""
    command = [sys.executable, os.path.abspath(script), mode, tree]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tree, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    tail: list[str] = []

    def echo() -> None:
        for line in process.stderr:
            line = line.rstrip("\n")
            tail.append(line)
            del tail[:-30]
            if label:
                print(f"[{label}] {line}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=echo, daemon=True)  # the only reader of stderr (communicate would race it)
    reader.start()
    try:
        process.stdin.write(stdin)
        process.stdin.close()
    except BrokenPipeError:  # the worker died at start: its stderr says why
        pass
    stdout = process.stdout.read()
    process.wait()
    reader.join()
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    if not lines:
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        return {"fatal": f"worker exited with status {process.returncode}: {last.strip()[:300]}"}
    return json.loads(lines[-1][len(prefix):])


def git_state(tree: Path) -> dict:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "draftwise")
    return {"path": str(tree), "commit": git("rev-parse", "HEAD"),
            "package_dirty": None if status is None else bool(status)}


def read_prompts(trees: list[Path], count: int) -> tuple[list[str], str]:
    for tree in trees:
        path = tree / SPEC_BENCH
        if path.is_file():
            prompts = []
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    prompts.append(json.loads(line)["turns"][0])
                if len(prompts) == count:
                    return prompts, str(path)
            raise Fail(f"{path} has {len(prompts)} questions, fewer than the {count} asked for")
    raise Fail(f"no {SPEC_BENCH} in {' or '.join(map(str, trees))}")


def parse_sizes(text: str, what: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise Fail(f"{what} must be a comma list of integers >= 1, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise Fail(f"{what} must be a comma list of integers >= 1, got {text!r}")
    return sorted(set(sizes))


def parse_extra(text: str) -> list[tuple[str, int]]:
    pairs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        method, sep, size = item.rpartition(":")
        if not sep or not method or not size.isdigit() or int(size) < 1:
            raise Fail(f"--extra takes METHOD:BATCH pairs (e.g. mtad:16,mtjd:16), got {item!r}")
        pairs.append((method, int(size)))
    return pairs


def check_tree(path: str, flag: str) -> Path:
    tree = Path(path).expanduser().resolve()
    if not (tree / "draftwise" / "__init__.py").is_file():
        raise Fail(f"{flag} {path}: not a checkout with a draftwise/ package at its root")
    return tree


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(rows: list[tuple[str, int]], runs: list[dict], exact: dict[str, bool]) -> list[dict]:
    """Per (method, batch size): each tree's medians over its repeats, the ratio, and output identity."""
    first_ids: dict[tuple[str, str, int], list] = {}
    for run in runs:
        for method, sizes in (run.get("results") or {}).items():
            for size, row in sizes.items():
                if "_ids" in row:
                    first_ids.setdefault((run["tree"], method, int(size)), row["_ids"])
    summary = []
    for method, size in rows:
        entry: dict = {"method": method, "batch_size": size, "exact": exact.get(method)}
        for tree in TREES:
            got = [r["results"][method][str(size)] for r in runs
                   if r["tree"] == tree and str(size) in (r.get("results") or {}).get(method, {})]
            ok = [g for g in got if "error" not in g]
            errors = sorted({g["error"] for g in got if "error" in g})
            side: dict = {"repeats": len(ok)}
            if ok:
                side.update({
                    "tokens_per_s": median_or_none([g["tokens_per_s"] for g in ok]),
                    "runs": [round(g["tokens_per_s"], 3) for g in ok],
                    "target_calls_per_token": median_or_none([g["target_calls_per_token"] for g in ok]),
                    "mean_accepted_length": median_or_none([g["mean_accepted_length"] for g in ok]),
                    "acceptance_rate": median_or_none([g["acceptance_rate"] for g in ok]),
                    "prompts": ok[0]["prompts"], "new_tokens": ok[0]["new_tokens"],
                    "same_ids_every_repeat": len({tuple(g["output_digests"]) for g in ok}) == 1,
                })
            if errors:
                side["error"] = errors[0]
                side["refused"] = any(g.get("refused") for g in got if "error" in g)
            if not got:
                side["error"] = "not measured (its worker failed)"
            entry[tree] = side
        before, after = entry["before"].get("tokens_per_s"), entry["after"].get("tokens_per_s")
        entry["after_over_before"] = after / before if before and after else None
        new = first_ids.get(("after", method, size))
        old, against = first_ids.get(("before", method, size)), f"before, batch {size}"
        if old is None and size > 1:
            old, against = first_ids.get(("before", method, 1)), "before, batch 1 (single prompts)"
        if new is not None and old is not None:
            pairs = list(zip(new, old))
            same = [a == b for a, b in pairs]
            entry["identical_to_before"] = {
                "compared_with": against, "identical": sum(same), "requests": len(pairs),
                "first_difference": [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                                     if a != b else None for a, b in pairs],
            }
        summary.append(entry)
    return summary


def strip_ids(run: dict) -> dict:
    """The run as stored: token ids replaced by a digest per request (kept aside under '_ids' for comparing)."""
    for sizes in (run.get("results") or {}).values():
        for row in sizes.values():
            if "token_ids" in row:
                row["_ids"] = row.pop("token_ids")
                row["output_digests"] = [_digest(ids) for ids in row["_ids"]]
    return run


def for_json(value):
    if isinstance(value, dict):
        return {k: for_json(v) for k, v in value.items() if k != "_ids"}
    if isinstance(value, list):
        return [for_json(v) for v in value]
    return value


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: list[dict]) -> None:
    head = (f"{'method':<16}{'batch':>5} {'before tok/s':>12} {'after tok/s':>12} {'after/before':>12} "
            f"{'acc.len b/a':>12} {'tc/tok b/a':>12}  same ids")
    print(head)
    print("-" * len(head))
    for e in summary:
        b, a = e["before"], e["after"]
        cell = lambda side: fmt(side.get("tokens_per_s")) if "tokens_per_s" in side else (  # noqa: E731
            "refused" if side.get("refused") else "error")
        same = e.get("identical_to_before")
        same_text = "-" if same is None else f"{same['identical']}/{same['requests']}" + (
            " (vs b1)" if "batch 1 (single" in same["compared_with"] and e["batch_size"] > 1 else "")
        print(f"{e['method']:<16}{e['batch_size']:>5} {cell(b):>12} {cell(a):>12} "
              f"{fmt(e['after_over_before'], '.3f'):>12} "
              f"{fmt(b.get('mean_accepted_length')) + '/' + fmt(a.get('mean_accepted_length')):>12} "
              f"{fmt(b.get('target_calls_per_token')) + '/' + fmt(a.get('target_calls_per_token')):>12}  {same_text}")
    errors = [(e["method"], e["batch_size"], t, e[t]["error"]) for e in summary for t in TREES if "error" in e[t]]
    if errors:
        print("\nnot measured:")
        for method, size, tree, error in errors:
            print(f"  {method} batch {size}, {tree}: {error[:150]}")


def run(args: argparse.Namespace) -> int:
    """The comparison `benchmarks/compare_trees.py` describes, on its parsed arguments: checks them (a Fail when
    bad), runs the workers repeat by repeat, rewrites the report after each, prints the table."""
    for name in ("prompts", "max_new_tokens", "repeats", "warmup_tokens"):
        if getattr(args, name) < 1:
            raise Fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads < 0 or args.seed < 0:
        raise Fail("--threads and --seed must be >= 0")
    trees = {"before": check_tree(args.before, "--before"), "after": check_tree(args.after, "--after")}
    sizes = parse_sizes(args.batch_sizes, "--batch-sizes")
    extra = parse_extra(args.extra)
    out_path = Path(args.out).expanduser()
    if out_path.is_dir():
        raise Fail(f"--out {args.out} is a directory; give a file name")

    listed = {}
    for tree in TREES:
        got = run_child(WORKER, "--list-methods", str(trees[tree]), "", "", RESULT_PREFIX)
        if "fatal" in got:
            raise Fail(f"--{tree} {trees[tree]}: cannot import draftwise.methods ({got['fatal']})")
        listed[tree] = got["methods"]
    known = list(listed["after"]) + [m for m in listed["before"] if m not in listed["after"]]
    exact = {m: (listed["after"].get(m) or listed["before"][m])["exact"] for m in known}
    if args.methods.strip() == "all":
        methods = known
    else:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in known]
        if not methods or unknown:
            raise Fail(f"unknown method(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
        methods = list(dict.fromkeys(methods))
    for method, _ in extra:
        if method not in known:
            raise Fail(f"--extra: unknown method {method!r}; known: {', '.join(known)}")
    per_method = {m: sorted(set(sizes) | {b for x, b in extra if x == m}) for m in methods}
    rows = [(m, b) for m in methods for b in per_method[m]]
    prompts, prompt_file = read_prompts([trees["after"], trees["before"]],
                                        max([args.prompts] + [b for _, b in rows]))
    job = {"rows": [[m, per_method[m]] for m in methods], "prompts": prompts, "num_prompts": args.prompts,
           "max_new_tokens": args.max_new_tokens, "seed": args.seed, "target": args.target, "dtype": args.dtype,
           "threads": args.threads, "warmup_tokens": args.warmup_tokens}
    report: dict = {
        "config": {k: v for k, v in vars(args).items()} | {"methods": methods, "rows": rows, "prompt_file": prompt_file,
                                                          "temperature": 0.0, "ignore_eos": True},
        "trees": {t: git_state(trees[t]) for t in TREES},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "processor": platform.processor()},
        "runs": [], "summary": [],
    }
    print(f"{len(rows)} (method, batch size) rows x {args.repeats} repeats x 2 trees -> {out_path}", file=sys.stderr)
    started = time.time()
    for repeat in range(args.repeats):
        for tree in TREES:
            label = f"{tree} {repeat + 1}/{args.repeats}"
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            print(f"[{label}] worker on {trees[tree]} (load average {fmt(load)})", file=sys.stderr, flush=True)
            run = run_child(WORKER, "--worker", str(trees[tree]), json.dumps(job), label, RESULT_PREFIX)
            run.update({"tree": tree, "repeat": repeat, "load_average_at_start": load})
            if "fatal" in run:
                print(f"[{label}] worker failed: {run['fatal']}", file=sys.stderr, flush=True)
            report["runs"].append(strip_ids(run))
            report["summary"] = summarize(rows, report["runs"], exact)
            report["elapsed_s"] = time.time() - started
            write_json(for_json(report), out_path)
    print_table(report["summary"])
    print(f"\n{out_path} ({(time.time() - started) / 60:.1f} min)")
    return 0 if not any("fatal" in r for r in report["runs"]) else 1

