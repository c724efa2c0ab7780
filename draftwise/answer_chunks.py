"""The target's answers on disk: compressed chunk files of token ids (written by `training/answers.py`, read by
training and by the n-gram companion of SV, `drafters/ngram_companion.py`).

A chunk is one `answers-<tag>-NNNNN.npz` (numpy, compressed), written to a temporary name and renamed:
- `tokens` uint16 (int32 for vocabularies over 65,536) [N]: the sequences (prompt then answer) back to back;
- `offsets` int64 [n + 1]: sequence i is tokens[offsets[i]:offsets[i+1]];
- `prompt_lens` int32 [n];
- `meta`: JSON (uids, sources, categories, finish reasons, tag, target, temperature, max_new_tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

import numpy as np

from draftwise.atomic import atomic_path
from draftwise.errors import DraftwiseError

CHUNK_GLOB = "answers-*.npz"


@dataclass(frozen=True)
class Answer:
    uid: str
    source: str
    category: str
    tag: str
    prompt_ids: list[int]
    answer_ids: list[int]
    finish_reason: str = ""


def write_chunk(path: Path, answers: Sequence[Answer], meta: dict[str, Any]) -> None:
    """`answers` to `path`, atomically."""
    tokens: list[int] = []
    offsets = [0]
    for a in answers:
        tokens.extend(a.prompt_ids)
        tokens.extend(a.answer_ids)
        offsets.append(len(tokens))
    dtype = np.uint16 if not tokens or max(tokens) < 2**16 else np.int32
    info = dict(meta, uids=[a.uid for a in answers], sources=[a.source for a in answers],
                categories=[a.category for a in answers], tags=[a.tag for a in answers],
                finish_reasons=[a.finish_reason for a in answers])
    with atomic_path(path, suffix=".npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, tokens=np.asarray(tokens, dtype=dtype), offsets=np.asarray(offsets, np.int64),
                                prompt_lens=np.asarray([len(a.prompt_ids) for a in answers], np.int32),
                                meta=np.frombuffer(json.dumps(info).encode(), dtype=np.uint8))


def write_next_chunk(directory: Path | str, answers: Sequence[Answer], tag: str, meta: dict[str, Any]) -> Path:
    """`answers` as the first free `answers-<tag>-NNNNN.npz` of `directory` (created if missing), atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = 0
    while (directory / f"answers-{tag}-{index:05d}.npz").exists():
        index += 1
    path = directory / f"answers-{tag}-{index:05d}.npz"
    write_chunk(path, answers, meta)
    return path


def chunk_paths(directory: Path | str) -> list[Path]:
    return sorted(Path(directory).glob(CHUNK_GLOB))


def read_chunk(path: Path) -> tuple[dict[str, Any], list[Answer]]:
    """A chunk's metadata and answers; a damaged file is a one-line error naming it."""
    try:
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            tokens, offsets, prompt_lens = z["tokens"].astype(np.int64), z["offsets"], z["prompt_lens"]
    except (OSError, ValueError, KeyError) as e:
        raise DraftwiseError(f"{path}: not a readable answers chunk ({type(e).__name__}: {e})") from None
    answers = []
    for i, uid in enumerate(meta["uids"]):
        seq = tokens[offsets[i]: offsets[i + 1]].tolist()
        cut = int(prompt_lens[i])
        answers.append(Answer(uid, meta["sources"][i], meta["categories"][i], meta["tags"][i], seq[:cut], seq[cut:],
                              meta.get("finish_reasons", [""] * len(meta["uids"]))[i]))
    return meta, answers


def read_answers(directory: Path | str, *, tags: Sequence[str] | None = None,
                 sources: Collection[str] | None = None) -> Iterator[Answer]:
    """Every answer of the chunks in `directory` (only those tagged one of `tags`, and answering a prompt of one
    of `sources`, when given)."""
    paths = chunk_paths(directory)
    if not paths:
        raise DraftwiseError(f"no answer chunks ({CHUNK_GLOB}) in {directory}: run `draftwise train-data --answers`")
    for path in paths:
        for answer in read_chunk(path)[1]:
            if (tags is None or answer.tag in tags) and (sources is None or answer.source in sources):
                yield answer


def done_keys(directory: Path | str) -> set[tuple[str, str]]:
    keys: set[tuple[str, str]] = set()
    for path in chunk_paths(directory):
        meta = read_chunk(path)[0]
        keys.update(zip(meta["uids"], meta["tags"]))
    return keys
