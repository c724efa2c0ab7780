"""The verification cost curve of each weight format: one target forward of k tokens per row against one token.

For every format, batch size and k = 1..8, rows that already hold `--context` tokens feed k more
(the verify feed of a step), then roll back, every k interleaved round by round (`bench.timing`); the median time
of `--repeats` such forwards is
reported, with its ratio to k = 1 at the same batch. This is the number speculation must beat: a
step that commits m tokens per row pays cost(k) / cost(1) of a plain decoding step.

    python benchmarks/verify_cost.py --formats gguf,bf16,fp32,int8 --batch-sizes 1,16,32 \
        --json benchmarks/results/verify-cost.json
"""

from __future__ import annotations

import argparse

import torch

import draftwise
from draftwise.bench.harness import machine_description
from draftwise.bench.timing import interleaved, medians
from draftwise.atomic import write_json
from draftwise.models.runner import ModelRunner


def curve(target, batch: int, context: int, max_k: int, repeats: int) -> dict[str, float]:
    runner = ModelRunner(target.model, vocab_size=target.vocab_size, rows=batch)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (batch, context), generator=generator)
    runner.forward_rows(prompt, [context] * batch, logits_at=torch.zeros(batch, 1, dtype=torch.long), prompt=True)
    feeds = {str(k): torch.randint(100, 40000, (batch, k), generator=generator) for k in range(1, max_k + 1)}

    def rollback(name: str) -> None:
        for row in range(batch):
            runner.trim_row(row, context)

    times = medians(interleaved({k: (lambda f=feed: runner.forward_rows(f, [f.shape[1]] * batch))
                                 for k, feed in feeds.items()}, rounds=repeats, warmup=2, after=rollback))
    return {k: {"ms": 1000 * t, "vs_k1": t / times["1"]} for k, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--formats", default="gguf,bf16,fp32,int8")
    parser.add_argument("--batch-sizes", default="1,16,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {"config": vars(args), "formats": {}}
    for fmt in args.formats.split(","):
        target = draftwise.load_model(args.target, dtype=fmt)
        out["machine"] = machine_description(target.device)
        by_batch = {}
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            by_batch[str(batch)] = curve(target, batch, args.context, args.max_k, args.repeats)
            row = by_batch[str(batch)]
            print(f"{fmt:6s} batch {batch:3d}: " + "  ".join(
                f"k={k} {v['ms']:.1f} ms ({v['vs_k1']:.2f}x)" for k, v in row.items()), flush=True)
        out["formats"][fmt] = {"weights": target.weights, "batches": by_batch}
        del target
    if args.json:
        write_json(out, args.json)


if __name__ == "__main__":
    main()
