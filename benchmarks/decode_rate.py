"""draftwise's decode rate on one raw prompt, the way `llama-speculative-simple` reports its own: greedy, the prompt's
text with no chat template, (new tokens - 1) / (time after the first token), the median of `--repeats` runs with the
methods interleaved. Run it on the prompt file given to `benchmarks/llama_bench.py --speculative` for a side-by-side.

    .venv/bin/python benchmarks/decode_rate.py --prompt-file PROMPT.txt --target qwen2.5-coder-1.5b \
        --draft qwen2.5-coder-0.5b --methods ar,sd/gamma=2,sd/gamma=3,sd/gamma=4,suffix \
        --json benchmarks/results/draftwise-decode-rate.json

Pause other work on the cores while it runs.
"""

from __future__ import annotations

import statistics
import time

import draftwise
from draftwise.bench import scripts
from draftwise.bench.labels import parse_label
from draftwise.methods import METHODS


def main() -> None:
    parser = scripts.parser(__doc__)
    parser.add_argument("--prompt-file", required=True)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--methods", default="ar,sd/gamma=2,sd/gamma=3,sd/gamma=4,suffix")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = scripts.parse(parser)
    text = open(args.prompt_file, encoding="utf-8").read()
    target = draftwise.load_model(args.target)
    ids = target.tokenizer(text)["input_ids"]
    runs = {}
    for label in args.methods.split(","):
        name, options = parse_label(label)
        runs[label] = {"method": name, **options, **({"draft": args.draft} if METHODS[name].needs_draft else {})}
    draftwise.generate(target, [ids], max_new_tokens=8, **next(iter(runs.values())))  # warm-up
    rates: dict[str, list[float]] = {label: [] for label in runs}
    accepted: dict[str, float] = {}
    for _ in range(args.repeats):
        for label, options in runs.items():
            start = time.perf_counter()
            out = draftwise.generate(target, [ids], max_new_tokens=args.max_new_tokens, ignore_eos=True, **options)[0]
            total = time.perf_counter() - start
            rates[label].append((len(out.token_ids) - 1) / (total - out.stats["time_to_first_token_s"]))
            accepted[label] = out.mean_accepted_length
    results = {label: {"decode_tokens_per_s": statistics.median(v), "runs": v, "mean_accepted_length": accepted[label]}
               for label, v in rates.items()}
    for label, row in results.items():
        print(f"{label:14s} {row['decode_tokens_per_s']:6.2f} tokens/s  mean accepted length "
              f"{row['mean_accepted_length']:.2f}", flush=True)
    scripts.finish({"config": vars(args), "prompt_tokens": len(ids), "results": results}, args.json)


if __name__ == "__main__":
    main()
