"""What keyed randomness costs a step: the accept phase of one verification (k drafted tokens per row, T=1) before
keying (the previous sampler, loaded from git: one torch.Generator per row, numbers taken in order) and after
(keyed rejection sampling; the Gumbel coupling's own-draw acceptance), and the draft's per-token sample, at
several batch sizes and vocabularies, interleaved repeat by repeat in one process.

    python benchmarks/keyed_cost.py --before 06ec951 --json benchmarks/results/keyed-cost.json
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import types

import torch

from draftwise.bench import scripts
from draftwise.bench.timing import interleaved


def old_sampler(commit: str) -> types.ModuleType:
    source = subprocess.run(["git", "show", f"{commit}:draftwise/engine/sampler.py"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("old_sampler")
    sys.modules["old_sampler"] = module  # dataclasses look their module up
    exec(compile(source, "old_sampler.py", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = scripts.parser(__doc__, threads=1)
    parser.add_argument("--before", default="06ec951", help="the commit whose sampler is 'before'")
    parser.add_argument("--vocabs", default="49152,151936")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    args = scripts.parse(parser)

    from draftwise.engine import sampler as new
    from draftwise.engine.keyed import Draws

    old = old_sampler(args.before)
    k = args.k
    results = []
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for rows in [int(b) for b in args.batch_sizes.split(",")]:
            g = torch.Generator().manual_seed(vocab + rows)
            target = torch.softmax(2.0 * torch.randn(rows, k + 1, vocab, generator=g), -1)
            draft = torch.softmax(2.0 * torch.randn(rows, k, vocab, generator=g), -1)
            tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).reshape(rows, k)
            counts = [k] * rows
            greedy = [False] * rows
            generators = [torch.Generator().manual_seed(i) for i in range(rows)]
            keyed_rs = Draws(range(rows), [100] * rows, [False] * rows, "cpu")
            keyed_gumbel = Draws(range(rows), [100] * rows, [True] * rows, "cpu")
            cases = {
                "accept: before (streams, rejection)": lambda: old.speculative_sample_rows(
                    tokens, draft, target[:, :k], target, counts, generators, greedy),
                "accept: keyed rejection": lambda: new.speculative_sample_rows(
                    tokens, draft, target[:, :k], target, counts, keyed_rs, greedy),
                "accept: keyed Gumbel (own draws)": lambda: new.accept_own_draws(
                    tokens, counts, target, keyed_gumbel, greedy),
                "draft sample: before (streams)": lambda: old.sample_rows(draft[:, 0], generators, [True] * rows,
                                                                          greedy),
                "draft sample: keyed rejection": lambda: new.sample_rows(draft[:, 0], keyed_rs, 0, greedy),
                "draft sample: keyed Gumbel": lambda: new.sample_rows(draft[:, 0], keyed_gumbel, 0, greedy),
            }
            for name, values in interleaved(cases, rounds=args.repeats, warmup=1).items():
                row = {"vocab": vocab, "rows": rows, "k": k, "case": name,
                       "median_ms": round(1000 * statistics.median(values), 3)}
                print(row, flush=True)
                results.append(row)
    scripts.finish({"command": "python benchmarks/keyed_cost.py " + " ".join(
        f"--{a.replace('_', '-')} {v}" for a, v in vars(args).items() if v is not None),
        "threads": args.threads, "results": results}, args.json)


if __name__ == "__main__":
    main()
