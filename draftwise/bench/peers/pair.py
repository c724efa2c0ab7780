"""`benchmarks/peers.py --pair`: the real pair (Qwen2.5-Coder 1.5B, the 0.5B as draft; their Q4_K_M files) against
llama.cpp's own tools (`llama_tools`), on the same prompts, interleaved prompt by prompt (`run_pair`)."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from draftwise.atomic import write_json
from draftwise.bench.datasets import load_prompts
from draftwise.bench.harness import encode_bench_prompt, machine_description
from draftwise.bench.peers import PEERS, install, llama_tools
from draftwise.bench.peers.driver import parse_skip

PAIR_TARGET, PAIR_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def llama_plain_rate(target: Path, threads: int, tokens: int, depth: int, log: Path) -> float:
    """llama-bench's decode rate (tokens/s) for `tokens` tokens after `depth` tokens of context, the average of
    its 2 repetitions (llama.cpp's tools have no plain decoding of a prompt file with a thread count:
    llama-speculative-simple refuses `--spec-type none`, llama-simple takes no thread count)."""
    run = llama_tools.run_bench(target, threads, 2, log, prompt_sizes=(0,), gen_tokens=tokens, depth=depth)
    return next(t for t in run["tests"].values() if t["n_gen"] == tokens and not t["n_prompt"])["tokens_per_s"]


def llama_speculative(target: Path, draft: Path, prompt_file: Path, draft_max: int, threads: int,
                      max_new_tokens: int, log: Path) -> dict[str, Any]:
    """One greedy run of llama-speculative-simple (the draft model, draft-simple), parsed from its summary."""
    out = llama_tools.run_speculative(target, draft, prompt_file, draft_max, threads, max_new_tokens, log)
    return {"new_tokens": out["new_tokens"], "decode_time_s": out["decode_s"],
            "prompt_tokens": out.get("prompt_tokens"), "drafted": out["drafted"], "accepted": out["accepted"],
            "target_calls": out["target_passes"]}


def run_pair(args: argparse.Namespace) -> int:
    """draftwise and llama.cpp on the pair's own Q4_K_M files, the same prompts, interleaved prompt by prompt.

    Configs: draftwise `--pair-methods` (default ar, sd, suffix, hybrid; bench labels such as `sd/gamma=2` or
    `sd/tree_nodes=8`; draft `--pair-draft`, the 0.5B by default or a trained head, gamma `--gamma`);
    llama.cpp speculative with the 0.5B (llama-speculative-simple, draft-simple, --spec-draft-n-max for each of
    `--llama-draft-max`); llama.cpp plain: llama-bench's decode rate for `--max-new-tokens` tokens after the
    prompts' mean length of context, once a repeat. Greedy; every engine stops at EOS or at
    `--max-new-tokens` (llama.cpp's tools cannot ignore EOS). Prompts: the bench's Spec-Bench evaluation prompts
    plus its coding category, chat-formatted; llama.cpp reads the same text from a file and tokenizes it itself
    (the JSON records both token counts). Rate: decode tokens/s (the tokens after the first over the time after
    the first, for draftwise; llama.cpp's own "decoded ... tokens in ... seconds", which excludes the prompt),
    summed over the prompts, median over `--repeats`."""
    import draftwise
    from draftwise.api import generate
    from draftwise.bench.labels import run_options
    from draftwise.methods import get_method
    from draftwise.models import registry
    from draftwise.heads.loading import load_draft
    from draftwise.models.loading import weights_description

    methods = [m for m in args.pair_methods.split(",") if m]
    labels = {m: run_options(m, {}, args.gamma) for m in methods}  # a bad label fails before anything loads
    logs = PEERS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "pair-llama.log"
    started = time.time()
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "plan")},
                              "machine": machine_description(torch.device("cpu"), detail=True), "setup": {}}
    t0 = time.time()
    result["setup"]["llama_tools_built"] = install.setup_llama_tools(log)
    result["setup"]["seconds"] = round(time.time() - t0, 1)
    result["setup"]["llama_tools"] = llama_tools.build_info()
    target_file, draft_file = registry.entry(PAIR_TARGET).gguf(), registry.entry(PAIR_DRAFT).gguf()
    if "llama-bench" not in parse_skip(args.skip):  # before any model is loaded here: llama-bench alone
        runs = llama_tools.bench_runs({PAIR_TARGET: target_file, PAIR_DRAFT: draft_file}, args.threads, args.repeats,
                                logs / "llama-bench.log")
        result["llama_bench"] = {"runs": runs, "table_markdown": llama_tools.bench_table(runs)}
    torch.set_num_threads(args.threads)
    target = draftwise.load_model(PAIR_TARGET)
    draft = load_draft(args.pair_draft, target)
    result["draftwise_weights"] = {"target": weights_description(target.model),
                                   "draft": weights_description(getattr(draft, "model", draft))}  # a head: its own
    prompts = [p for p in load_prompts("spec-bench", num_prompts=args.num_prompts)]
    coding = load_prompts("spec-bench", num_prompts=args.num_prompts, categories=["coding"])
    seen = {p.question_id for p in prompts}
    prompts += [p for p in coding if p.question_id not in seen]
    encoded = [encode_bench_prompt(target, p) for p in prompts]
    files = []
    for i, ids in enumerate(encoded):
        path = PEERS / "prompts" / f"pair-{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(target.tokenizer.decode(ids, skip_special_tokens=False))
        files.append(path)
    result["prompts"] = [{"question_id": p.question_id, "category": p.category, "tokens": len(ids)}
                         for p, ids in zip(prompts, encoded)]
    configs = [("draftwise", m) for m in methods] + [("llama.cpp", int(n)) for n in args.llama_draft_max.split(",") if n]
    depth = round(statistics.mean(len(ids) for ids in encoded))

    def run(config, i: int) -> dict[str, Any]:
        engine, what = config
        if engine == "llama.cpp":
            return llama_speculative(target_file, draft_file, files[i], what, args.threads, args.max_new_tokens, log)
        method, options = labels[what]
        start = time.perf_counter()
        g = generate(target, list(encoded[i]), draft=draft if get_method(method).needs_draft else None, method=method,
                     max_new_tokens=args.max_new_tokens, temperature=0.0, seed=0, **options)
        wall = time.perf_counter() - start
        s = g.stats
        ttft = s.get("time_to_first_token_s") or 0.0
        return {"new_tokens": s["new_tokens"], "decode_time_s": wall - ttft, "wall_time_s": wall,
                "target_calls": s["target_calls"], "drafted": s["drafted"], "accepted": s["accepted"],
                "token_ids": list(g.token_ids)}

    def name(config) -> str:
        engine, what = config
        if engine == "draftwise":
            return f"draftwise {what}"
        return f"llama.cpp speculative (draft max {what})"

    for config in configs:  # warm-up: one prompt each, not timed
        run(config, 0)
    runs: dict[str, list[list[dict[str, Any]]]] = {name(c): [] for c in configs}
    plain_rates: list[float] = []
    for r in range(args.repeats):
        per = {name(c): [] for c in configs}
        for i in range(len(encoded)):
            order = configs[(i + r) % len(configs):] + configs[: (i + r) % len(configs)]
            for config in order:
                per[name(config)].append(run(config, i))
                print(f"repeat {r + 1}/{args.repeats} prompt {i + 1}/{len(encoded)} {name(config)}: "
                      f"{per[name(config)][-1]['new_tokens']} tokens", file=sys.stderr, flush=True)
        for key, value in per.items():
            runs[key].append(value)
        plain_rates.append(llama_plain_rate(target_file, args.threads, args.max_new_tokens, depth, log))
    rows = []
    for config in configs:
        key = name(config)
        rates, accepted_lengths = [], []
        for rep in runs[key]:
            tokens = sum(x["new_tokens"] - (1 if config[0] == "draftwise" else 0) for x in rep)
            rates.append(tokens / sum(x["decode_time_s"] for x in rep))
            accepted_lengths.append(sum(x["new_tokens"] for x in rep) / max(1, sum(x["target_calls"] for x in rep)))
        rows.append({"config": key, "decode_tokens_per_s": statistics.median(rates), "per_repeat": rates,
                     "mean_accepted_length": statistics.median(accepted_lengths),
                     "new_tokens": sum(x["new_tokens"] for x in runs[key][0])})
    rows.append({"config": f"llama.cpp plain (llama-bench, tg{args.max_new_tokens} at depth {depth})",
                 "decode_tokens_per_s": statistics.median(plain_rates), "per_repeat": plain_rates,
                 "mean_accepted_length": 1.0, "new_tokens": args.max_new_tokens})
    by = {row["config"]: row for row in rows}
    base, plain = by["draftwise ar"]["decode_tokens_per_s"] if "draftwise ar" in by else None, rows[-1]["decode_tokens_per_s"]
    for row in rows:
        row["vs_draftwise_ar"] = row["decode_tokens_per_s"] / base if base else None
        row["vs_llama_cpp_plain"] = row["decode_tokens_per_s"] / plain
    llama_spec = max((row for row in rows if row["config"].startswith("llama.cpp speculative")),
                     key=lambda row: row["decode_tokens_per_s"], default=None)
    if llama_spec:
        for row in rows:
            row["vs_llama_cpp_best_speculative"] = row["decode_tokens_per_s"] / llama_spec["decode_tokens_per_s"]
    if base:  # greedy: the exact methods' tokens against ar's, prompt by prompt (first repeat)
        ar_ids = [x["token_ids"] for x in runs["draftwise ar"][0]]
        for row in rows:
            if row["config"].startswith("draftwise"):
                ids = [x["token_ids"] for x in runs[row["config"]][0]]
                row["identical_to_ar"] = f"{sum(a == b for a, b in zip(ids, ar_ids))}/{len(ar_ids)}"
    result["rows"] = rows
    result["seconds"] = round(time.time() - started, 1)
    target = draft = None  # frees the models (a `del` here reads to pyflakes as unbound names in `run`)
    gc.collect()
    lines = ["| config | decode tok/s | vs draftwise ar | vs llama.cpp plain | mean accepted length |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['decode_tokens_per_s']:.2f} | "
                     f"{row['vs_draftwise_ar'] or 0:.2f}x | {row['vs_llama_cpp_plain']:.2f}x | "
                     f"{row['mean_accepted_length']:.2f} |")
    print("\n".join(lines))
    if result.get("llama_bench"):
        tg = next(iter(result["llama_bench"]["runs"])).get("tests", {}).get(f"tg{llama_tools.GEN_TOKENS}")
        if tg and base:  # the figure: draftwise's greedy decoding against llama-bench's tg128, the target
            result["llama_bench"]["draftwise_ar_decode_vs_target_tg128"] = base / tg["tokens_per_s"]
        print()
        print(result["llama_bench"]["table_markdown"])
    if args.json:
        for row in rows:
            row.pop("token_ids", None)
        write_json(result, args.json)
    return 0
