"""What the batch-invariant forward costs, and what it buys: each method at each batch size with draftwise's
invariant kernels (attention, and the float product in float formats) and with PyTorch's (SDPA, oneDNN), on one
loaded model, the two interleaved repeat by repeat after a warm-up; and whether each run's greedy tokens equal
`ar`'s at batch 1.

    python benchmarks/invariance_cost.py --target smollm2-135m --methods ar,sd --batch-sizes 1,16 \
        --num-prompts 16 --max-new-tokens 64 --json benchmarks/results/invariance-cost.json
"""

from __future__ import annotations

import statistics
import time


import draftwise
from draftwise.bench import scripts
from draftwise.bench.harness import machine_description, plan_drafts
from draftwise.models.linear import FloatLinear
from draftwise.models.runner import fast_model


class Switch:
    """Turns the invariant kernels of a loaded model's fast forward on or off in place."""

    def __init__(self, model) -> None:
        self.fast = fast_model(model)
        if self.fast is None:
            raise SystemExit("the target does not run on the fast forward: nothing to switch")
        self.attend = self.fast._attend
        self.floats = [p for p in _linears(self.fast) if isinstance(p, FloatLinear)]
        self.products = [p._invariant for p in self.floats]

    def __call__(self, on: bool) -> None:
        self.fast._attend = self.attend if on else None
        for linear, product in zip(self.floats, self.products):
            linear._invariant = product if on else None


def _linears(fast):
    for layer in fast.layers:
        yield from (layer.qkv, layer.o, layer.gate_up, layer.down)
    yield fast.head


def main() -> None:
    parser = scripts.parser(__doc__)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--methods", default="ar,sd")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = scripts.parse(parser)
    target = draftwise.load_model(args.target, dtype=args.dtype)
    if fast_model(target.model) is not None and fast_model(target.model)._attend is None:
        raise SystemExit("draftwise's kernel is not built here (or DRAFTWISE_INVARIANT=0): nothing to compare")
    switch = Switch(target.model)
    methods = args.methods.split(",")
    from draftwise.bench.harness import BenchConfig

    drafts = plan_drafts(BenchConfig(target=args.target, methods=tuple(methods), temperature=0.0))
    from draftwise.heads.loading import load_draft

    loaded = {spec: load_draft(spec, target) for spec in set(drafts.values()) if spec}
    prompts = scripts.encoded_prompts(target, args.num_prompts)
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    def run(method: str, batch: int) -> tuple[float, list[list[int]]]:
        """New tokens a second, end to end (prompts included), and the tokens."""
        draft = loaded.get(drafts[method])
        start = time.perf_counter()
        out = draftwise.generate(target, prompts, draft=draft, method=method, temperature=0,
                                 max_new_tokens=args.max_new_tokens, ignore_eos=True, max_batch_size=batch)
        elapsed = time.perf_counter() - start
        return sum(len(g.token_ids) for g in out) / elapsed, [g.token_ids for g in out]

    def prefill() -> float:
        """Prompt tokens a second: each prompt alone, one new token."""
        start = time.perf_counter()
        for ids in prompts:
            draftwise.generate(target, ids, method="ar", temperature=0, max_new_tokens=1, ignore_eos=True)
        return sum(len(ids) for ids in prompts) / (time.perf_counter() - start)

    for on in (True, False):  # warm-up
        switch(on)
        run(methods[0], sizes[0])
    speeds: dict[tuple, list[float]] = {}
    tokens: dict[tuple, list[list[int]]] = {}
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1} of {args.repeats}", flush=True)
        for method in methods:
            for batch in sizes:
                for on in (True, False):
                    switch(on)
                    rate, ids = run(method, batch)
                    speeds.setdefault((method, batch, on), []).append(rate)
                    tokens[(method, batch, on)] = ids
        for on in (True, False):
            switch(on)
            speeds.setdefault(("prefill", on), []).append(prefill())
    switch(True)
    results = {}
    for method in methods:
        for batch in sizes:
            row = {}
            for on in (True, False):
                reference = tokens[("ar", sizes[0], on)] if ("ar", sizes[0], on) in tokens else None
                same = None if reference is None else sum(
                    a == b for a, b in zip(tokens[(method, batch, on)], reference)) / len(reference)
                row["invariant" if on else "pytorch"] = {
                    "tokens_per_s": statistics.median(speeds[(method, batch, on)]),
                    "identical_to_ar_b1": same}
            row["cost"] = 1 - row["invariant"]["tokens_per_s"] / row["pytorch"]["tokens_per_s"]
            results[f"{method}/b{batch}"] = row
            print(f"{method:>14} b{batch:<3} invariant {row['invariant']['tokens_per_s']:8.1f} tok/s "
                  f"(identical {row['invariant']['identical_to_ar_b1']})   pytorch "
                  f"{row['pytorch']['tokens_per_s']:8.1f} tok/s (identical {row['pytorch']['identical_to_ar_b1']})"
                  f"   cost {100 * row['cost']:+.1f}%", flush=True)
    rates = {on: statistics.median(speeds[("prefill", on)]) for on in (True, False)}
    results["prefill"] = {"invariant": {"prompt_tokens_per_s": rates[True]},
                          "pytorch": {"prompt_tokens_per_s": rates[False]}, "cost": 1 - rates[True] / rates[False]}
    print(f"prefill (prompts alone): invariant {rates[True]:.0f} prompt tok/s, pytorch {rates[False]:.0f}, "
          f"cost {100 * results['prefill']['cost']:+.1f}%  (mean prompt {sum(map(len, prompts)) / len(prompts):.0f} "
          f"tokens)", flush=True)
    out = {"config": vars(args), "machine": machine_description(target.device), "drafts": drafts,
           "results": results}
    scripts.finish(out, args.json)


if __name__ == "__main__":
    main()
