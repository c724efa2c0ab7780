"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024) and a hybrid with a feature head.

A `SuffixTrie` holds every substring (up to `depth` tokens) of some token sequences,
each node counting how often its path occurred. To draft for a context, take the
longest suffix of the context (at most `depth` tokens) whose node has continuations,
then follow the most frequent child while the running product of the children's
empirical frequencies (the speculation's score) stays above `min_prob`, for at most
`factor` x the matched length tokens (adaptive length: longer matches earn longer
drafts). Draft cost is a few dictionary lookups.

Two tries serve each request: its own (prompt and output so far, appended as tokens
commit) and a bounded global one (previous requests' outputs, oldest evicted first).
The speculation with the higher expected number of accepted tokens (the sum of its
running scores) wins. Drafts are one-hot distributions, so speculative sampling stays exact.

`HybridRowsDrafter` drafts from the suffix tries for rows whose speculation scores at
least `threshold` expected tokens, and from an EAGLE head for the others.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from draftwise.drafters.base import Drafter, RetiringRows, WrappingDrafter
from draftwise.engine.protocols import one_hot_draft
from draftwise.drafters.tree_growth import tree_draft
from draftwise.errors import DraftwiseError


ROOT = 0  # every trie's root node


def _extend_match(nodes: list[int], children: list[dict[int, int]], token: int, longest: int) -> list[int]:
    """The nodes of a trie reached by a sequence's suffixes (lengths 1, 2, .. while present; at most `longest`), after
    `token` joins the sequence, from the same list before it did: a suffix of length j + 1 is the one of length j
    followed by `token`. (A trie holds every substring of what it counts, so the present lengths are 1.. up to one.)"""
    node = children[ROOT].get(token) if longest > 0 else None
    if node is None:
        return []
    found = [node]
    for shorter in nodes[: longest - 1]:
        node = children[shorter].get(token)
        if node is None:
            break
        found.append(node)
    return found


class SuffixTrie:
    """Counts of every substring of up to `depth` tokens of the sequences added.

    A node is an integer: `counts[node]` is how often its path occurred and `children[node]` maps a token to the
    child's node. A trie makes about `depth` nodes per token it counts; held as integers in int-to-int dictionaries
    (which Python's cycle collector does not track), they cost no garbage-collection passes, where node objects made
    the collector walk every one of them again and again. Freed nodes are reused."""

    def __init__(self, depth: int = 24) -> None:
        if depth < 1:
            raise DraftwiseError(f"suffix depth must be >= 1, got {depth}")
        self.depth = depth
        self.counts: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]
        self._free: list[int] = []  # nodes removed, to be reused
        self.version = 0  # changes with every add or removal (a `TrieMatch` then walks its suffixes anew)

    root = ROOT

    def node(self) -> int:
        """A new node, counted 0, without children."""
        if self._free:
            node = self._free.pop()
            self.counts[node] = 0
            self.children[node] = {}
            return node
        self.counts.append(0)
        self.children.append({})
        return len(self.counts) - 1

    def _drop(self, node: int) -> None:
        """Free `node` and every node below it."""
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend(self.children[node].values())
            self.children[node] = {}
            self._free.append(node)

    @property
    def size(self) -> int:
        """Nodes held, the root included."""
        return len(self.counts) - len(self._free)

    def add(self, tokens: Sequence[int], *, sign: int = 1) -> None:
        """Add (sign=1) or remove (sign=-1) every substring of `tokens` up to `depth` long."""
        tokens = list(tokens)
        self.version += 1
        counts, children = self.counts, self.children
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start : start + self.depth]:
                kids = children[node]
                child = kids.get(token)
                if child is None:
                    if sign < 0:
                        raise DraftwiseError("removing a sequence that was never added")
                    child = kids[token] = self.node()
                counts[child] += sign
                if counts[child] == 0:
                    del kids[token]
                    self._drop(child)
                    break
                node = child

    def matched(self, context: Sequence[int]) -> list[int]:
        """The nodes of the suffixes of `context` held here, shortest first (at most depth - 1 long: the
        speculations match no longer)."""
        nodes: list[int] = []
        for token in context[max(0, len(context) - (self.depth - 1)):]:
            nodes = _extend_match(nodes, self.children, token, self.depth - 1)
        return nodes

    def speculate(self, context: Sequence[int], limit: int, *, factor: float, min_prob: float,
                  min_match: int = 1) -> tuple[list[int], float, int]:
        """(tokens, score, matched length): the draft from the longest matched suffix with continuations."""
        return self.speculate_from(self.matched(context), limit, factor=factor, min_prob=min_prob,
                                   min_match=min_match)

    def speculate_from(self, matched: Sequence[int], limit: int, *, factor: float, min_prob: float,
                       min_match: int = 1) -> tuple[list[int], float, int]:
        """`speculate` from the context's matched suffix nodes (`matched`, shortest first, as `matched` gives)."""
        if limit <= 0:
            return [], 0.0, 0
        counts, children = self.counts, self.children
        for length in range(min(self.depth - 1, len(matched)), min_match - 1, -1):
            node = matched[length - 1] if length else ROOT  # min_match 0: the empty suffix
            if not children[node]:
                continue
            budget = min(limit, max(1, int(factor * length)))
            tokens: list[int] = []
            score, expected = 1.0, 0.0
            while children[node] and len(tokens) < budget:
                kids = children[node]
                total = sum(counts[child] for child in kids.values())
                token, child = max(kids.items(), key=lambda item: (counts[item[1]], -item[0]))
                score *= counts[child] / total
                if score < min_prob:
                    break
                tokens.append(token)
                expected += score
                node = child
            return tokens, expected, length
        return [], 0.0, 0


    def speculate_tree(self, context: Sequence[int], nodes: int, max_depth: int, *, factor: float, min_prob: float,
                       min_match: int = 1) -> tuple[list[int], list[int], float, list[float]]:
        """(tokens, parents, expected accepted tokens, path scores): SuffixDecoding's speculation tree from the
        longest matched suffix with continuations: the most probable continuations (each path's score is the
        product of its children's empirical frequencies), best first, at most `nodes` of them and `max_depth` (at
        most `factor` x the matched length) deep, none scoring below `min_prob`. Parents precede children; siblings
        are ordered most frequent first."""
        return self.speculate_tree_from(self.matched(context), nodes, max_depth, factor=factor, min_prob=min_prob,
                                        min_match=min_match)

    def speculate_tree_from(self, matched: Sequence[int], nodes: int, max_depth: int, *, factor: float,
                            min_prob: float, min_match: int = 1) -> tuple[list[int], list[int], float, list[float]]:
        """`speculate_tree` from the context's matched suffix nodes (`matched`, shortest first)."""
        import heapq

        if nodes <= 0 or max_depth <= 0:
            return [], [], 0.0, []
        counts, children = self.counts, self.children
        for length in range(min(self.depth - 1, len(matched)), min_match - 1, -1):
            node = matched[length - 1] if length else ROOT  # min_match 0: the empty suffix
            if not children[node]:
                continue
            depth_limit = min(max_depth, max(1, int(factor * length)))
            tokens: list[int] = []
            parents: list[int] = []
            scores: list[float] = []
            expected = 0.0
            heap: list[tuple[float, int, int, int, int, int]] = []
            serial = 0

            def push(parent_node: int, parent: int, score: float, depth: int) -> None:
                nonlocal serial
                kids = children[parent_node]
                total = sum(counts[child] for child in kids.values())
                for token, child in kids.items():
                    p = score * counts[child] / total
                    if p >= min_prob:
                        heapq.heappush(heap, (-p, serial, token, parent, depth, child))
                        serial += 1

            push(node, -1, 1.0, 1)
            while heap and len(tokens) < nodes:
                neg, _, token, parent, depth, child = heapq.heappop(heap)
                tokens.append(token)
                parents.append(parent)
                scores.append(-neg)
                expected += -neg
                if depth < depth_limit and children[child]:
                    push(child, len(tokens) - 1, -neg, depth + 1)
            return tokens, parents, expected, scores
        return [], [], 0.0, []


class TrieMatch:
    """A growing token sequence's matched suffix nodes (`SuffixTrie.matched`) in a trie it does not own (the global
    store's), kept from call to call: each new token extends them in O(depth) rather than every suffix being walked
    again. When the trie has changed since (its `version`: nodes may have been freed and reused), the next call walks
    the last depth - 1 tokens anew."""

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        self.nodes: list[int] = []
        self.seen = 0  # tokens of the sequence the nodes cover
        self.version = -1  # the trie's version they were found in

    def follow(self, tokens: Sequence[int]) -> list[int]:
        """The matched nodes of `tokens`: the sequence so far, which extends the one of the last call."""
        trie = self.trie
        if self.version != trie.version or len(tokens) < self.seen:
            self.nodes, self.version = trie.matched(tokens), trie.version
        else:
            for token in tokens[self.seen:]:
                self.nodes = _extend_match(self.nodes, trie.children, token, trie.depth - 1)
        self.seen = len(tokens)
        return self.nodes


class RequestSuffix:
    """One request's trie, kept in step with its committed tokens (appending is O(depth) per token), and where its
    tokens' suffixes stand in a `shared` trie (the global store's) when given."""

    def __init__(self, depth: int, shared: SuffixTrie | None = None) -> None:
        self.trie = SuffixTrie(depth)
        self.tokens: list[int] = []
        self.prompt_length = 0
        self._active: list[int] = []  # nodes of the suffixes ending at the last token (shortest first)
        self.shared = TrieMatch(shared) if shared is not None else None

    def matches(self) -> list[tuple[SuffixTrie, list[int]]]:
        """The tries this request drafts from, its own first, each with its tokens' matched suffix nodes there."""
        own = (self.trie, self._active)  # every suffix of its tokens is in its own trie
        return [own] if self.shared is None else [own, (self.shared.trie, self.shared.follow(self.tokens))]

    def extend(self, tokens: Sequence[int]) -> None:
        trie = self.trie
        keep, counts, children = trie.depth - 1, trie.counts, trie.children
        active = self._active
        for token in tokens:
            grown = []
            for node in (ROOT, *active[:keep]):
                kids = children[node]
                child = kids.get(token)
                if child is None:
                    child = kids[token] = trie.node()
                counts[child] += 1
                grown.append(child)
            active = grown
        self._active = active
        self.tokens.extend(tokens)


class GlobalSuffix:
    """Previous outputs, at most `max_tokens` tokens of them (the oldest are evicted first)."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        self.trie = SuffixTrie(depth)
        self.max_tokens = max_tokens
        self.held: deque[list[int]] = deque()
        self.size = 0

    def add(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[-self.max_tokens :] if self.max_tokens else []
        if not tokens:
            return
        self.trie.add(tokens)
        self.held.append(tokens)
        self.size += len(tokens)
        while self.size > self.max_tokens:
            old = self.held.popleft()
            self.trie.add(old, sign=-1)
            self.size -= len(old)


@dataclass(frozen=True)
class SuffixOptions:
    depth: int = 24
    factor: float = 1.0
    min_prob: float = 0.1
    global_tokens: int = 200_000
    min_match: int = 2

    def __post_init__(self) -> None:
        if self.depth < 2:
            raise DraftwiseError(f"suffix depth must be >= 2, got {self.depth}")
        if not self.factor > 0:
            raise DraftwiseError(f"suffix factor must be > 0, got {self.factor}")
        if not 0 <= self.min_prob < 1:
            raise DraftwiseError(f"suffix min_prob must be in [0, 1), got {self.min_prob}")
        if self.global_tokens < 0:
            raise DraftwiseError(f"suffix global_tokens must be >= 0, got {self.global_tokens}")
        if not 1 <= self.min_match < self.depth:
            raise DraftwiseError(f"suffix min_match must be in [1, depth), got {self.min_match}")


def best_speculation(matches: Sequence[tuple[SuffixTrie, Sequence[int]]], limit: int, options: SuffixOptions
                     ) -> tuple[list[int], float]:
    """The speculation of the trie that scores best (the first on a tie; ([], 0.0) when none scores above 0), each
    trie given with the context's matched suffix nodes there (`RequestSuffix.matches`): the matching shared by the
    engine's drafter and the vLLM proposer."""
    best: tuple[list[int], float] = ([], 0.0)
    for trie, matched in matches:
        tokens, score, _ = trie.speculate_from(matched, limit, factor=options.factor, min_prob=options.min_prob,
                                               min_match=options.min_match)
        if score > best[1]:
            best = (tokens, score)
    return best


class SuffixRowsDrafter(RetiringRows, Drafter):
    """Suffix drafting for the engine's rows; one-hot draft distributions (exact). Its trie follows committed tokens
    only: a rewind changes nothing."""

    def __init__(self, vocab_size: int, device: torch.device, options: SuffixOptions = SuffixOptions(), *,
                 eos_token_ids: frozenset[int] = frozenset(), store: GlobalSuffix | None = None) -> None:
        super().__init__()
        self.vocab_size, self.device, self.options = vocab_size, device, options
        self.eos = eos_token_ids
        self.store = store if store is not None else GlobalSuffix(options.depth, options.global_tokens)
        self.last_scores: list[float] = []

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None:
        state = RequestSuffix(self.options.depth, self.store.trie)
        state.extend(prompt_ids)
        state.prompt_length = len(prompt_ids)
        self.put(row, state)

    def speculate(self, rows, limits) -> tuple[list[list[int]], list[float]]:
        found, scores = [], []
        for b, (row, limit) in enumerate(zip(rows, limits)):
            state = self.rows[b]
            state.extend(row.sequence[len(state.tokens) :])  # the tokens committed since the last step
            tokens, score = best_speculation(state.matches(), limit, self.options)
            for i, token in enumerate(tokens):  # nothing is drafted past an end-of-sequence token
                if token in self.eos:
                    tokens = tokens[: i + 1]
                    break
            found.append(tokens)
            scores.append(score)
        self.last_scores = scores
        return found, scores

    def propose(self, rows, limits, *, tree_nodes: int = 0, tree_min_prob: float = 0.0):
        if tree_nodes > 0:
            tokens, parents, _, scores = self.speculate_trees(rows, limits, tree_nodes, tree_min_prob)
            return tree_draft(tokens, parents, self.vocab_size, self.device, scores)
        found, _ = self.speculate(rows, limits)
        return one_hot_draft(found, self.vocab_size, self.device)

    def speculate_trees(self, rows, limits, nodes: int, min_prob: float = 0.0
                        ) -> tuple[list[list[int]], list[list[int]], list[float], list[list[float]]]:
        """Per row the better speculation tree (more expected tokens) of its own trie and the global one:
        (tokens, parents, expected, path scores best first); no node scores below the option's min_prob nor
        `min_prob`, and nothing is drafted past an end-of-sequence token."""
        o = self.options
        tokens_out, parents_out, expected_out, scores_out = [], [], [], []
        for b, (row, limit) in enumerate(zip(rows, limits)):
            state = self.rows[b]
            state.extend(row.sequence[len(state.tokens):])
            best: tuple[list[int], list[int], float, list[float]] = ([], [], 0.0, [])
            for trie, matched in state.matches():
                found = trie.speculate_tree_from(matched, nodes, limit, factor=o.factor,
                                                 min_prob=max(o.min_prob, min_prob), min_match=o.min_match)
                if found[2] > best[2]:
                    best = found
            tokens, parents, scores = _cut_after_eos(best[0], best[1], best[3], self.eos)
            tokens_out.append(tokens)
            parents_out.append(parents)
            expected_out.append(best[2])
            scores_out.append(scores)
        self.last_scores = expected_out
        return tokens_out, parents_out, expected_out, scores_out

    def retire(self, state: RequestSuffix) -> None:
        """A request leaves: its output joins the global store."""
        self.store.add(state.tokens[state.prompt_length :])


def _hybrid_trees(hybrid: "HybridRowsDrafter", rows, limits, nodes: int, min_prob: float):
    """Per row the suffix tree (where it expects at least the threshold) and the head's tree, merged best first:
    (tokens, parents, path scores)."""
    from draftwise.drafters.tree_growth import merge_trees

    suffix_tokens, suffix_parents, expected, suffix_scores = hybrid.suffix.speculate_trees(rows, limits, nodes,
                                                                                           min_prob)
    head = hybrid.head.propose(rows, limits, tree_nodes=nodes, tree_min_prob=min_prob)
    head_tokens = head.tokens.tolist() if head.width else [[] for _ in rows]
    tokens_out, parents_out, scores_out = [], [], []
    for b in range(len(rows)):
        trees = []
        if suffix_tokens[b] and expected[b] >= hybrid.threshold:
            trees.append((suffix_tokens[b], suffix_parents[b], suffix_scores[b]))
            hybrid.used_suffix += 1
        else:
            hybrid.used_head += int(limits[b] > 0)
        if head.parents is not None and head.counts[b]:
            c = head.counts[b]
            trees.append((head_tokens[b][:c], head.parents[b], head.scores[b] if head.scores else [0.0] * c))
        tokens, parents, scores = merge_trees(trees, nodes)
        tokens_out.append(tokens)
        parents_out.append(parents)
        scores_out.append(scores)
    return tokens_out, parents_out, scores_out


def _cut_after_eos(tokens: list[int], parents: list[int], scores: list[float], eos: frozenset[int]
                   ) -> tuple[list[int], list[int], list[float]]:
    """A tree without the descendants of its end-of-sequence nodes (nothing is drafted past EOS)."""
    if not eos or not any(t in eos for t in tokens):
        return tokens, parents, scores
    keep, where = [], {}
    dead = set()
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if parent in dead:
            dead.add(i)
            continue
        if token in eos:
            dead.add(i)
        where[i] = len(keep)
        keep.append((token, where[parent] if parent >= 0 else -1, scores[i]))
    return [t for t, _, _ in keep], [p for _, p, _ in keep], [s for _, _, s in keep]


class HybridRowsDrafter(WrappingDrafter):
    """Suffix speculation where it scores at least `threshold` expected tokens, an EAGLE head (the inner drafter)
    elsewhere; with a tree budget, a suffix tree (where it scores at least `threshold`) merged with the head's tree.
    The suffix drafter follows the rows too (its trie needs no rewind)."""

    def __init__(self, head_drafter, suffix: SuffixRowsDrafter, threshold: float) -> None:
        if threshold < 0:
            raise DraftwiseError(f"hybrid threshold must be >= 0, got {threshold}")
        super().__init__(head_drafter)
        self.head, self.suffix, self.threshold = head_drafter, suffix, threshold
        self.used_suffix = 0
        self.used_head = 0

    def admit(self, row, prompt_ids) -> None:
        super().admit(row, prompt_ids)
        self.suffix.admit(row, prompt_ids)

    def move_row(self, src, dst) -> None:
        super().move_row(src, dst)
        self.suffix.move_row(src, dst)

    def release(self, live) -> None:
        super().release(live)
        self.suffix.release(live)

    def propose(self, rows, limits, *, tree_nodes: int = 0, tree_min_prob: float = 0.0):
        from draftwise.engine.protocols import RowsDraft, empty_draft

        if tree_nodes > 0:
            tokens, parents, scores = _hybrid_trees(self, rows, limits, tree_nodes, tree_min_prob)
            return tree_draft(tokens, parents, self.suffix.vocab_size, self.suffix.device, scores)
        found, scores = self.suffix.speculate(rows, limits)
        use_suffix = [bool(f) and s >= self.threshold for f, s in zip(found, scores)]
        head_limits = [0 if u else limit for u, limit in zip(use_suffix, limits)]
        head = self.head.propose(rows, head_limits)
        self.used_suffix += sum(use_suffix)
        self.used_head += sum(1 for u, limit in zip(use_suffix, limits) if not u and limit > 0)
        n = len(rows)
        counts = [len(found[b]) if use_suffix[b] else head.counts[b] for b in range(n)]
        k = max(counts, default=0)
        if k == 0:
            return empty_draft(n, self.suffix.vocab_size, self.suffix.device)
        tokens = torch.zeros(n, k, dtype=torch.long, device=self.suffix.device)
        # the head's greedy drafts carry no distributions: one-hot, like the suffix's, so the merge has none either
        probs = None if head.q is None else torch.zeros(n, k, self.suffix.vocab_size, device=self.suffix.device)
        for b in range(n):
            c = counts[b]
            if c == 0:
                continue
            if use_suffix[b]:
                tokens[b, :c] = torch.tensor(found[b], dtype=torch.long)
                if probs is not None:
                    probs[b, torch.arange(c), tokens[b, :c]] = 1.0
            else:
                tokens[b, :c] = head.tokens[b, :c]
                if probs is not None:
                    probs[b, :c] = head.probs[b, :c]
        return RowsDraft(tokens, probs, counts, vocab_size=self.suffix.vocab_size)
