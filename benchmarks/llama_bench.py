"""llama.cpp's own tools as a peer: `llama-bench` and `llama-speculative-simple` on GGUF files.

What they measure and how they are built: draftwise/bench/peers/llama_tools.py. Opt-in, like benchmarks/peers.py.

    .venv/bin/python benchmarks/llama_bench.py --setup-only            # build the tools (14.4 min at nice 19 on 2 shared cores)
    .venv/bin/python benchmarks/llama_bench.py --model qwen2.5-coder-1.5b,qwen2.5-coder-0.5b \\
        --json benchmarks/results/llama-bench-<cpu>.json
    .venv/bin/python benchmarks/llama_bench.py --speculative --model qwen2.5-coder-1.5b \\
        --draft qwen2.5-coder-0.5b --draft-max 3,8 --prompt-file PROMPT.txt --max-new-tokens 128 \\
        --json benchmarks/results/llama-speculative-<cpu>.json

`--model` / `--draft` take a GGUF path or a registry name (its GGUF file; `smollm2-135m` is the shipped Q4_1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from draftwise.atomic import write_json
from draftwise.bench.harness import machine_description
from draftwise.bench.peers.install import resolve_gguf
from draftwise.bench.peers.llama_tools import (GEN_TOKENS, PROMPT_SIZES, bench_table, bin_dir, build_info, run_bench,
                                               setup_tools, speculative)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b",
                        help="comma list of GGUF paths or registry names (with --speculative: the target, one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="llama-bench's repetitions (-r); with --speculative, runs per draft length")
    parser.add_argument("--prompt-sizes", default=",".join(map(str, PROMPT_SIZES)), help="llama-bench -p")
    parser.add_argument("--gen-tokens", type=int, default=GEN_TOKENS, help="llama-bench -n")
    parser.add_argument("--speculative", action="store_true", help="llama-speculative-simple instead of llama-bench")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="--speculative: the draft (path or name)")
    parser.add_argument("--draft-max", default="3,8", help="--speculative: comma list of draft lengths")
    parser.add_argument("--prompt-file", default=None, help="--speculative: the prompt, as text")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="--speculative: -n")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one tool run may take")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs of the one-time build")
    parser.add_argument("--setup-only", action="store_true", help="build the tools, then stop")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        sizes = tuple(int(x) for x in args.prompt_sizes.split(",") if x.strip())
        draft_maxes = [int(x) for x in args.draft_max.split(",") if x.strip()]
    except ValueError:
        parser.error("--prompt-sizes and --draft-max take comma lists of integers")
    if min(args.threads, args.repeats, args.gen_tokens, args.max_new_tokens, args.jobs, *sizes, *draft_maxes) < 1:
        parser.error("--threads, --repeats, --gen-tokens, --max-new-tokens, --jobs, prompt sizes and draft lengths "
                     "must be >= 1")
    if args.speculative and not args.prompt_file and not args.setup_only:
        parser.error("--speculative needs --prompt-file")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result: dict[str, Any] = {"config": vars(args), "machine": machine_description(torch.device("cpu"), detail=True)}
    try:
        start = time.time()
        built = setup_tools(jobs=args.jobs)
        result["setup"] = {"built_now": built, "seconds": round(time.time() - start, 1), "build": build_info()}
        print(f"llama.cpp tools: {'built' if built else 'already built'} in {bin_dir()} "
              f"({result['setup']['seconds']} s)", flush=True)
        if args.setup_only:
            return 0
        models = [resolve_gguf(m) for m in args.model.split(",") if m.strip()]
        if args.speculative:
            if len(models) != 1:
                parser.error("--speculative takes one --model (the target)")
            result["speculative"] = speculative(models[0], resolve_gguf(args.draft), Path(args.prompt_file),
                                                draft_maxes, args.threads, args.max_new_tokens, args.repeats,
                                                args.timeout)
            print(result["speculative"]["table_markdown"])
        else:
            runs = []
            for model in models:
                print(f"llama-bench {model.name} ...", flush=True)
                try:
                    runs.append(run_bench(model, args.threads, args.repeats, timeout=args.timeout,
                                          prompt_sizes=sizes, gen_tokens=args.gen_tokens))
                except (RuntimeError, ValueError) as error:
                    runs.append({"model": str(model), "error": str(error).splitlines()[0][:300]})
            result["llama_bench"] = runs
            result["table_markdown"] = bench_table(runs)
            print(result["table_markdown"])
    except (RuntimeError, ValueError) as error:
        print(f"llama_bench: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    result["machine"]["load_average_at_end"] = list(os.getloadavg())
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0 if all("error" not in r for r in result.get("llama_bench", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
