"""Tune an EAGLE head's draft length on Spec-Bench *training* prompts (never the evaluation split).

For every (gamma, confidence) pair, `sd` with the head decodes the same prompts at batch 1, interleaved
prompt by prompt with `ar`, after a warm-up; the speed ratio is the median over prompts of
ar_time / sd_time. Writes JSON with the ratio, mean accepted length and step-1 acceptance per pair.
With --write, the best confidence is stored in the head's config (`dynamic.confidence`), which `sd`
and `hybrid` read when their `confidence` option is left at -1.

    .venv/bin/python benchmarks/tune_head.py --head out/eagle3/head --json benchmarks/results/head-tuning.json
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

import draftwise
from draftwise.bench import scripts
from draftwise.bench.datasets import load_prompts
from draftwise.bench.timing import once
from draftwise.heads.export import load_head
from draftwise.heads.loading import load_draft
from draftwise.models.loading import load_model, resolve_path


def main() -> int:
    p = scripts.parser(__doc__, json=True)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--head", required=True)
    p.add_argument("--gammas", default="3,4,5,6")
    p.add_argument("--confidences", default="0,0.2,0.35,0.5")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--write", action="store_true", help="store the best confidence in the head's config")
    args = scripts.parse(p)
    target = load_model(args.target, dtype="fp32")
    head = load_draft(args.head, target)
    texts = [q.text for q in load_prompts(split="train")][:: max(1, 384 // args.num_prompts)][: args.num_prompts]
    prompts = [[{"role": "user", "content": text}] for text in texts]  # chat, as the bench asks
    pairs = [(int(g), float(c)) for g in args.gammas.split(",") for c in args.confidences.split(",")]
    kw = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    draftwise.generate(target, messages=prompts[0], method="ar", **kw)  # warm-up
    draftwise.generate(target, messages=prompts[0], method="sd", draft=head, gamma=pairs[0][0], confidence=pairs[0][1], **kw)
    cases = {"ar": dict(method="ar")} | {f"g{g}-c{c:g}": dict(method="sd", draft=head, gamma=g, confidence=c)
                                         for g, c in pairs}
    times: dict[str, list[float]] = {key: [] for key in cases}
    stats: dict[str, list[dict]] = {key: [] for key in cases}
    for prompt in prompts:  # per prompt, every case in turn (bench.timing); a case's time per new token
        runs = once({key: partial(draftwise.generate, target, messages=prompt, **options, **kw)
                     for key, options in cases.items()})
        for key, (wall, out) in runs.items():
            times[key].append(wall / max(1, len(out.token_ids)))
            stats[key].append(out.stats)
    rows = {}
    for key, per_token in times.items():
        if key == "ar":
            continue
        rows[key] = {"speedup_vs_ar_median": scripts.speedups(times["ar"], per_token), **scripts.speculation(stats[key])}
    best = max(rows, key=lambda k: rows[k]["speedup_vs_ar_median"])
    result = {"config": vars(args), "machine": {"threads": torch.get_num_threads()}, "prompts": len(prompts),
              "pairs": rows, "best": best}
    scripts.finish(result, args.json)
    for key, row in sorted(rows.items(), key=lambda kv: -kv[1]["speedup_vs_ar_median"]):
        print(f"{key:<10} {row['speedup_vs_ar_median']:.3f}x  MAL {row['mean_accepted_length']:.2f}  "
              f"acc {row['acceptance_rate']:.3f}  step-1 {row['step1_acceptance']:.3f}")
    if args.write:
        gamma, confidence = best[1:].split("-c")
        path = resolve_path(args.head)
        original = load_head(path)
        original.config = replace(original.config, dynamic={"confidence": float(confidence), "gamma": int(gamma)})
        original.save(path)
        print(f"stored confidence {confidence} (best gamma {gamma}) in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
