"""The target's answers, kept small and durable: the expensive half of a draft's training data.

Writing answers is decoding (hours on a CPU); the target's features for them are one prefill pass over the
finished sequences (minutes). So `generate_answers_chunks` keeps only token ids, in compressed chunk files
small enough to commit (about 2 bytes a token), and `features_from_answers` turns any set of chunks into the
feature shards of `training/shards.py` whenever a head is to be trained. A run that is cut off loses at most
the answers in flight; re-running skips every (uid, tag) already in a chunk.

A chunk is one `answers-<tag>-NNNNN.npz` (numpy, compressed), written to a temporary name and renamed:
- `tokens` uint16 (int32 for vocabularies over 65,536) [N]: the sequences (prompt then answer) back to back;
- `offsets` int64 [n + 1]: sequence i is tokens[offsets[i]:offsets[i+1]];
- `prompt_lens` int32 [n];
- `meta`: JSON (uids, sources, categories, finish reasons, tag, target, temperature, max_new_tokens).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from draftwise.answer_chunks import (CHUNK_GLOB, Answer, chunk_paths, done_keys, read_answers,  # noqa: F401
                                     read_chunk, write_chunk, write_next_chunk)


def generate_answers_chunks(
    target: Any, prompts: Sequence[Any], out: Path, *, max_new_tokens: int, batch_size: int, temperature: float,
    tag: str, seed: int = 0, chunk_size: int = 256, encode: Callable[[str], list[int]] | None = None,
    deadline: float | None = None, progress: Callable[[int, int], None] | None = None,
    log: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Answer `prompts` (objects with uid, source, category, text) with the batched engine (plain target decoding,
    continuous batching) into answer chunks. Re-running skips what earlier runs wrote. `deadline` (a
    `time.monotonic()` value): stop there, keeping every finished answer (in-flight ones are redone next run)."""
    from draftwise.rules.acceptance import ExactRule
    from draftwise.drafters.base import NoRowsDrafter
    from draftwise.engine.core import Engine
    from draftwise.models.runner import ModelRunner
    from draftwise.engine.rows import Request
    from draftwise.engine.sampling import SamplingConfig
    from draftwise.training.shards import stable_seed, encode_chat

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = done_keys(out)
    todo = [p for p in prompts if (p.uid, tag) not in done]
    runner = ModelRunner(target.model, vocab_size=target.vocab_size, rows=0)
    engine = Engine(runner, NoRowsDrafter(target.vocab_size, runner.device), ExactRule(), gamma=0,
                    max_batch_size=batch_size, method="ar", stream_text=False)
    sampling = SamplingConfig(temperature=temperature) if temperature > 0 else SamplingConfig(temperature=0.0)
    eos = frozenset(target.eos_token_ids)
    meta = {"target": getattr(target, "name", ""), "temperature": temperature, "max_new_tokens": max_new_tokens,
            "weights": getattr(target, "weights", ""), "device": str(runner.device)}
    by_id: dict[int, tuple[Any, list[int]]] = {}
    for p in todo:
        ids = encode(p.text) if encode is not None else encode_chat(target.tokenizer, p.text)
        request = Request(prompt_ids=tuple(ids), sampling=sampling, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                          seed=seed + stable_seed(p.uid))
        by_id[engine.submit(request)] = (p, ids)
    pending: list[Answer] = []
    started = time.perf_counter()
    answer_tokens = written = 0

    def flush() -> None:
        nonlocal pending
        write_next_chunk(out, pending, tag, meta)
        pending = []
        if log is not None:
            elapsed = time.perf_counter() - started
            log({"sequences": written, "answer_tokens": answer_tokens, "seconds": round(elapsed, 1),
                 "answer_tokens_per_hour": round(answer_tokens / max(elapsed, 1e-9) * 3600)})

    try:
        while engine.has_work:
            if deadline is not None and time.monotonic() > deadline:
                break
            for event in engine.step():
                if not event.finished:
                    continue
                result = engine.result(event.request_id)
                p, ids = by_id.pop(event.request_id)
                pending.append(Answer(p.uid, p.source, p.category, tag, list(ids), list(result.token_ids),
                                      result.finish_reason or ""))
                answer_tokens += len(result.token_ids)
                written += 1
                if progress is not None:
                    progress(written, answer_tokens)
                if len(pending) >= chunk_size:
                    flush()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what finished, then stop
        if pending:
            flush()
        raise
    if pending:
        flush()
    elapsed = time.perf_counter() - started
    return {"sequences": written, "answer_tokens": answer_tokens, "seconds": elapsed,
            "answer_tokens_per_hour": answer_tokens / max(elapsed, 1e-9) * 3600, "skipped": len(prompts) - len(todo)}


def features_from_answers(
    target: Any, answers: Sequence[Answer], out: Path, *, layers: Sequence[int] | None = None,
    shard_size: int = 64, batch_tokens: int = 4096, progress: Callable[[int], None] | None = None,
    before_forward: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """The feature shards (training/shards.py) of `answers`: one prefill forward over each finished sequence with
    the inputs of `layers` and the final normed state captured, as the target computes a prompt. The last
    token's row is zero (it was never fed to produce a next token). Re-running skips the (uid, tag) already in a
    shard. `before_forward` runs before each forward (a background job choosing its threads, say)."""
    from draftwise.heads.eagle3 import eagle3_layers
    from draftwise.models.runner import ModelRunner
    from draftwise.training.shards import Sequence_, done_keys as shard_done, shard_paths, write_shard

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layers = tuple(layers) if layers is not None else eagle3_layers(target.model.config.num_hidden_layers)
    done = shard_done(out)
    todo = [a for a in answers if (a.uid, a.tag) not in done]
    meta = {"target": getattr(target, "name", ""), "layers": list(layers), "hidden": target.model.config.hidden_size,
            "from": "answers"}
    next_index = len(shard_paths(out))
    pending: list[Sequence_] = []
    made = 0

    def flush() -> None:
        nonlocal next_index, pending
        while (out / f"shard-{next_index:05d}.safetensors").exists():
            next_index += 1
        write_shard(out / f"shard-{next_index:05d}.safetensors", pending, meta)
        next_index += 1
        pending = []

    started = time.perf_counter()
    i = 0
    while i < len(todo):  # batches of about batch_tokens fed tokens, longest sequence decides the width
        batch = [todo[i]]
        width = len(todo[i].prompt_ids) + len(todo[i].answer_ids) - 1
        while i + len(batch) < len(todo):
            nxt = todo[i + len(batch)]
            w = max(width, len(nxt.prompt_ids) + len(nxt.answer_ids) - 1)
            if w * (len(batch) + 1) > batch_tokens:
                break
            batch.append(nxt)
            width = w
        i += len(batch)
        fed = [a.prompt_ids + a.answer_ids[:-1] if a.answer_ids else a.prompt_ids[:-1] for a in batch]
        counts = [max(len(f), 1) for f in fed]
        tokens = torch.zeros(len(batch), max(counts), dtype=torch.long)
        for b, f in enumerate(fed):
            tokens[b, : len(f)] = torch.tensor(f[: counts[b]] or [0])
        if before_forward is not None:
            before_forward()
        runner = ModelRunner(target.model, vocab_size=target.vocab_size, rows=len(batch))
        runner.feature_layers = layers
        states = runner.forward_rows(tokens, counts, hidden=True, prompt=True,
                                     logits_at=torch.zeros(len(batch), 1, dtype=torch.long)).hidden
        for b, a in enumerate(batch):
            total = len(a.prompt_ids) + len(a.answer_ids)
            full = torch.zeros(total, states.shape[-1], dtype=torch.float16)
            full[: len(fed[b])] = states[b, : len(fed[b])].to(torch.float16).cpu()
            pending.append(Sequence_(a.uid, a.source, a.category, a.tag, a.prompt_ids, a.answer_ids, full))
            made += 1
            if len(pending) >= shard_size:
                flush()
        if progress is not None:
            progress(made)
    if pending:
        flush()
    return {"sequences": made, "skipped": len(answers) - len(todo), "seconds": time.perf_counter() - started}
