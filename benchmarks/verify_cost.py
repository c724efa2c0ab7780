"""The verification cost curve of each weight format: one target forward of k tokens per row against one token.

For every format, batch size and k = 1..8, rows that already hold `--context` tokens feed k more
(the verify feed of a step), then roll back, every k interleaved round by round (`bench.timing`); the median time
of `--repeats` such forwards is
reported, with its ratio to k = 1 at the same batch. This is the number speculation must beat: a
step that commits m tokens per row pays cost(k) / cost(1) of a plain decoding step.

    python benchmarks/verify_cost.py --formats gguf,bf16,fp32,int8 --batch-sizes 1,16,32 \
        --json benchmarks/results/verify-cost.json

With `--draft-of TARGET`, `--target` is loaded as TARGET's draft, as `sd` runs it (load_draft: its format follows
the target's, and a registry draft gets its restricted output vocabulary), and TARGET's own one-token forward is
timed in the same rounds: `draft_vs_target` is what one drafted token costs in target tokens.

    python benchmarks/verify_cost.py --target qwen2.5-coder-0.5b --draft-of qwen2.5-coder-1.5b --formats gguf \
        --batch-sizes 1 --json benchmarks/results/verify-cost-draft.json
"""

from __future__ import annotations


import draftwise
from draftwise.bench import scripts
from draftwise.bench.harness import machine_description
from draftwise.bench.verify import time_forwards
from draftwise.heads.loading import load_draft


def curve(target, batch: int, context: int, max_k: int, repeats: int, of=None) -> dict[str, float]:
    """cost(k) for k = 1..max_k (and `of`'s one-token forward, key "target k=1", in the same rounds)."""
    cases = {str(k): (target, k) for k in range(1, max_k + 1)}
    if of is not None:
        cases["target k=1"] = (of, 1)
    times = time_forwards(cases, batch=batch, context=context, repeats=repeats)
    row = {k: {"ms": 1000 * t, "vs_k1": t / times["1"]} for k, t in times.items() if k != "target k=1"}
    if of is not None:
        row["target_k1_ms"] = 1000 * times["target k=1"]
        row["draft_vs_target"] = times["1"] / times["target k=1"]
    return row


def main() -> None:
    parser = scripts.parser(__doc__)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--formats", default="gguf,bf16,fp32,int8")
    parser.add_argument("--batch-sizes", default="1,16,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--draft-of", default=None, help="load --target as this target's draft, and time the "
                        "target's one-token forward beside it")
    args = scripts.parse(parser)
    out = {"config": vars(args), "formats": {}}
    for fmt in args.formats.split(","):
        of = draftwise.load_model(args.draft_of, dtype=fmt) if args.draft_of else None
        target = load_draft(args.target, of) if of is not None else draftwise.load_model(args.target, dtype=fmt)
        out["machine"] = machine_description(target.device)
        by_batch = {}
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            by_batch[str(batch)] = curve(target, batch, args.context, args.max_k, args.repeats, of=of)
            row = by_batch[str(batch)]
            print(f"{fmt:6s} batch {batch:3d}: " + "  ".join(
                f"k={k} {v['ms']:.1f} ms ({v['vs_k1']:.2f}x)" for k, v in row.items() if isinstance(v, dict)) + (
                f"  | {args.draft_of} k=1 {row['target_k1_ms']:.1f} ms: a drafted token costs "
                f"{row['draft_vs_target']:.2f} of a target token" if of is not None else ""), flush=True)
        out["formats"][fmt] = {"weights": target.weights, "batches": by_batch}
        del target, of
    scripts.finish(out, args.json)


if __name__ == "__main__":
    main()
