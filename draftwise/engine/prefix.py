"""Prefix reuse: keys and values of prompt prefixes kept across requests.

A prompt is cut into blocks of `BLOCK` tokens. Block i is keyed by a hash chain: the digest of block
i - 1's key and block i's tokens, so a key names the whole prefix up to its block's end, and two prompts
share a block exactly when they share every token up to it. Each block holds its positions' keys and
values for every layer (`[layers, 2, kv_heads, BLOCK, head_dim]`, the cache's dtype) and, for a drafter
that reads the target's features (EAGLE), those positions' features.

When a request is admitted, the longest chain of stored blocks that its prompt starts with is copied
into its cache row, and prefill starts after it (at most the prompt's first n - 1 tokens: the last one is fed by
the first decoding step, for its logits). When a row finishes prefilling, the full blocks of its prompt are
stored; a block that the prompt's last token completes is stored after the first decoding step, which feeds it. The store is bounded in bytes; the least recently used block goes first, and a
lookup refreshes a chain leaf first, so a shared root outlives the branches that hang off it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

BLOCK = 64  # prompt tokens per stored block


@dataclass
class _Block:
    kv: torch.Tensor  # [layers, 2, kv_heads, BLOCK, head_dim]
    features: torch.Tensor | None  # [BLOCK, feature size] or None

    @property
    def nbytes(self) -> int:
        extra = self.features.numel() * self.features.element_size() if self.features is not None else 0
        return self.kv.numel() * self.kv.element_size() + extra


class PrefixStore:
    """Blocks of keys and values by prefix hash, least recently used evicted past `budget_bytes`."""

    def __init__(self, budget_bytes: int, *, block: int = BLOCK) -> None:
        if budget_bytes <= 0:
            raise ValueError("a prefix store needs a budget > 0 bytes")
        self.budget_bytes = int(budget_bytes)
        self.block = block
        self.blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.bytes = 0
        self.hits = 0  # tokens served from the store
        self.lookups = 0  # prompt tokens looked up (hits / lookups: the hit rate)

    def _keys(self, tokens: Sequence[int]) -> list[bytes]:
        keys, parent = [], b""
        for start in range(0, len(tokens) - self.block + 1, self.block):
            block = torch.tensor(list(tokens[start: start + self.block]), dtype=torch.int64).numpy().tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, tokens: Sequence[int]) -> list[_Block]:
        """The stored blocks `tokens` starts with (refreshed for eviction)."""
        found: list[bytes] = []
        for key in self._keys(tokens):
            if key not in self.blocks:
                break
            found.append(key)
        self._touch(found)
        self.lookups += len(tokens)
        self.hits += len(found) * self.block
        return [self.blocks[k] for k in found]

    def restore(self, tokens: Sequence[int], cache, row: int, *, want_features: bool = False
                ) -> tuple[int, torch.Tensor | None]:
        """Copy the stored prefix of `tokens` into cache row `row` (empty); returns (positions restored, their
        features or None). Nothing is restored when features are wanted and a block has none."""
        blocks = self.lookup(tokens)
        if want_features and any(b.features is None for b in blocks):
            blocks = []
        if not blocks:
            return 0, None
        kv = torch.cat([b.kv for b in blocks], dim=3)  # [layers, 2, kv_heads, n, head_dim]
        n = kv.shape[3]
        cache.restore_row(row, kv)
        features = torch.cat([b.features for b in blocks]) if want_features else None
        return n, features

    def insert(self, tokens: Sequence[int], cache, row: int, features: torch.Tensor | None = None) -> int:
        """Store the full blocks of `tokens` (which cache row `row` holds from position 0); returns blocks added."""
        keys = self._keys(tokens)
        if not keys:
            return 0
        missing = [i for i, key in enumerate(keys) if key not in self.blocks]
        if missing:
            kv = cache.read_row(row, missing[0] * self.block, len(keys) * self.block)  # [layers, 2, kv, n, d]
            for i in missing:
                start = (i - missing[0]) * self.block
                block = _Block(kv[:, :, :, start: start + self.block].clone(),
                               None if features is None else
                               features[i * self.block: (i + 1) * self.block].detach().clone())
                self.blocks[keys[i]] = block
                self.bytes += block.nbytes
        self._touch(keys)
        self._evict()
        return len(missing)

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the root last: it is the most recently used
            self.blocks.move_to_end(key)

    def _evict(self) -> None:
        while self.bytes > self.budget_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.bytes -= block.nbytes

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0
