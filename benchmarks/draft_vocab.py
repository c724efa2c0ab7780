"""The 1.5B's draft vocabulary: the N tokens most frequent in text the target writes (FR-Spec's choice).

Counts come from the assistant turns of ShareGPT (the `sharegpt` extra; HumanEval and the Spec-Bench evaluation
split kept out, as the EAGLE data recipe does) and the target's own answers in data/answers/qwen2.5-coder-1.5b, the
latter weighted up (they are the target's own distribution). The chat template's special tokens are always in.
Coverage is reported on the target's answers that were held out of the counts (every 4th one). The ids are written
with `write_output_vocabulary` (sorted, atomically), for the 0.5B draft's LM head and the EAGLE-3 head:

    .venv/bin/python benchmarks/draft_vocab.py --size 32768 \\
        --out draftwise/weights/vocab/qwen2.5-coder-1.5b.json
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import torch

from draftwise.bench import scripts
from draftwise.models.loading import write_output_vocabulary
from draftwise.training.answers import read_answers


def main() -> None:
    parser = scripts.parser(__doc__, threads=None, json=None)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--answers", default="data/answers/qwen2.5-coder-1.5b")
    parser.add_argument("--size", type=int, default=32768)
    parser.add_argument("--answer-weight", type=int, default=20, help="a target answer token counts this many times")
    parser.add_argument("--out", required=True)
    args = scripts.parse(parser)
    import draftwise
    from draftwise.training.sharegpt import evaluation_exclusion, load_conversations, ordered

    started = time.perf_counter()
    tokenizer = draftwise.load_model(args.target).tokenizer
    counts: collections.Counter[int] = collections.Counter()
    code, rest, excluded = ordered(load_conversations(), evaluation_exclusion())
    texts = [text for c in code + rest for role, text in c.messages if role == "assistant"]
    for i in range(0, len(texts), 512):
        for ids in tokenizer(texts[i: i + 512], add_special_tokens=False)["input_ids"]:
            counts.update(ids)
    sharegpt_tokens = sum(counts.values())
    answers = list(read_answers(args.answers))
    held_out = answers[3::4]
    for a in answers:
        if a not in held_out:
            counts.update({t: args.answer_weight for t in a.answer_ids})
    always = set(tokenizer.all_special_ids) | {i for i in tokenizer.convert_tokens_to_ids(
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", "ĊĊ"]) if isinstance(i, int) and i >= 0}
    chosen = set(always)
    for token, _ in counts.most_common():
        if len(chosen) >= args.size:
            break
        chosen.add(token)
    ids = torch.tensor(sorted(chosen))
    held = [t for a in held_out for t in a.answer_ids]
    coverage = sum(t in chosen for t in held) / max(len(held), 1)
    sharegpt_coverage = sum(c for t, c in counts.items() if t in chosen) / max(sum(counts.values()), 1)
    path = write_output_vocabulary(
        Path(args.out).parent, ids, size=len(ids), target=args.target,
        sources={"sharegpt_assistant_turns": len(texts), "sharegpt_tokens": sharegpt_tokens,
                 "excluded_conversations": excluded, "target_answers": len(answers) - len(held_out),
                 "answer_weight": args.answer_weight},
        held_out_answer_tokens=len(held), held_out_answer_coverage=coverage,
        weighted_count_coverage=sharegpt_coverage, seconds=time.perf_counter() - started)
    if path != Path(args.out):
        path.replace(args.out)
    print(f"{len(ids)} ids -> {args.out}; held-out target answer coverage {coverage:.4f} ({len(held)} tokens), "
          f"weighted count coverage {sharegpt_coverage:.4f}")


if __name__ == "__main__":
    main()
