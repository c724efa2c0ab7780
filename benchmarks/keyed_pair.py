"""Seeded answers under load on a real pair, and the acceptance of the two couplings (issue 55, item 2).

1. Couplings (run first): `sd` at T=1 on Spec-Bench prompts with the Gumbel coupling (the default:
   drafter-invariant) and with rejection sampling, both seeded alike: acceptance rate, mean accepted length, and
   whether each answer equals `ar`'s with the same seed (it must under Gumbel; under rejection it need not).
2. Load: REQUESTS copies of one seeded request (the shortest of the first 40 Spec-Bench prompts) on one engine,
   `concurrency` in flight (a closed loop: a new request joins as one ends, while the others decode, as in the
   server), for each method at T=0 and T=1; each answer is compared with the first answer at concurrency 1 (which
   must all agree with each other too).

    nice -n 10 python benchmarks/keyed_pair.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --max-new-tokens 8 --json benchmarks/results/keyed-pair.json
"""

from __future__ import annotations

import time

from draftwise.bench import scripts

LOAD_METHODS = {
    "sd": ("sd", True, {}),
    "prompt-lookup": ("prompt-lookup", False, {}),
    "suffix": ("suffix", False, {}),
    "hybrid": ("hybrid", True, {}),
    "trees": ("sd", True, {"tree_nodes": 8}),
    "lossy": ("lossy", True, {"alpha": 0.3}),
    "cascade": ("cascade", True, {}),
}


def closed_loop(plan, concurrency: int, requests: int) -> list[list[int]]:
    from draftwise.builder import build_engine
    from draftwise.plan import request_for

    engine = build_engine(plan, concurrency)
    request = request_for(plan, plan.prompt_ids)
    ids = [engine.submit(request) for _ in range(min(concurrency, requests))]
    while engine.has_work:
        for event in engine.step():
            if event.finished and len(ids) < requests:
                ids.append(engine.submit(request))
    return [engine.result(i).token_ids for i in ids]


def main() -> None:
    parser = scripts.parser(__doc__)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--methods", default=",".join(LOAD_METHODS))
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--accept-prompts", type=int, default=4)
    parser.add_argument("--accept-tokens", type=int, default=32)
    parser.add_argument("--skip-load", action="store_true")
    args = scripts.parse(parser)

    import torch

    import draftwise
    from draftwise.atomic import write_json
    from draftwise.bench.harness import machine_description
    from draftwise.heads.loading import load_draft
    from draftwise.plan import make_plan

    target = draftwise.load_model(args.target)
    draft = load_draft(args.draft, target)
    prompts = scripts.encoded_prompts(target, max(args.accept_prompts, 1))
    out = {"command": "python benchmarks/keyed_pair.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False, True)),
           "machine": machine_description(torch.device("cpu")), "target": args.target, "draft": args.draft, "load": [], "couplings": {}}
    started = time.perf_counter()

    accept_prompts = prompts[: args.accept_prompts]
    common = dict(temperature=1.0, max_new_tokens=args.accept_tokens, ignore_eos=True, seed=args.seed)
    ar = [draftwise.generate(target, p, method="ar", **common).token_ids for p in accept_prompts]
    for coupling in ("gumbel", "rejection"):
        outs = [draftwise.generate(target, p, draft=draft, method="sd", gamma=4, coupling=coupling, **common)
                for p in accept_prompts]
        drafted = sum(o.stats["drafted"] for o in outs)
        accepted = sum(o.stats["accepted"] for o in outs)
        steps = sum(o.stats["steps"] for o in outs)
        tokens = sum(len(o.token_ids) for o in outs)
        out["couplings"][coupling] = {
            "drafted": drafted, "accepted": accepted, "acceptance_rate": round(accepted / max(drafted, 1), 4),
            "target_calls": steps, "mean_accepted_length": round(tokens / max(steps, 1), 3),
            "equal_to_ar": f"{sum(o.token_ids == a for o, a in zip(outs, ar))}/{len(outs)}"}
        print(coupling, out["couplings"][coupling], flush=True)
        if args.json:
            write_json(out, args.json)
    if not args.skip_load:
        short = min(scripts.encoded_prompts(target, 40), key=len)
        out["load_prompt_tokens"] = len(short)
        levels = [int(c) for c in args.concurrency.split(",")]
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            for label in args.methods.split(","):
                method, needs_draft, options = LOAD_METHODS[label]
                plan = make_plan(target=target, prompt=short, draft=draft if needs_draft else None,
                                 method=method, max_new_tokens=args.max_new_tokens, temperature=temperature, top_k=0,
                                 top_p=1.0, seed=args.seed, gamma=4, stop=None, ignore_eos=True,
                                 method_options=dict(options))
                t0 = time.perf_counter()
                answers = {c: closed_loop(plan, c, args.requests) for c in levels}
                reference = answers[levels[0]][0]
                row = {"method": label, "temperature": temperature,
                       "identical": {str(c): sum(a == reference for a in answers[c]) for c in levels},
                       "of": args.requests, "seconds": round(time.perf_counter() - t0, 1)}
                row["all"] = f"{sum(row['identical'].values())}/{args.requests * len(levels)}"
                print(row, flush=True)
                out["load"].append(row)
                if args.json:
                    write_json(out, args.json)

    out["seconds"] = round(time.perf_counter() - started, 1)
    scripts.finish(out, args.json)


if __name__ == "__main__":
    main()
