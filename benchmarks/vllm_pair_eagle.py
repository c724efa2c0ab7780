"""A draftwise EAGLE-3 head exported for vLLM (`draftwise export-eagle`), run in vLLM's CPU build beside its target:
vLLM's acceptance on the prompts `draftwise bench` uses, and whether its speculative outputs equal its plain ones.

Prompts: `draftwise bench`'s (`load_prompts(dataset, num_prompts=N)`, chat-formatted by `encode_bench_prompt` with the
target as the bench loads it, `--prompt-dtype`, default auto), sent to vLLM as token ids. vLLM loads the target's
Hugging Face directory in bf16 and runs through the peers' worker (`draftwise.bench.peers.worker.VllmRunner`, one
process per engine configuration, `.peers/vllm`'s Python, `install.worker_env`: `--threads` cores bound,
VLLM_CPU_KVCACHE_SPACE=`--kv-gb`): once with speculative_config {"method": "eagle3", "model": --eagle,
"num_speculative_tokens": --gamma} and once without. Greedy, `--max-new-tokens`; it stops at the target's EOS tokens
as `draftwise bench` does (`--ignore-eos` to decode exactly `--max-new-tokens`).

Reports vLLM's spec-decode counters (`LLM.get_metrics()`: vllm:spec_decode_num_drafts, _num_draft_tokens,
_num_accepted_tokens, _num_accepted_tokens_per_pos; per request, the warm-up left out) and from them:
- mean_accepted_length_vllm = 1 + accepted / drafts (vLLM's own);
- mean_accepted_length = new tokens / target passes, passes = new tokens - accepted (draftwise's definition);
- acceptance_rate = accepted / draft tokens; accepted_per_position[i] = accepted at i / drafts;
the output token ids of both runs and whether they are identical; and with `--draftwise-json` (a `draftwise bench
--json` file, `--save-outputs` for token ids) draftwise's numbers of the same run beside them.

    .venv/bin/python benchmarks/vllm_pair_eagle.py --eagle .peers/models/eagle3-qwen2.5-coder-1.5b-e \\
        --dataset spec-bench --num-prompts 8 --max-new-tokens 96 --gamma 4 --json out/vllm-pair/vllm-sb8.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class InputError(Exception):
    """Bad input: printed as one line, exit status 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b",
                   help="registry name or Hugging Face directory: the bench's prompt encoding and EOS tokens")
    p.add_argument("--hf-dir", default=None,
                   help="the directory vLLM loads (default: the target's float directory, the registry's)")
    p.add_argument("--eagle", required=True, help="an exported EAGLE-3 directory (`draftwise export-eagle`)")
    p.add_argument("--dataset", default="spec-bench", choices=["spec-bench", "humaneval"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=4, help="num_speculative_tokens (a chain)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="vLLM's target dtype")
    p.add_argument("--prompt-dtype", default="auto", help="the target format the prompts are encoded with (as bench)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--ignore-eos", action="store_true", help="decode exactly --max-new-tokens (default: stop at EOS)")
    p.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    p.add_argument("--skip-plain", action="store_true", help="no run without speculation")
    p.add_argument("--draftwise-json", default=None, help="a `draftwise bench --json` file of the same prompts")
    p.add_argument("--draftwise-method", default=None, help="its method label (default: the first that is not ar)")
    p.add_argument("--reuse", default=None, help="a previous report of this script: its vLLM runs, not run again "
                   "(to set a --draftwise-json beside them)")
    p.add_argument("--worker-timeout", type=float, default=7200.0, help="seconds a vLLM worker may take per step")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    for name in ("num_prompts", "max_new_tokens", "gamma", "threads", "kv_gb"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads > len(os.sched_getaffinity(0)):
        raise InputError(f"--threads {args.threads}: only {len(os.sched_getaffinity(0))} cores are available")
    eagle = Path(args.eagle)
    if not (eagle / "config.json").is_file() or not (eagle / "model.safetensors").is_file():
        raise InputError(f"--eagle {eagle}: no config.json and model.safetensors (export one with "
                         "`draftwise export-eagle --head H --out DIR --dtype bf16`)")
    if args.reuse and not Path(args.reuse).is_file():
        raise InputError(f"--reuse {args.reuse}: no such file")
    if args.draftwise_json and not Path(args.draftwise_json).is_file():
        raise InputError(f"--draftwise-json {args.draftwise_json}: no such file")
    return args


def encode_prompts(args: argparse.Namespace) -> tuple[list[Any], list[list[int]], list[int], str]:
    """The bench's prompts and token ids, the target's EOS ids, and vLLM's directory."""
    import draftwise
    from draftwise.bench.datasets import load_prompts
    from draftwise.bench.harness import encode_bench_prompt
    from draftwise.models import registry

    prompts = load_prompts(args.dataset, num_prompts=args.num_prompts)
    target = draftwise.load_model(args.target, dtype=args.prompt_dtype)
    encoded = [encode_bench_prompt(target, p) for p in prompts]
    eos = sorted(int(t) for t in target.eos_token_ids)
    del target
    gc.collect()
    if args.hf_dir:
        hf_dir = Path(args.hf_dir)
    elif args.target in registry.names():
        hf_dir = registry.resolve(args.target)
    else:
        hf_dir = Path(args.target)
    if not (hf_dir / "config.json").is_file():
        raise InputError(f"{hf_dir}: not a Hugging Face model directory (no config.json); pass --hf-dir")
    return prompts, encoded, eos, str(hf_dir)


def run_vllm(group: str, plan: dict[str, Any], cfg: dict[str, Any], env: dict[str, str],
             timeout: float) -> dict[str, Any]:
    """One configuration in a peers worker of its own: load and warm up, one pass over the prompts, stop."""
    from draftwise.bench.peers import PEERS
    from draftwise.bench.peers.driver import Worker
    from draftwise.bench.peers.worker import one_line

    t0 = time.perf_counter()
    worker = Worker(group, "vllm", PEERS / "vllm" / "bin" / "python", dict(plan, configs=[cfg]), env)
    out: dict[str, Any] = {"log": str(worker.log_path)}
    try:
        event = worker.next_event(timeout)
        if event["event"] != "ready":
            raise RuntimeError(event.get("reason", f"unexpected event {event['event']}"))
        if event["errors"]:
            raise RuntimeError(event["errors"][cfg["id"]])
        out["versions"], out["startup_s"] = event["versions"], round(time.perf_counter() - t0, 1)
        print(f"{group}: ready in {out['startup_s']} s", flush=True)
        worker.send({"cmd": "run", "repeat": 0})
        while True:
            event = worker.next_event(timeout)
            if event["event"] == "done":
                break
            if event["event"] == "result":
                out["runs"] = event["runs"]
            elif event["event"] == "error":
                raise RuntimeError(event["reason"])
    except Exception as error:  # noqa: BLE001 - recorded; the report still gets written
        out["error"] = one_line(error)
        print(f"{group}: failed: {out['error']} (log {worker.log_path})", flush=True)
    finally:
        worker.stop()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def vllm_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    counters: dict[str, Any] = {}
    for run in runs:
        for k, v in (run.get("spec_counters") or {}).items():
            if isinstance(v, list):
                old = counters.get(k) or [0] * len(v)
                counters[k] = [a + b for a, b in zip(old, v)]
            else:
                counters[k] = counters.get(k, 0) + v
    drafts, draft_tokens = counters.get(NUM_DRAFTS, 0), counters.get(DRAFT_TOKENS, 0)
    accepted = counters.get(ACCEPTED, 0)
    per_pos = counters.get(PER_POS) or []
    new = sum(r["new_tokens"] for r in runs)
    return {
        "prompts": len(runs), "new_tokens": new, "num_drafts": drafts, "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": per_pos,
        "mean_accepted_length_vllm": 1 + accepted / drafts if drafts else None,
        "mean_accepted_length": new / (new - accepted) if new > accepted else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "accepted_per_position": [a / drafts for a in per_pos] if drafts else None,
        "per_request_drafted": sum(r.get("drafted", 0) for r in runs),
        "per_request_accepted": sum(r.get("accepted", 0) for r in runs),
        "counters": counters,
    }


def draftwise_side(path: str, method: str | None, question_ids: list[int]) -> dict[str, Any]:
    """The bench JSON's numbers for its speculative method (and its token ids, where it saved them)."""
    report = json.loads(Path(path).read_text())
    methods = report.get("methods") or {}
    if not methods:
        raise InputError(f"--draftwise-json {path}: no 'methods' section (a `draftwise bench --json` file?)")
    label = method or next((m for m in methods if m != "ar"), None)
    if label not in methods:
        raise InputError(f"--draftwise-json {path}: no method {label!r}; it has {', '.join(methods)}")
    s = methods[label]
    keep = ("mean_accepted_length", "acceptance_rate", "accepted_per_position", "drafted", "accepted",
            "target_calls", "new_tokens", "tokens_per_s")
    out: dict[str, Any] = {"file": path, "method": label, **{k: s.get(k) for k in keep if k in s}}
    config = report.get("config") or {}
    out["config"] = {k: config.get(k) for k in ("target", "draft", "dtype", "dataset", "num_prompts",
                                                "max_new_tokens", "temperature", "gamma", "prompts")}
    if config.get("prompts") and list(config["prompts"]) != list(question_ids):
        out["warning"] = f"its prompts {config['prompts']} are not these {question_ids}"
    tokens: dict[str, dict[int, list[int]]] = {}  # `--save-outputs`: {"outputs": {method: [run, ...]}}
    for name, records in (report.get("outputs") or {}).items():
        for record in records:
            if record.get("token_ids") is not None and record.get("repeat", 0) == 0:
                tokens.setdefault(name, {})[record["question_id"]] = list(record["token_ids"])
    if tokens:
        out["new_tokens_per_prompt"] = {name: [len(by_id[q]) for q in question_ids if q in by_id]
                                        for name, by_id in tokens.items()}
    out["_tokens"] = tokens
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How far two runs' outputs agree: identical prompts, and the common prefix in tokens."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {"identical": same == len(a) == len(b), "identical_prompts": same, "prompts": len(a),
            "common_prefix_tokens": prefix}


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from draftwise.atomic import write_json
        from draftwise.bench.peers import PEERS, install

        log = PEERS / "logs" / "vllm-install.log"
        install.setup_vllm(log)
        prompts, encoded, eos, hf_dir = encode_prompts(args)
        dw = draftwise_side(args.draftwise_json, args.draftwise_method, [p.question_id for p in prompts]) \
            if args.draftwise_json else None
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    n_ctx = -(-(max(len(ids) for ids in encoded) + args.max_new_tokens + 2 * args.gamma + 16) // 256) * 256
    plan = {"target": args.target, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
            "gamma": args.gamma, "prompts": encoded, "batch_prompts": encoded[:1], "batch_size": 1, "n_ctx": n_ctx,
            "hf_dir": hf_dir, "ignore_eos": args.ignore_eos, "stop_token_ids": None if args.ignore_eos else eos,
            "spec_counters": True, "llm_kwargs": {} if args.compile else {"enforce_eager": True}}
    env = install.worker_env(args.threads, args.kv_gb)
    spec_config = {"method": "eagle3", "model": str(Path(args.eagle).resolve()),
                   "num_speculative_tokens": args.gamma}
    tag = f"vllm-pair-eagle-{args.dataset}"
    result: dict[str, Any] = {
        "settings": {"target_hf_dir": hf_dir, "vllm_dtype": args.dtype, "eagle": str(Path(args.eagle).resolve()),
                     "speculative_config": spec_config, "dataset": args.dataset, "num_prompts": args.num_prompts,
                     "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": args.ignore_eos,
                     "stop_token_ids": plan["stop_token_ids"], "threads": args.threads, "kv_cache_gib": args.kv_gb,
                     "enforce_eager": not args.compile, "prompt_encoding": f"{args.target} --dtype {args.prompt_dtype}",
                     "VLLM_CPU_OMP_THREADS_BIND": env["VLLM_CPU_OMP_THREADS_BIND"], "n_ctx": n_ctx},
        "prompts": [{"question_id": p.question_id, "category": p.category, "prompt_tokens": len(ids)}
                    for p, ids in zip(prompts, encoded)],
    }
    previous = json.loads(Path(args.reuse).read_text()) if args.reuse else None
    if previous is not None:
        if previous.get("prompts") != result["prompts"]:
            print(f"error: --reuse {args.reuse}: its prompts are not these", file=sys.stderr)
            return 2
        result["reused_vllm_runs_from"] = args.reuse

    def vllm(group: str, plan: dict[str, Any], cfg: dict[str, Any], key: str) -> dict[str, Any]:
        if previous is None:
            return run_vllm(group, plan, cfg, env, args.worker_timeout)
        old = dict(previous.get(key) or {"error": f"not in {args.reuse}"})
        if old.get("per_prompt"):
            old["runs"] = [{"new_tokens": r["new_tokens"], "drafted": r.get("drafted"), "accepted": r.get("accepted"),
                            "vllm_spec_steps": r.get("spec_steps"), "spec_counters": r.get("counters"),
                            "token_ids": r["token_ids"]} for r in old.pop("per_prompt")]
        old.pop("summary", None)
        return old

    cfg = {"id": "vllm/spec/eagle3/bf16", "batch": 1, "vllm_dtype": args.dtype, "speculative_config": spec_config}
    spec = vllm(f"{tag}-eagle3", plan, cfg, "vllm_eagle3")
    result["vllm_eagle3"] = {k: v for k, v in spec.items() if k != "runs"}
    if spec.get("runs"):
        result["vllm_eagle3"]["summary"] = vllm_summary(spec["runs"])
        result["vllm_eagle3"]["per_prompt"] = [
            {"question_id": p.question_id, "new_tokens": r["new_tokens"], "drafted": r.get("drafted"),
             "accepted": r.get("accepted"), "spec_steps": r.get("vllm_spec_steps"),
             "counters": r.get("spec_counters"), "token_ids": r["token_ids"]} for p, r in zip(prompts, spec["runs"])]
    if not args.skip_plain:
        plain = vllm(f"{tag}-plain", dict(plan, spec_counters=False),
                     {"id": "vllm/b1/ar/bf16", "batch": 1, "vllm_dtype": args.dtype}, "vllm_plain")
        result["vllm_plain"] = {k: v for k, v in plain.items() if k != "runs"}
        if plain.get("runs"):
            result["vllm_plain"]["per_prompt"] = [
                {"question_id": p.question_id, "new_tokens": r["new_tokens"], "token_ids": r["token_ids"]}
                for p, r in zip(prompts, plain["runs"])]
            if spec.get("runs"):
                result["vllm_eagle3_vs_plain"] = agreement([r["token_ids"] for r in spec["runs"]],
                                                           [r["token_ids"] for r in plain["runs"]])
    if dw is not None:
        tokens = dw.pop("_tokens")
        result["draftwise"] = dw
        ids = [p.question_id for p in prompts]
        for label, key in (("ar", "vllm_plain"), (dw["method"], "vllm_eagle3")):
            ours = tokens.get(label)
            theirs = result.get(key, {}).get("per_prompt")
            if ours and theirs and all(q in ours for q in ids):
                dw[f"{label}_vs_{key}"] = agreement([ours[q] for q in ids], [r["token_ids"] for r in theirs])
        if tokens.get("ar") and tokens.get(dw["method"]) and all(q in tokens["ar"] and q in tokens[dw["method"]]
                                                                  for q in ids):
            dw[f"{dw['method']}_vs_ar"] = agreement([tokens[dw["method"]][q] for q in ids],
                                                    [tokens["ar"][q] for q in ids])
    s = result.get("vllm_eagle3", {}).get("summary")
    if s:
        print(json.dumps({k: v for k, v in s.items() if k != "counters"}, indent=1))
    if "vllm_eagle3_vs_plain" in result:
        print("eagle3 outputs identical to plain:", result["vllm_eagle3_vs_plain"]["identical"])
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0 if s else 1


if __name__ == "__main__":
    raise SystemExit(main())
