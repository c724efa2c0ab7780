"""The worker of `benchmarks/compare_trees.py`: run by path in a fresh interpreter whose working directory is the tree
it measures, it puts that tree first on sys.path, imports its `draftwise`, loads the models once and times every
(method, batch size) of the job (JSON on stdin), then prints one line, RESULT_PREFIX and the JSON result, on stdout
(everything printed while measuring goes to stderr). `python worker.py --list-methods TREE` lists the tree's methods.
Standard library only at module level: nothing of this checkout's draftwise may be imported before the tree's.
A worker times its calls itself rather than with `draftwise.bench.timing`, which an older tree need not have.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

RESULT_PREFIX = "COMPARE_TREES_RESULT "


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
        raise RuntimeError(f"imported draftwise from {package}, not from {tree}")
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


if __name__ == "__main__":
    mode, tree = sys.argv[1:3]
    sys.exit(worker_main(tree) if mode == "--worker" else list_methods_main(tree))
