"""Prompt lookup: n-gram drafting over the prompt and the output so far (Saxena 2023), no draft model."""

from __future__ import annotations

from typing import Sequence

import torch


def prompt_lookup(sequence: Sequence[int], max_tokens: int, *, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the sequence's last n tokens (n from
    `max_ngram` down to `min_ngram`), at most `max_tokens`; [] when none occurs."""
    if max_tokens <= 0:
        return []
    seq = torch.as_tensor(sequence, dtype=torch.long)
    length = seq.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = seq[: length - 1].unfold(0, n, 1)  # [length - n, n]: every earlier n-gram start
        hits = (windows == seq[length - n :]).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n  # continuation of the most recent match
            return seq[start : start + max_tokens].tolist()
    return []
