"""Greedy tokens of every method on Spec-Bench prompts, alone and batched, written to JSON; `--compare A B` says
whether two such files (say, before and after a refactor) hold the same tokens, method by method.

    python benchmarks/greedy_tokens.py --dtype fp32 --json before.json     # in the old checkout
    python benchmarks/greedy_tokens.py --dtype fp32 --json after.json      # in the new one
    python benchmarks/greedy_tokens.py --compare before.json after.json
"""

from __future__ import annotations

import sys

from draftwise.bench import scripts

# method label -> (method, draft: "head" | "model" | None, extra generate options)
CASES = {
    "ar": ("ar", None, {}),
    "sd-model": ("sd", "model", {}),
    "sd-head": ("sd", "head", {}),
    "sd-head-tree": ("sd", "head", {"tree_nodes": 8}),
    "sd-model-tree": ("sd", "model", {"tree_nodes": 8}),
    "prompt-lookup": ("prompt-lookup", None, {}),
    "suffix": ("suffix", None, {}),
    "suffix-tree": ("suffix", None, {"tree_nodes": 8}),
    "hybrid": ("hybrid", "head", {}),
    "adaedl": ("adaedl", "model", {}),
    "sv": ("sv", "model", {}),
    "staged": ("staged", "model", {}),
    "cascade": ("cascade", "model", {}),
    "sprinter": ("sprinter", "model", {}),
    "mtad": ("mtad", "head", {}),
}


def generate(args) -> None:
    import draftwise
    from draftwise.atomic import write_json
    from draftwise.models import registry
    from draftwise.heads.loading import load_draft

    target = draftwise.load_model(args.target, dtype=args.dtype)
    drafts = {"head": load_draft(registry.default_draft(args.target), target, dtype=args.dtype),
              "model": load_draft(registry.default_independent_draft(args.target), target,
                                            dtype=args.dtype)}
    prompts = scripts.encoded_prompts(target, args.num_prompts)
    out: dict[str, dict[str, list[list[int]]]] = {}
    for label, (method, draft, extra) in CASES.items():
        kwargs = dict(method=method, temperature=0, max_new_tokens=args.max_new_tokens, gamma=4,
                      draft=drafts[draft] if draft else None, **extra)
        try:
            alone = [draftwise.generate(target, p, **kwargs).token_ids for p in prompts]
            batched = [o.token_ids for o in draftwise.generate(target, prompts, max_batch_size=args.batch, **kwargs)]
        except Exception as error:  # a method this target cannot run: recorded, not fatal
            print(f"{label}: {type(error).__name__}: {error}", flush=True)
            continue
        out[label] = {"alone": [list(t) for t in alone], "batched": [list(t) for t in batched]}
        print(f"{label}: {sum(map(len, alone))} tokens", flush=True)
    write_json({"target": args.target, "dtype": args.dtype, "num_prompts": args.num_prompts,
                "max_new_tokens": args.max_new_tokens, "batch": args.batch, "tokens": out}, args.json)


def main() -> None:
    parser = scripts.parser(__doc__, json=None)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--json", default="greedy-tokens.json")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = scripts.parse(parser)
    if args.compare:
        from draftwise.bench.report import compare_tokens

        sys.exit(compare_tokens(*args.compare))
    generate(args)


if __name__ == "__main__":
    main()
