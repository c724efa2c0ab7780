"""The EAGLE-3 head's training features for the Qwen2.5-Coder 1.5B (issue 52), from prefill passes only
(`benchmarks/eagle_data.py`, run by benchmarks/eagle_data_recipe.sh).

Stages, each skipping the (uid, tag) already in a shard of --out:
  a. the target's own answers (every chunk in --answers: the 66 greedy ones, and any written later);
  b. ShareGPT's code-bearing conversations, one sequence per assistant turn (training/sharegpt.py);
  c. the rest of ShareGPT;
b and c stop once the shards hold --budget answer tokens (the positions a head trains on; the prompt's
positions are fed and stored too, as context). Stage a always runs whole.

Every shard is one chunk of about --chunk-tokens fed tokens, written atomically: a kill loses at most the chunk in
flight (SIGTERM removes its temporary file; after SIGKILL the next run does). Progress lines (JSON) go to
OUT/progress.jsonl: answer tokens in the shards, fed tokens, and this run's fed tokens a second.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

from draftwise.atomic import write_json
from draftwise.errors import DraftwiseError
from draftwise.training import sharegpt
from draftwise.training.answers import Answer, chunk_paths, features_from_answers, read_answers
from draftwise.training.shards import clean_temporaries, shard_paths, shard_totals
from draftwise.training.threads import Threads


def spec_bench_eval_ids() -> frozenset[int]:
    from draftwise.bench.datasets import load_prompts

    return frozenset(p.question_id for p in load_prompts("spec-bench", split="eval"))


def target_answers(directory: Path, tokenizer, exclusion: sharegpt.Exclusion) -> tuple[list[Answer], int]:
    """The target's answers in `directory`, less any to an evaluation prompt (a belt to the answer recipe's braces:
    it asked Spec-Bench's train split only)."""
    if not chunk_paths(directory):
        return [], 0
    eval_ids = spec_bench_eval_ids()
    kept, dropped = [], 0
    for a in read_answers(directory):
        if a.source == "spec-bench" and a.uid.rsplit("-", 1)[-1].isdigit() and int(a.uid.rsplit("-", 1)[-1]) in eval_ids:
            dropped += 1
        elif a.source in ("human-eval", "humaneval") or exclusion.matches(tokenizer.decode(a.prompt_ids)):
            dropped += 1
        else:
            kept.append(a)
    return kept, dropped


def run(args: argparse.Namespace) -> int:
    """The stages above, on the script's parsed arguments; 130 when stopped by a signal."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress_path = out / "progress.jsonl"

    def log(record: dict) -> None:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **record}
        with open(progress_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)

    def interrupted(signum, frame):  # `kill`: the shard being written is removed whole, like Ctrl-C
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)

    import torch

    from draftwise.models import qkernel
    from draftwise.models.loading import load_model

    started = time.time()
    conversations = sharegpt.load_conversations()
    exclusion = sharegpt.evaluation_exclusion()
    code, rest, excluded = sharegpt.ordered(conversations, exclusion)
    target = load_model(args.target, dtype=args.dtype)
    tokenizer = target.tokenizer
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(end_of_turn, int) or end_of_turn < 0:
        raise DraftwiseError(f"{args.target}: no <|im_end|> token (this recipe is for a Qwen2.5 chat target)")
    setup = {"conversations": len(conversations), "code_conversations": len(code), "other_conversations": len(rest),
             "excluded_conversations": excluded, "setup_seconds": round(time.time() - started, 1)}

    def turns(group: list[sharegpt.Conversation], category: str, done: set[tuple[str, str]]):
        for c in group:
            skip = {u for u in sharegpt.turn_uids(c) if (u, sharegpt.TAG) in done}
            if len(skip) < len(sharegpt.turn_uids(c)):
                yield from sharegpt.answers(c, tokenizer, max_prompt=args.max_prompt, max_len=args.max_len,
                                            category=category, end_of_turn=end_of_turn, skip=skip)

    if args.count:
        counts = dict(setup, max_prompt=args.max_prompt, max_len=args.max_len)
        for name, group in (("code", code), ("other", rest)):
            n = answer_tokens = fed = cut = 0
            for a in turns(group, name, set()):
                n += 1
                answer_tokens += len(a.answer_ids)
                fed += len(a.prompt_ids) + len(a.answer_ids)
                cut += a.finish_reason == "length"
            counts[name] = {"turns": n, "answer_tokens": answer_tokens, "tokens": fed, "answers_cut": cut}
            print(name, counts[name], flush=True)
        counts["seconds"] = round(time.time() - started, 1)
        write_json(counts, out / "sharegpt-counts.json")
        print(json.dumps(counts))
        return 0

    clean_temporaries(out)
    done, answer_done, tokens_done = shard_totals(out)
    for other in filter(None, (d.strip() for d in args.skip_shards.split(","))):
        if Path(other).is_dir():  # features made elsewhere (the own-answers run writes them as it decodes)
            done |= shard_totals(Path(other))[0]
    log({"event": "start", **setup, "shards": len(shard_paths(out)), "answer_tokens": answer_done,
         "tokens": tokens_done, "budget": args.budget, "target": args.target, "dtype": args.dtype,
         "threads": torch.get_num_threads(), "code": str(Path(sharegpt.__file__).parents[1]),
         "kernel": qkernel.problem() or "draftwise's"})
    run_started, run_tokens = time.perf_counter(), 0
    threads = Threads(torch.get_num_threads())

    def write(chunk: list[Answer], stage: str) -> None:
        nonlocal answer_done, tokens_done, run_tokens
        chunk = sorted(chunk, key=lambda a: len(a.prompt_ids) + len(a.answer_ids))  # batches of like lengths
        t0 = time.perf_counter()
        features_from_answers(target, chunk, out, shard_size=len(chunk), batch_tokens=args.batch_tokens,
                              before_forward=threads)
        seconds = time.perf_counter() - t0
        fed = sum(len(a.prompt_ids) + len(a.answer_ids) for a in chunk)
        answer_done += sum(len(a.answer_ids) for a in chunk)
        tokens_done += fed
        run_tokens += fed
        for a in chunk:
            done.add((a.uid, a.tag))
        log({"stage": stage, "shards": len(shard_paths(out)), "sequences": len(chunk), "answer_tokens": answer_done,
             "tokens": tokens_done, "chunk_tokens": fed, "chunk_seconds": round(seconds, 1),
             "chunk_tokens_per_s": round(fed / max(seconds, 1e-9), 1),
             "run_tokens_per_s": round(run_tokens / max(time.perf_counter() - run_started, 1e-9), 1),
             "threads": threads.count})

    def run(stage: str, items, budget: int | None) -> bool:
        """Feature shards for `items` (Answers) in chunks; False once the budget is reached."""
        chunk: list[Answer] = []
        size = 0
        for a in items:
            if budget is not None and answer_done + sum(len(x.answer_ids) for x in chunk) >= budget:
                break
            if (a.uid, a.tag) in done:
                continue
            chunk.append(a)
            size += len(a.prompt_ids) + len(a.answer_ids)
            if size >= args.chunk_tokens:
                write(chunk, stage)
                chunk, size = [], 0
        if chunk:
            write(chunk, stage)
        return budget is None or answer_done < budget

    try:
        answers, dropped = target_answers(Path(args.answers), tokenizer, exclusion)
        if dropped:
            log({"stage": "target-answers", "dropped_as_evaluation": dropped})
        run("target-answers", answers, None)
        if run("sharegpt-code", turns(code, "code", done), args.budget):
            run("sharegpt-other", turns(rest, "chat", done), args.budget)
    except KeyboardInterrupt:
        log({"event": "stopped", "answer_tokens": answer_done, "tokens": tokens_done})
        return 130
    log({"event": "done", "answer_tokens": answer_done, "tokens": tokens_done, "budget": args.budget,
         "shards": len(shard_paths(out))})
    return 0
