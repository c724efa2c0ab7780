"""Where decoding time goes: model forward passes vs the loop around them.

Runs each method on Spec-Bench evaluation prompts, timing every ModelRunner.forward
(target and draft), and reports loop overhead = 1 - forward time / wall time.
Writes JSON. Usage:

    python benchmarks/profile_loop.py --target smollm2-135m --methods ar,sd,prompt-lookup \
        --num-prompts 8 --max-new-tokens 128 --dtype fp32 --json out/profile.json
"""

from __future__ import annotations

import argparse
import time

import torch

import draftwise
from draftwise.bench.datasets import load_prompts
from draftwise.bench.harness import BenchConfig, _load_bench_draft, _prompt_ids, machine_description, resolve_drafts
from draftwise.bench.report import write_json
from draftwise.eagle import EagleHead
from draftwise.models import runner as runner_module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--methods", default="ar,sd,prompt-lookup")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    config = resolve_drafts(BenchConfig(target=args.target, draft=args.draft, dtype=args.dtype))
    target = draftwise.load_model(config.target, dtype=args.dtype)
    draft = _load_bench_draft(config.draft, target, config) if config.draft else None
    prompts = [_prompt_ids(target, p) for p in load_prompts(num_prompts=args.num_prompts)]

    spent = {"forward": 0.0}

    def timed(fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["forward"] += time.perf_counter() - start
        return wrapper

    runner_module.ModelRunner.forward = timed(runner_module.ModelRunner.forward)
    EagleHead.forward = timed(EagleHead.forward)
    results = {}
    for method in args.methods.split(","):
        spec = draftwise.METHODS[method]
        kwargs = dict(method=method, temperature=0, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                      draft=draft if spec.needs_draft else None)
        draftwise.generate(target, prompts[0], **{**kwargs, "max_new_tokens": 8})  # warm-up
        spent["forward"] = 0.0
        wall = 0.0
        tokens = 0
        for ids in prompts:
            start = time.perf_counter()
            out = draftwise.generate(target, ids, **kwargs)
            wall += time.perf_counter() - start
            tokens += out.stats["new_tokens"]
        results[method] = {"wall_s": wall, "forward_s": spent["forward"], "loop_overhead": 1 - spent["forward"] / wall,
                           "tokens": tokens, "tokens_per_s": tokens / wall}
        print(f"{method:<14} wall {wall:7.2f}s  forward {spent['forward']:7.2f}s  "
              f"overhead {100 * results[method]['loop_overhead']:.1f}%  {tokens / wall:.1f} tok/s", flush=True)
    out = {"config": vars(args) | {"draft": config.draft}, "machine": machine_description(torch.device("cpu")),
           "methods": results}
    if args.json:
        write_json(out, args.json)


if __name__ == "__main__":
    main()
