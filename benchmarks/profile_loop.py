"""Where decoding time goes: model forwards against the loop around them, at batch 1 and batched.

Runs each method through `draftwise.generate` on Spec-Bench evaluation prompts (chat-formatted, as
`draftwise bench` feeds them) and times every model computation: the runners' `forward_rows` and
`forward_states` (target, draft, companion and head bodies) and a feature head's own input fusion
and LM head. Loop overhead = 1 - model time / wall time: drafting bookkeeping, sampling, acceptance,
the rewind and the Python between them. Prefill is included in both (it is a forward). The cases (method, batch
size) run in turn, round by round (`draftwise.bench.timing`); each reports the median overhead of its rounds.

    python benchmarks/profile_loop.py --methods ar,sd,suffix --batch-sizes 1,16 --num-prompts 16 \
        --max-new-tokens 128 --repeats 3 --json benchmarks/results/loop-overhead.json
"""

from __future__ import annotations

import statistics


import draftwise
from draftwise.bench import scripts
from draftwise.bench.harness import BenchConfig, _load_bench_draft, machine_description, resolve_drafts
from draftwise.bench.timing import CallTimer, interleaved
from draftwise.heads.eagle import DraftHead
from draftwise.models import runner as runner_module


def main() -> None:
    parser = scripts.parser(__doc__)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--methods", default="ar,sd,suffix")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; every case runs once a round, in turn")
    args = scripts.parse(parser)

    config = resolve_drafts(BenchConfig(target=args.target, draft=args.draft, dtype=args.dtype))
    target = draftwise.load_model(config.target, dtype=args.dtype)
    draft = _load_bench_draft(config.draft, target, config) if config.draft else None
    prompts = scripts.encoded_prompts(target, args.num_prompts)

    timer = CallTimer()
    for name in ("forward_rows", "forward_states"):
        timer.wrap(runner_module.ModelRunner, name)
    for name in ("step_input", "logits"):
        for head_type in {type(draft), DraftHead} if isinstance(draft, DraftHead) else ():
            if name in vars(head_type):
                timer.wrap(head_type, name)

    def options(method: str, max_new_tokens: int) -> dict:
        return dict(method=method, temperature=0, max_new_tokens=max_new_tokens, gamma=args.gamma,
                    draft=draft if draftwise.METHODS[method].needs_draft else None, ignore_eos=True)

    def case(method: str, batch: int):
        kwargs = options(method, args.max_new_tokens)

        def run() -> None:
            timer.spent = 0.0
            if batch == 1:
                tokens = sum(draftwise.generate(target, prompt, **kwargs).stats["new_tokens"] for prompt in prompts)
            else:
                outs = draftwise.generate(target, prompts, max_batch_size=batch, **kwargs)
                tokens = sum(o.stats["new_tokens"] for o in outs)
            model_s.setdefault((method, batch), []).append(timer.spent)
            counted.setdefault((method, batch), []).append(tokens)
        return run

    model_s: dict[tuple[str, int], list[float]] = {}
    counted: dict[tuple[str, int], list[int]] = {}
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cases = {(m, b): case(m, b) for m in args.methods.split(",") for b in batches}
    for method in args.methods.split(","):  # short warm-up calls (the full cases' first round is timed)
        draftwise.generate(target, prompts[0], **options(method, 8))
    walls = interleaved(cases, rounds=args.repeats, warmup=0)
    results = {}
    for (method, batch), wall in walls.items():
        runs = [{"wall_s": w, "model_s": m, "loop_overhead": 1 - m / w, "tokens": t}
                for w, m, t in zip(wall, model_s[(method, batch)], counted[(method, batch)])]
        overhead = statistics.median(r["loop_overhead"] for r in runs)
        speed = statistics.median(r["tokens"] / r["wall_s"] for r in runs)
        results.setdefault(method, {})[str(batch)] = {"loop_overhead": overhead, "tokens_per_s": speed,
                                                      "runs": runs}
        print(f"{method:12s} batch {batch:3d}: {speed:7.1f} tok/s, loop overhead {100 * overhead:.1f}% (median of "
              f"{len(runs)}: " + ", ".join(f"{100 * r['loop_overhead']:.1f}" for r in runs) + ")", flush=True)
    out = {"machine": machine_description(target.device) | {"weights": target.weights},
           "config": vars(args), "draft": str(config.draft), "results": results}
    scripts.finish(out, args.json)


if __name__ == "__main__":
    main()
