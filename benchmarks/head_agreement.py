"""Teacher-forced agreement of EAGLE heads with the target, on the prompts the benchmarks decode.

A head's training report gives its top-1 agreement on held-out answers of its own training mix. This script
measures the same quantity (steps 1..5 of the training-time test, `eagle3_train.evaluate`) on the target's greedy
answers to Spec-Bench prompts, the evaluation split and the training split, so the two can be compared: a head
that agrees far less here than on its held-out answers is limited by its data mix, not by its size or by the
decoding path (the engine's step-1 acceptance at T=0 tracks this number).

    .venv/bin/python benchmarks/head_agreement.py --heads out/head-pilot/head,smollm2-135m-eagle \
        --json benchmarks/results/head-agreement.json
"""

from __future__ import annotations

import tempfile


import draftwise
from draftwise.bench import scripts
from draftwise.bench.datasets import load_prompts
from draftwise.bench.harness import machine_description
from draftwise.atomic import write_json
from draftwise.heads.loading import load_draft
from draftwise.models.loading import load_model
from draftwise.training.answers import Answer, features_from_answers
from draftwise.training.eagle3_train import Eagle3TrainConfig, evaluate, load_examples
from draftwise.training.shards import encode_chat


def main() -> int:
    p = scripts.parser(__doc__, json=True)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--heads", required=True, help="comma-separated head directories or registry names")
    p.add_argument("--splits", default="eval,train")
    p.add_argument("--num-prompts", type=int, default=24, help="per split, spread over its categories")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto", help="the target's format for the answers and features")
    p.add_argument("--max-len", type=int, default=2048,
                   help="positions per answer read (prompt included): Spec-Bench's RAG prompts run past 640")
    args = scripts.parse(p)
    target = load_model(args.target, dtype=args.dtype)
    reference = load_model(args.target, dtype="fp32")  # the LM-head rows, as training reads them
    heads = {name: load_draft(name, reference) for name in args.heads.split(",") if name}
    results: dict[str, dict] = {}
    for split in args.splits.split(","):
        prompts = load_prompts(split=split)
        prompts = prompts[:: max(1, len(prompts) // args.num_prompts)][: args.num_prompts]
        answers = []
        for i, q in enumerate(prompts):
            ids = encode_chat(target.tokenizer, q.text)
            out = draftwise.generate(target, ids, method="ar", temperature=0, max_new_tokens=args.max_new_tokens)
            answers.append(Answer(f"{split}-{i}", "spec-bench", q.category, "greedy", ids, list(out.token_ids)))
        with tempfile.TemporaryDirectory() as shards:
            features_from_answers(target, answers, shards)
            for name, head in heads.items():
                examples = load_examples(shards, tuple(head.config.feature_layers), args.max_len)
                rows = reference.model.get_output_embeddings().weight.detach().float()[head.vocab_ids]
                config = Eagle3TrainConfig(data=shards, out="")
                stats = evaluate(head, rows, examples, config)
                results.setdefault(name, {})[split] = {k: round(v, 4) for k, v in stats.items() if k.startswith("acc")}
                print(f"{split:5s} {name}: {results[name][split]}", flush=True)
                # per category, with the mean prompt length: which kinds of prompt the head fails on
                by_category = {}
                for category in sorted({e.category for e in examples}):
                    group = [e for e in examples if e.category == category]
                    acc = evaluate(head, rows, group, config)
                    by_category[category] = {"answers": len(group), "acc0": round(acc["acc0"], 4),
                                             "mean_prompt_tokens": round(sum(e.answer_start for e in group)
                                                                         / len(group), 1)}
                results[name][f"{split}_by_category"] = by_category
                print("      " + ", ".join(f"{c} {v['acc0']:.3f} ({v['answers']}, {v['mean_prompt_tokens']:.0f} tok)"
                                           for c, v in by_category.items()), flush=True)
    write_json({"config": vars(args), "machine": machine_description(target.model.device), "agreement": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
