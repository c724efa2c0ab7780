"""What one drafted token of an EAGLE head costs, in target tokens.

The head drafts through `EagleRowsDrafter`'s own path: its decoder layer's KV cache holds `--context` positions, and
one drafting step is the embedding of the last drafted token, the layer's forward of one position and the draft
vocabulary's logits. The target's one-token forward on rows holding `--context` tokens is timed in the same rounds
(`bench.timing.interleaved`), so `head_vs_target` is a ratio measured in one run. `--packing` compares the ways the
head's products can run (`float`: fp32 weights through oneDNN; `q8_0`: the head's weights in Q8_0 blocks and its
LM-head rows the target's own blocks, through the block kernel).

    python benchmarks/head_cost.py --target qwen2.5-coder-1.5b --head out/eagle-head/head \
        --packing float,q8_0 --json benchmarks/results/head-cost.json
"""

from __future__ import annotations

import sys

import torch

import draftwise
from draftwise.bench import scripts
from draftwise.bench.harness import machine_description
from draftwise.bench.timing import interleaved, medians
from draftwise.bench.verify import filled_runner
from draftwise.drafters.eagle import EagleRowsDrafter
from draftwise.errors import DraftwiseError
from draftwise.heads.export import load_head


def drafting_step(head, target, context: int, generator: torch.Generator):
    """A callable running one drafting step of `head` (as `EagleRowsDrafter.propose` advances) on a row whose head
    cache holds `context` positions, and the rollback that puts the cache back."""
    drafter = EagleRowsDrafter(head, target.vocab_size, torch.device("cpu"))
    drafter.admit(0, [0])
    with torch.inference_mode():
        feats = torch.randn(1, context, head.feature_size, generator=generator).to(head.fc.weight.dtype)
        tokens = torch.randint(100, 30000, (1, context), generator=generator)
        state = drafter.runner.forward_states(head.step_input(feats, tokens), [context])[:, -1]
    token = torch.randint(100, 30000, (1,), generator=generator)
    step = torch.inference_mode()(lambda: drafter.draft_step(state, token))
    return step, lambda: drafter.runner.trim_row(0, context)


def main() -> int:
    parser = scripts.parser(__doc__)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--head", required=True, help="an EAGLE-3 head directory or registry name")
    parser.add_argument("--dtype", default="auto", help="the target's format (default: auto, as it serves)")
    parser.add_argument("--packing", default="float,q8_0", help="comma-separated: float, q8_0")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=21)
    args = scripts.parse(parser)
    packings = [p for p in args.packing.split(",") if p]
    if not packings or set(packings) - {"float", "q8_0"}:
        raise DraftwiseError(f"--packing takes float and q8_0, got {args.packing!r}")
    target = draftwise.load_model(args.target, dtype=args.dtype)
    generator = torch.Generator().manual_seed(0)
    runner = filled_runner(target, 1, args.context, generator)
    feed = torch.randint(100, 30000, (1, 1), generator=generator)
    cases = {"target k=1": lambda: runner.forward_rows(feed, [1])}
    rollbacks = {"target k=1": lambda: runner.trim_row(0, args.context)}
    heads = {}
    for packing in packings:
        head = load_head(args.head).attach(target.model)
        head.eval()
        head.pack_for_inference(blocks=packing == "q8_0")
        heads[packing] = head
        cases[f"head {packing}"], rollbacks[f"head {packing}"] = drafting_step(head, target, args.context, generator)
    times = medians(interleaved(cases, rounds=args.repeats, warmup=3, after=lambda name: rollbacks[name]()))
    one = times["target k=1"]
    out = {"config": vars(args), "machine": machine_description(target.device), "target_k1_ms": 1000 * one,
           "heads": {}}
    print(f"{args.target} ({args.dtype}) one token at context {args.context}: {1000 * one:.2f} ms")
    for packing, head in heads.items():
        t = times[f"head {packing}"]
        out["heads"][packing] = {"ms": 1000 * t, "head_vs_target": t / one, "weight_bytes": head.inference_bytes()}
        print(f"head {packing:6s}: {1000 * t:.2f} ms a drafted token = {t / one:.3f} of a target token "
              f"({head.inference_bytes() / 2**20:.1f} MiB of weights read)")
    scripts.finish(out, args.json)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DraftwiseError as e:
        sys.exit(f"head_cost: {e}")
