"""Is a reduced output vocabulary worth it for an independent draft? (issue 13, item 3)

One draft model decodes with its full LM head and with the head cut to the N most frequent tokens of the
training data (what `output-vocab.json` does: probability zero elsewhere, so `sd` stays exact). The model
file stays a full-vocabulary Hugging Face model either way, so transformers' assisted generation can still
use it; the cut is applied by draftwise at load time. Measured in one run, on Spec-Bench evaluation prompts:

- the draft's cost per drafted token: a cached one-token forward, every variant interleaved, median;
- `sd` against `ar`: speed ratio (median over prompts of ar time / sd time per token), mean accepted
  length and step-1 acceptance, every variant interleaved prompt by prompt after a warm-up;
- coverage: the fraction of the target's greedy answer tokens inside each cut vocabulary.

    .venv/bin/python benchmarks/output_vocab.py --draft smollm2-135m-draft --data out/train-data \\
        --json benchmarks/results/output-vocab.json
"""

from __future__ import annotations

import dataclasses
import time

import torch

import draftwise
from draftwise.bench import scripts
from draftwise.bench.verify import time_forwards
from draftwise.bench.datasets import load_prompts
from draftwise.bench.harness import machine_description
from draftwise.heads.loading import load_draft
from draftwise.models.loading import load_model
from draftwise.training.eagle3_train import frequency_vocabulary
from draftwise.training.shards import read_shards


def vocabularies(data: str, sizes: list[int], target) -> dict[int, torch.Tensor]:
    sequences = [(s.tokens.tolist(), s.answer_start) for s in read_shards(data, features=False)]
    config = target.model.config
    always = {int(t) for t in (config.bos_token_id, config.eos_token_id) if isinstance(t, int)}
    return {n: frequency_vocabulary(sequences, n, always, target.vocab_size) for n in sizes}


@torch.inference_mode()
def draft_step_ms(variants: dict) -> dict[str, float]:
    """Median ms of a one-token forward (one drafted token) per variant on a row holding 64 tokens, interleaved."""
    seconds = time_forwards({name: (loaded, 1) for name, loaded in variants.items()}, context=64, repeats=200,
                            warmup=5)
    return {name: 1000 * t for name, t in seconds.items()}


def main() -> int:
    p = scripts.parser(__doc__, json=True)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="smollm2-135m-draft", help="one draft, or several (comma-separated)")
    p.add_argument("--data", required=True, help="shard directory the vocabularies are counted on (training data)")
    p.add_argument("--sizes", default="4096,8192,16384")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--dtype", default="fp32")
    args = scripts.parse(p)
    sizes = [int(s) for s in args.sizes.split(",")]
    target = load_model(args.target, dtype=args.dtype)
    cuts = vocabularies(args.data, sizes, target)
    drafts = [d for d in args.draft.split(",") if d]
    variants = {}
    for draft in drafts:
        base = load_draft(draft, target, dtype=args.dtype)
        prefix = "" if len(drafts) == 1 else f"{draft}:"
        variants[f"{prefix}full"] = dataclasses.replace(base, output_ids=None)
        variants |= {f"{prefix}cut{n}": dataclasses.replace(base, output_ids=ids) for n, ids in cuts.items()}
    results: dict = {"config": vars(args), "machine": machine_description(target.device),
                     "draft_step_ms": draft_step_ms(variants)}
    print("draft ms per drafted token:", {k: round(v, 3) for k, v in results["draft_step_ms"].items()})
    prompts = [[{"role": "user", "content": q.text}] for q in load_prompts(num_prompts=args.num_prompts)]
    answer_tokens: list[int] = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        kw = dict(temperature=temperature, max_new_tokens=args.max_new_tokens, seed=0)
        draftwise.generate(target, messages=prompts[0], method="ar", **kw)  # warm-up
        for loaded in variants.values():
            draftwise.generate(target, messages=prompts[0], method="sd", draft=loaded, gamma=args.gamma, **kw)
        per_token: dict[str, list[float]] = {name: [] for name in ["ar", *variants]}
        stats: dict[str, list[dict]] = {name: [] for name in variants}
        identical = {name: 0 for name in variants}
        for prompt in prompts:
            start = time.perf_counter()
            ar = draftwise.generate(target, messages=prompt, method="ar", **kw)
            per_token["ar"].append((time.perf_counter() - start) / max(1, len(ar.token_ids)))
            if temperature == 0:
                answer_tokens += ar.token_ids
            for name, loaded in variants.items():
                start = time.perf_counter()
                out = draftwise.generate(target, messages=prompt, method="sd", draft=loaded, gamma=args.gamma, **kw)
                per_token[name].append((time.perf_counter() - start) / max(1, len(out.token_ids)))
                stats[name].append(out.stats)
                identical[name] += out.token_ids == ar.token_ids
        rows = {}
        for name in variants:
            rows[name] = {"speedup_vs_ar_median": scripts.speedups(per_token["ar"], per_token[name]),
                          **scripts.speculation(stats[name])}
            if temperature == 0:
                rows[name]["identical_to_ar"] = f"{identical[name]}/{len(prompts)}"
        results[f"t{temperature:g}"] = rows
        for name, row in rows.items():
            print(f"T={temperature:g} {name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in row.items()))
    if answer_tokens:
        answers = torch.tensor(answer_tokens)
        results["coverage_of_target_answers"] = {
            f"cut{n}": float(torch.isin(answers, ids).float().mean()) for n, ids in cuts.items()}
        print("coverage:", results["coverage_of_target_answers"])
    scripts.finish(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
