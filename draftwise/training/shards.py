"""Training data with the target's features captured while it generates (SpecForge's "online capture").

`generate_shards` answers prompts with the batched engine (plain target decoding,
continuous batching) and keeps, for every position the target processed, the
inputs of a few decoder layers and its final normed state: exactly what an
EAGLE-3-style head reads (the layer inputs) and trains towards (the final state,
through the LM head). Nothing is recomputed in a second pass.

A shard is one safetensors file:
- `tokens` int32 [N]: the sequences (prompt then answer) back to back;
- `offsets` int64 [n + 1]: sequence i is tokens[offsets[i]:offsets[i+1]];
- `prompt_lens` int32 [n];
- `features` fp16 [N, (len(layers) + 1) * hidden]: row j holds the features of token j
  (the sequence's last token was never fed to the target: its row is zero);
and JSON metadata (uids, sources, categories, tags, layers, target, sampling).

Shards are written to a temporary name and renamed, so a shard on disk is always
whole; a run resumes by skipping the uids already in a shard.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftwise.atomic import atomic_path
from draftwise.heads.eagle3 import eagle3_layers
from draftwise.drafters.base import NoRowsDrafter, RetiringRows
from draftwise.answer_chunks import Answer, write_next_chunk
from draftwise.errors import DraftwiseError

SHARD_GLOB = "shard-*.safetensors"


class FeatureCapture(RetiringRows):
    """A rows drafter that drafts nothing and keeps every row's target features (fp16).

    Buffers are keyed by the engine's request id (`request_id(row)`, set once the engine exists; without it,
    by admission order)."""

    wants_features = True

    def __init__(self, vocab_size: int, device: torch.device, feature_layers: Sequence[int] = ()) -> None:
        super().__init__()
        self.feature_layers = tuple(feature_layers)  # the engine sets the target runner to return these
        self._none = NoRowsDrafter(vocab_size, device)
        self.calls = 0
        self.admitted = 0
        self.retired: dict[int, dict[str, Any]] = {}  # request id -> buffer of a row that left
        self.request_id: Callable[[int], int] | None = None  # row -> the engine's request id

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None:
        serial = self.request_id(row) if self.request_id is not None else self.admitted
        self.put(row, {"serial": serial, "prompt": tuple(prompt_ids), "chunks": [], "length": 0})
        self.admitted += 1

    def propose(self, rows, limits):
        return self._none.propose(rows, limits)

    def observe(self, row: int, start: int, states: torch.Tensor) -> None:
        buffer = self.rows[row]
        if start != buffer["length"]:
            raise DraftwiseError(f"feature capture: row {row} got features from position {start}, "
                                 f"expected {buffer['length']}")
        buffer["chunks"].append(states.to(torch.float16).cpu())
        buffer["length"] += states.shape[0]

    def rewind(self, row: int, keep: int) -> None:
        pass  # plain decoding commits every fed token

    def retire(self, buffer: dict[str, Any]) -> None:
        self.retired[buffer["serial"]] = buffer

    def take(self, serial: int) -> dict[str, Any]:
        return self.retired.pop(serial)


@dataclass(frozen=True)
class Sequence_:
    uid: str
    source: str
    category: str
    tag: str
    prompt_ids: list[int]
    answer_ids: list[int]
    features: torch.Tensor  # [len(prompt) + len(answer), F] fp16, last row zero


def write_shard(path: Path, records: Sequence[Sequence_], meta: dict[str, Any]) -> None:
    """Write records to `path` atomically (temporary file, then rename)."""
    tokens, offsets, prompt_lens, feats = [], [0], [], []
    for r in records:
        ids = list(r.prompt_ids) + list(r.answer_ids)
        if r.features.shape[0] != len(ids):
            raise DraftwiseError(f"{r.uid}: {r.features.shape[0]} feature rows for {len(ids)} tokens")
        tokens.extend(ids)
        offsets.append(len(tokens))
        prompt_lens.append(len(r.prompt_ids))
        feats.append(r.features)
    tensors = {
        "tokens": torch.tensor(tokens, dtype=torch.int32),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
        "features": torch.cat(feats).to(torch.float16).contiguous(),
    }
    info = dict(meta, uids=[r.uid for r in records], sources=[r.source for r in records],
                categories=[r.category for r in records], tags=[r.tag for r in records])
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"draftwise": json.dumps(info)})


def shard_meta(path: Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["draftwise"])


def shard_paths(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob(SHARD_GLOB))


def done_keys(directory: Path) -> set[tuple[str, str]]:
    keys: set[tuple[str, str]] = set()
    for path in shard_paths(directory):
        meta = shard_meta(path)
        keys.update(zip(meta["uids"], meta["tags"]))
    return keys


def shard_totals(out: Path) -> tuple[set[tuple[str, str]], int, int]:
    """(done (uid, tag) keys, answer tokens, all tokens) of the shards in `out` (metadata and offsets only)."""
    done: set[tuple[str, str]] = set()
    answer_tokens = tokens = 0
    for path in shard_paths(out):
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["draftwise"])
            offsets = f.get_tensor("offsets").tolist()
            prompt_lens = f.get_tensor("prompt_lens").tolist()
        done.update(zip(meta["uids"], meta["tags"]))
        for i, cut in enumerate(prompt_lens):
            length = offsets[i + 1] - offsets[i]
            tokens += length
            answer_tokens += length - cut
    return done, answer_tokens, tokens


def clean_temporaries(out: Path) -> None:
    """Temporary shard files a killed run left (atomic_path's `.shard-*`): never read, only in the way."""
    for path in out.glob(".shard-*.safetensors*"):
        path.unlink(missing_ok=True)


@dataclass
class ShardSequence:
    """One sequence read back: tokens [T] int64, features [T, F] fp16 (None when read without them, or read lazily:
    `feature_rows`), answer_start."""

    tokens: torch.Tensor
    features: torch.Tensor | None
    answer_start: int
    category: str
    uid: str
    where: tuple[str, int] | None = None  # (shard path, first row): where `feature_rows` reads from

    def feature_rows(self, n: int | None = None) -> torch.Tensor:
        """The first n feature rows [n, F] fp16, read now from the shard file (only those rows) when the sequence
        was read without its features."""
        n = int(self.tokens.shape[0]) if n is None else n
        if self.features is not None:
            return self.features[:n]
        if self.where is None:
            raise DraftwiseError(f"{self.uid}: read without features and without its shard's location")
        path, start = self.where
        with safe_open(path, framework="pt") as f:
            return f.get_slice("features")[start: start + n]


def read_shards(
    directory: Path | str, *, layers: Sequence[int] | None = None, features: bool = True,
) -> Iterator[ShardSequence]:
    """Every sequence of the shards in `directory`; `features=False` reads only the tokens (features is None; a
    sequence's `feature_rows` reads them later, from the file, a few at a time: a training set larger than
    memory)."""
    paths = shard_paths(Path(directory))
    if not paths:
        raise DraftwiseError(f"no feature shards ({SHARD_GLOB}) in {directory}: run `draftwise train-data --features`")
    for path in paths:
        meta = shard_meta(path)
        if layers is not None and tuple(meta["layers"]) != tuple(layers):
            raise DraftwiseError(f"{path}: features of layers {meta['layers']}, this head reads {list(layers)}")
        with safe_open(str(path), framework="pt") as f:
            tokens = f.get_tensor("tokens").long()
            offsets = f.get_tensor("offsets").tolist()
            prompt_lens = f.get_tensor("prompt_lens").tolist()
            feats = f.get_tensor("features") if features else None
        for i in range(len(prompt_lens)):
            a, b = offsets[i], offsets[i + 1]
            yield ShardSequence(tokens[a:b].clone(), None if feats is None else feats[a:b], prompt_lens[i],
                                meta["categories"][i], meta["uids"][i], (str(path), a))


def generate_shards(
    target: Any, prompts: Sequence[Any], out: Path, *, max_new_tokens: int, batch_size: int, temperature: float,
    tag: str, seed: int = 0, shard_size: int = 64, layers: Sequence[int] | None = None,
    progress: Callable[[int, int], None] | None = None, log: Callable[[dict], None] | None = None,
    encode: Callable[[str], list[int]] | None = None, deadline: float | None = None,
    answers_dir: Path | None = None,
) -> dict[str, Any]:
    """Answer `prompts` (objects with uid, source, category, text) with the batched engine, capturing features.

    `answers_dir`: each shard's answers are also written there as an answer chunk (token ids only, about 2 bytes a
    token against the shard's 12 KB: small enough to commit), so a lost shard directory is remade by one prefill
    (`features_from_answers`) instead of decoding again.

    Returns counts and throughput of this run. Re-running skips what earlier runs wrote.
    `encode` turns a prompt's text into ids (default: the target's chat template, as a user turn).
    `deadline` (a `time.monotonic()` value): stop there, keeping every finished answer (in-flight ones are
    redone by the next run)."""
    from draftwise.rules.acceptance import ExactRule
    from draftwise.engine.core import Engine
    from draftwise.engine.rows import Request
    from draftwise.models.runner import ModelRunner
    from draftwise.engine.sampling import SamplingConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    num_layers = target.model.config.num_hidden_layers
    layers = tuple(layers) if layers is not None else eagle3_layers(num_layers)
    done = done_keys(out)
    todo = [p for p in prompts if (p.uid, tag) not in done]
    runner = ModelRunner(target.model, vocab_size=target.vocab_size, rows=0)
    capture = FeatureCapture(target.vocab_size, runner.device, layers)
    engine = Engine(runner, capture, ExactRule(), gamma=0, max_batch_size=batch_size, method="ar", stream_text=False)
    capture.request_id = lambda row: engine.live[row].id
    sampling = SamplingConfig(temperature=temperature) if temperature > 0 else SamplingConfig(temperature=0.0)
    eos = frozenset(target.eos_token_ids)
    meta = {"target": getattr(target, "name", ""), "layers": list(layers), "hidden": target.model.config.hidden_size,
            "temperature": temperature, "max_new_tokens": max_new_tokens}
    by_id: dict[int, Any] = {}
    for p in todo:
        ids = encode(p.text) if encode is not None else encode_chat(target.tokenizer, p.text)
        by_id[engine.submit(Request(prompt_ids=tuple(ids), sampling=sampling, max_new_tokens=max_new_tokens,
                                    eos_token_ids=eos, seed=seed + stable_seed(p.uid)))] = p
    next_index = len(shard_paths(out))
    pending: list[Sequence_] = []
    finished: list[str] = []  # the finish reasons of `pending`
    started = time.perf_counter()
    answer_tokens = 0
    written = 0

    def flush() -> None:
        nonlocal next_index, pending, finished
        while (out / f"shard-{next_index:05d}.safetensors").exists():
            next_index += 1
        if answers_dir is not None:  # first: a shard is only ever on disk with its answers kept
            write_next_chunk(answers_dir, [Answer(s.uid, s.source, s.category, s.tag, s.prompt_ids, s.answer_ids, why)
                                           for s, why in zip(pending, finished)], tag,
                             {k: v for k, v in meta.items() if k not in ("layers", "hidden")})
        write_shard(out / f"shard-{next_index:05d}.safetensors", pending, meta)
        next_index += 1
        pending, finished = [], []

    try:
        while engine.has_work:
            if deadline is not None and time.monotonic() > deadline:
                break
            for event in engine.step():
                if not event.finished:
                    continue
                result = engine.result(event.request_id)
                p = by_id[event.request_id]
                buffer = capture.take(event.request_id)
                prompt = list(buffer["prompt"])
                answer = list(result.token_ids)
                feats = torch.cat(buffer["chunks"]) if buffer["chunks"] else torch.zeros(0, (len(layers) + 1) * meta["hidden"])
                total = len(prompt) + len(answer)
                full = torch.zeros(total, feats.shape[1], dtype=torch.float16)
                full[: feats.shape[0]] = feats[:total]
                pending.append(Sequence_(p.uid, p.source, p.category, tag, prompt, answer, full))
                finished.append(result.finish_reason or "")
                answer_tokens += len(answer)
                written += 1
                if progress is not None:
                    progress(written, answer_tokens)
                if len(pending) >= shard_size:
                    flush()
                    if log is not None:
                        elapsed = time.perf_counter() - started
                        log({"sequences": written, "answer_tokens": answer_tokens, "seconds": round(elapsed, 1),
                             "answer_tokens_per_hour": round(answer_tokens / max(elapsed, 1e-9) * 3600)})
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what finished, then stop
        if pending:
            flush()
        raise
    if pending:
        flush()
    elapsed = time.perf_counter() - started
    return {"sequences": written, "answer_tokens": answer_tokens, "seconds": elapsed,
            "answer_tokens_per_hour": answer_tokens / max(elapsed, 1e-9) * 3600, "skipped": len(prompts) - len(todo)}


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise DraftwiseError("the target's tokenizer has no chat template: train-data asks the target as a chat "
                             "model (give a target with one)")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def stable_seed(uid: str) -> int:
    """A seed offset from a uid that does not change between runs (Python's hash() does)."""
    value = 0
    for ch in uid.encode():
        value = (value * 131 + ch) % 1_000_003
    return value
