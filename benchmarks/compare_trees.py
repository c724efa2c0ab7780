"""Every method's speed on two checkouts of draftwise, before and after a change, in one run (issue 21).

Each tree is a checkout of the repository (its `draftwise/` package at the root). Both packages import as
`draftwise`, so every measurement runs in a worker process (this script with `--worker TREE`) whose sys.path
starts with that tree. A worker loads the target, the registry's drafts and companion once (outside the
timing), then for every (method, batch size) makes one warm-up call and one timed call, and prints one
JSON line. Repeats alternate trees: before, after, before, after, ... (one worker per tree per repeat); the
report takes the median tokens/s per (tree, method, batch size) and the ratio after / before.

    .venv/bin/python benchmarks/compare_trees.py --before /tmp/old --after . --out out/compare_trees.json

- Models: the registry's defaults, as `draftwise.generate` picks them for a registry target (`--target`,
  default smollm2-135m; `--dtype` unset: generate's own choice): each method's default draft
  (`default_draft`), the registry's companion for `sv` / `staged`, the shipped SPRINTER verifier,
  SpecDec++ head and SV profiles (resolved by generate from the registry names).
- Prompts: the first `--prompts` Spec-Bench questions (first turn, `draftwise/data/spec_bench/question.jsonl`
  of the after tree), passed as strings (chat-formatted by generate). Temperature 0, ignore_eos, `--seed`.
- Batch 1: each prompt decoded alone (`generate(target, prompt)`), tokens/s = new tokens / summed wall time.
  Batch B > 1: one call `generate(target, prompts, max_batch_size=B)` over the first max(--prompts, B)
  prompts, so a batch of B is full (the row records how many prompts it decoded).
- `--batch-sizes` apply to every method; `--extra METHOD:B,...` adds sizes for single methods (only for
  methods selected by `--methods`).
- A (method, batch size) a tree refuses (a DraftwiseError, e.g. the old tree's one-request-at-a-time
  methods given a list of prompts) or fails on is recorded with its message; the other rows go on.
- Per row: tokens/s, target calls per token, mean accepted length (new tokens / target calls, as
  `draftwise.bench.metrics`), acceptance rate, and for the after tree whether each request's token ids equal
  the before tree's (where the before tree refused a batch size, against its batch-1 outputs).

The JSON is rewritten (atomically) after every worker, so an interrupted run keeps what it measured.
A worker times its calls itself rather than with `draftwise.bench.timing`: it imports `draftwise` from the tree it
measures, and an older tree need not have that module.
Run it with nothing else on the machine.
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
import tempfile
import threading
import time
from pathlib import Path

SPEC_BENCH = Path("draftwise") / "data" / "spec_bench" / "question.jsonl"
RESULT_PREFIX = "COMPARE_TREES_RESULT "
TREES = ("before", "after")


class Fail(Exception):
    """A one-line error for the user."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # noqa: D102 - argparse's usage block is replaced by one line
        raise Fail(message)


# --------------------------------------------------------------------------------------------- worker side


def _digest(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def worker(tree: str, job: dict) -> dict:
    """Runs in a fresh interpreter: import draftwise from `tree`, load the models once, time every job row."""
    sys.path.insert(0, tree)
    started = time.perf_counter()
    import warnings

    import torch

    import draftwise
    from draftwise.errors import DraftwiseError
    from draftwise.methods import METHODS
    from draftwise.models import registry
    from draftwise.heads.loading import load_draft
    from draftwise.models.loading import load_model

    package = Path(draftwise.__file__).resolve().parent
    if package != (Path(tree) / "draftwise").resolve():
        raise Fail(f"imported draftwise from {package}, not from {tree}")
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])

    default_draft = None
    for module in ("draftwise.api", "draftwise.plan"):  # the refactor moves it
        try:
            default_draft = getattr(__import__(module, fromlist=["default_draft"]), "default_draft", None)
        except ImportError:
            continue
        if default_draft is not None:
            break

    target_name = job["target"]
    load_start = time.perf_counter()
    target = load_model(target_name, **({"dtype": job["dtype"]} if job["dtype"] else {}))
    drafts: dict[str, object] = {}  # registry name -> loaded draft (a model or an EAGLE head)
    companions: dict[str, object] = {}

    def draft_for(spec) -> tuple[dict, str | None]:
        """generate()'s keyword arguments that hand it the registry's models, loaded once here."""
        kwargs: dict = {}
        draft_name = None
        if spec.needs_draft:
            if default_draft is None:
                return {}, "(picked inside generate: no default_draft found)"
            draft_name = default_draft(target, spec.name)
            if draft_name is not None:
                if draft_name not in drafts:
                    drafts[draft_name] = load_draft(draft_name, target)
                kwargs["draft"] = drafts[draft_name]
        if getattr(spec, "needs_companion", False):
            companion = registry.default_companion(target.name)
            if companion is not None:
                if companion not in companions:
                    companions[companion] = load_model(companion, device=target.device, dtype=target.dtype)
                kwargs["companion"] = companions[companion]
                draft_name = f"{draft_name} + companion {companion}"
        return kwargs, draft_name

    out: dict = {"tree": tree, "package": str(package), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "target": target_name,
                 "target_weights": getattr(target, "weights", str(target.dtype)),
                 "default_draft_found": default_draft is not None, "drafts": {}, "results": {}}
    prompts = job["prompts"]
    common = dict(temperature=0.0, ignore_eos=True, seed=job["seed"])
    warm_tokens = min(job["warmup_tokens"], job["max_new_tokens"])
    load_s = time.perf_counter() - load_start

    def call(method: str, kwargs: dict, prompt, size: int, tokens: int):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            result = draftwise.generate(target, prompt, method=method, max_new_tokens=tokens,
                                        **({"max_batch_size": size} if size > 1 else {}), **common, **kwargs)
            wall = time.perf_counter() - start
        return result, wall, sorted({str(w.message)[:200] for w in caught})

    for method, sizes in job["rows"]:
        rows: dict[str, dict] = out["results"].setdefault(method, {})
        spec = METHODS.get(method)
        if spec is None:
            for size in sizes:
                rows[str(size)] = {"error": f"no method {method!r} in this tree", "refused": True}
            continue
        try:
            load_start = time.perf_counter()
            kwargs, draft_name = draft_for(spec)
            load_s += time.perf_counter() - load_start
        except Exception as error:  # noqa: BLE001 - recorded, the other methods go on
            for size in sizes:
                rows[str(size)] = {"error": f"loading its models: {type(error).__name__}: {error}"[:500],
                                   "refused": isinstance(error, DraftwiseError)}
            continue
        out["drafts"][method] = draft_name
        for size in sizes:
            batch = prompts[: max(job["num_prompts"], size)] if size > 1 else prompts[: job["num_prompts"]]
            try:
                if size == 1:
                    call(method, kwargs, batch[0], 1, warm_tokens)  # warm-up
                    gens, wall, caught = [], 0.0, set()
                    for prompt in batch:
                        gen, seconds, messages = call(method, kwargs, prompt, 1, job["max_new_tokens"])
                        gens.append(gen)
                        wall += seconds
                        caught.update(messages)
                    caught = sorted(caught)
                else:
                    call(method, kwargs, batch, size, warm_tokens)  # warm-up
                    gens, wall, caught = call(method, kwargs, batch, size, job["max_new_tokens"])
            except DraftwiseError as error:
                rows[str(size)] = {"error": str(error)[:500], "refused": True}
                print(f"  {method} batch {size}: refused: {str(error)[:160]}", file=sys.stderr, flush=True)
                continue
            except Exception as error:  # noqa: BLE001 - recorded, the other rows go on
                import traceback

                traceback.print_exc(file=sys.stderr)
                rows[str(size)] = {"error": f"{type(error).__name__}: {error}"[:500], "refused": False}
                continue
            stat = lambda key: sum(int(g.stats.get(key, 0) or 0) for g in gens)  # noqa: E731
            new_tokens, target_calls = stat("new_tokens"), stat("target_calls")
            drafted, accepted = stat("drafted"), stat("accepted")
            rows[str(size)] = {
                "prompts": len(batch), "new_tokens": new_tokens, "wall_s": wall,
                "tokens_per_s": new_tokens / wall if wall else 0.0,
                "target_calls": target_calls,
                "target_calls_per_token": target_calls / new_tokens if new_tokens else 0.0,
                "mean_accepted_length": new_tokens / target_calls if target_calls else 0.0,
                "drafted": drafted, "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "finish_reasons": sorted({str(g.stats.get("finish_reason")) for g in gens}),
                "token_ids": [list(g.token_ids) for g in gens],
                **({"warnings": caught} if caught else {}),
            }
            print(f"  {method} batch {size}: {rows[str(size)]['tokens_per_s']:.2f} tok/s "
                  f"({new_tokens} tokens, {wall:.1f} s)", file=sys.stderr, flush=True)
    out["load_s"] = load_s
    out["wall_s"] = time.perf_counter() - started
    return out


def worker_main(tree: str) -> int:
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # anything printed while measuring goes to stderr; stdout carries one JSON line
    try:
        out = worker(tree, json.loads(sys.stdin.read()))
    except Exception as error:  # noqa: BLE001 - the parent records it in one line
        import traceback

        traceback.print_exc(file=sys.stderr)
        out = {"fatal": f"{type(error).__name__}: {error}"[:500]}
    real_stdout.write(RESULT_PREFIX + json.dumps(out) + "\n")
    real_stdout.flush()
    return 0 if "fatal" not in out else 1


def list_methods_main(tree: str) -> int:
    sys.path.insert(0, tree)
    sys.stdout, real_stdout = sys.stderr, sys.stdout
    try:
        from draftwise.methods import METHODS

        out = {"methods": {n: {"exact": bool(getattr(m, "exact", True))} for n, m in METHODS.items()}}
    except Exception as error:  # noqa: BLE001
        out = {"fatal": f"{type(error).__name__}: {error}"[:300]}
    real_stdout.write(RESULT_PREFIX + json.dumps(out) + "\n")
    return 0


# --------------------------------------------------------------------------------------------- parent side


def run_child(mode: str, tree: str, stdin: str, label: str) -> dict:
    """One worker process; its stderr echoed (prefixed), its one JSON line parsed."""
    command = [sys.executable, os.path.abspath(__file__), mode, tree]
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
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        return {"fatal": f"worker exited with status {process.returncode}: {last.strip()[:300]}"}
    return json.loads(lines[-1][len(RESULT_PREFIX):])


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


def write_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


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


def parent_main(argv: list[str]) -> int:
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
    args = parser.parse_args(argv)

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
        got = run_child("--list-methods", str(trees[tree]), "", "")
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
            run = run_child("--worker", str(trees[tree]), json.dumps(job), label)
            run.update({"tree": tree, "repeat": repeat, "load_average_at_start": load})
            if "fatal" in run:
                print(f"[{label}] worker failed: {run['fatal']}", file=sys.stderr, flush=True)
            report["runs"].append(strip_ids(run))
            report["summary"] = summarize(rows, report["runs"], exact)
            report["elapsed_s"] = time.time() - started
            write_atomic(out_path, for_json(report))
    print_table(report["summary"])
    print(f"\n{out_path} ({(time.time() - started) / 60:.1f} min)")
    return 0 if not any("fatal" in r for r in report["runs"]) else 1


def main() -> int:
    argv = sys.argv[1:]
    try:
        if argv[:1] == ["--worker"] and len(argv) == 2:
            return worker_main(argv[1])
        if argv[:1] == ["--list-methods"] and len(argv) == 2:
            return list_methods_main(argv[1])
        return parent_main(argv)
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
