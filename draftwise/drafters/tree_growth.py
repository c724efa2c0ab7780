"""Growing token trees on the drafter's side (engine/tree.py verifies and accepts them): EAGLE-2's dynamic tree over
rows (`grow_trees`, and `grow_on` over a drafter's own cache, each expansion fed with `region_mask`), the union of
several trees (`merge_trees`, hybrid's), and the RowsDraft a tree drafter returns (`tree_draft`).

`grow_trees` expands the top-k children of the best nodes of the last depth, reranks every candidate by its path's
draft probability and keeps the best N; the engine's `tree.TreeBudget` gives N and the probability below which a
node is not grown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from draftwise.engine.protocols import RowsDraft
from draftwise.engine.tree import depths
from draftwise.models.runner import TreeMask

TREE_TOP_K = 4  # children tried per expanded node, and nodes expanded per depth


def tree_draft(tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]], vocab_size: int,
               device: torch.device, scores: Sequence[Sequence[float]] | None = None) -> RowsDraft:
    """A RowsDraft of token trees (deterministic candidates: `probs` has no vocabulary columns); `scores`, when
    given, are the nodes' path probabilities, best first (RowsDraft.scores)."""
    counts = [len(t) for t in tokens]
    k = max(counts, default=0)
    host = torch.zeros(len(tokens), k, dtype=torch.long)
    for b, row in enumerate(tokens):
        if row:
            host[b, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        depths(parents[b])
    return RowsDraft(host.to(device), torch.zeros(len(tokens), k, 0, device=device), counts,
                     parents=tuple(tuple(int(p) for p in row) for row in parents),
                     scores=None if scores is None else tuple(tuple(float(x) for x in row) for row in scores))


@dataclass
class _Candidate:
    token: int
    parent: int  # index into the row's candidate list, -1 for the root
    score: float  # log q of the path
    depth: int
    fed: int = -1  # region slot where the drafter was fed this node (expanded nodes only)


def grow_trees(
    root_logprobs: torch.Tensor, expand: Callable[[list[list[tuple[int, int, list[int], int]]]], torch.Tensor],
    *, budgets: Sequence[int], max_depths: Sequence[int], top_k: int = TREE_TOP_K,
    stop_tokens: frozenset[int] = frozenset(), min_probs: Sequence[float] | None = None,
    token_ids: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """EAGLE-2's dynamic tree over rows.

    root_logprobs [rows, vocab]: the drafter's log-probabilities of the first drafted token. Depth 1 takes the
    top_k tokens; each further depth feeds the drafter the top_k candidates of the last depth (by path score, the
    sum of log-probabilities along the path) and takes each one's top_k children. Finally every row keeps its
    best budgets[b] candidates (a child's score never exceeds its parent's, so the kept set holds every kept
    node's ancestors), best first: an order in which parents precede children, so any prefix of a row's nodes is
    the best tree of that size. A candidate whose path probability is below min_probs[b] is never kept nor
    expanded (the engine's TreeBudget: such a node cannot pay for its verification), so an unsure drafter
    stops growing early. `token_ids`, when given, maps the log-probabilities' columns to token ids (a drafter with
    its own smaller vocabulary); tokens everywhere else (expand's requests, stop_tokens, the result) are ids.

    expand(per row: [(token, region slot of its parent or -1, region slots of its ancestors, depth)] of the
    nodes fed this depth) -> [rows, m, vocab] log-probabilities after each fed node (m = the widest row; rows
    with fewer are padded and their padding ignored). The drafter writes the fed nodes at the next region slots,
    in order. Returns per row (tokens, parents, path probabilities)."""
    rows = root_logprobs.shape[0]
    pools: list[list[_Candidate]] = [[] for _ in range(rows)]
    width = max(max(budgets, default=0), 0)
    if width == 0:
        return [[] for _ in range(rows)], [[] for _ in range(rows)], [[] for _ in range(rows)]
    floor = [math.log(p) if p > 0 else -math.inf for p in (min_probs or [0.0] * rows)]
    top = min(top_k, root_logprobs.shape[-1])
    values, ids = _top(root_logprobs, top, token_ids)
    last: list[list[int]] = [[] for _ in range(rows)]  # candidate indices added at the last depth
    for b in range(rows):
        if budgets[b] <= 0 or max_depths[b] <= 0:
            continue
        for v, t in zip(values[b], ids[b]):
            if math.isfinite(v) and v >= floor[b]:
                last[b].append(len(pools[b]))
                pools[b].append(_Candidate(t, -1, v, 1))
    fed_count = [0] * rows
    depth = 1
    while True:
        frontier: list[list[int]] = []
        for b in range(rows):
            pick = [i for i in last[b] if pools[b][i].token not in stop_tokens and pools[b][i].depth < max_depths[b]]
            pick.sort(key=lambda i: -pools[b][i].score)
            frontier.append(pick[:top])
        if not any(frontier):
            break
        request = []
        for b in range(rows):
            items = []
            for i in frontier[b]:
                c = pools[b][i]
                ancestors, j = [], c.parent
                while j >= 0:
                    ancestors.append(pools[b][j].fed)
                    j = pools[b][j].parent
                c.fed = fed_count[b] + len(items)
                items.append((c.token, pools[b][c.parent].fed if c.parent >= 0 else -1, ancestors[::-1], c.depth))
            request.append(items)
        values, ids = _top(expand(request), top, token_ids)  # expand: [rows, m, vocab]
        depth += 1
        last = [[] for _ in range(rows)]
        for b in range(rows):
            for m, i in enumerate(frontier[b]):
                base = pools[b][i].score
                for v, t in zip(values[b][m], ids[b][m]):
                    v = min(v, 0.0)  # a rounding above 0 must not rank a child above its parent
                    if math.isfinite(v) and base + v >= floor[b]:
                        last[b].append(len(pools[b]))
                        pools[b].append(_Candidate(t, i, base + v, depth))
            fed_count[b] += len(frontier[b])
    tokens_out, parents_out, probs_out = [], [], []
    for b in range(rows):
        pool = pools[b]
        # best first; a tie puts the shallower node first (a child ties its parent only where q = 1)
        keep = sorted(range(len(pool)), key=lambda i: (-pool[i].score, pool[i].depth, i))[: budgets[b]]
        kept = set(keep)
        keep = [i for i in keep if _ancestors_kept(pool, i, kept)]
        where = {i: n for n, i in enumerate(keep)}
        tokens_out.append([pool[i].token for i in keep])
        parents_out.append([where[pool[i].parent] if pool[i].parent >= 0 else -1 for i in keep])
        probs_out.append([math.exp(pool[i].score) for i in keep])
    return tokens_out, parents_out, probs_out


def _top(logprobs: torch.Tensor, k: int, token_ids: Sequence[int] | None) -> tuple[list, list]:
    """The k best (log-probabilities, token ids) along the last dimension, as nested lists."""
    values, ids = logprobs.float().topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    if token_ids is not None:
        ids = _map_ids(ids, token_ids)
    return values, ids


def _map_ids(ids, token_ids: Sequence[int]):
    return [_map_ids(x, token_ids) for x in ids] if isinstance(ids, list) else token_ids[ids]


def _ancestors_kept(pool: list[_Candidate], i: int, kept: set[int]) -> bool:
    j = pool[i].parent
    while j >= 0:
        if j not in kept:
            return False
        j = pool[j].parent
    return True


def region_mask(request: list[list[tuple[int, int, list[int], int]]], fed_before: Sequence[int],
                region_start: Sequence[int], device: torch.device) -> tuple[torch.Tensor, list[int], TreeMask]:
    """A drafter's feed for one `grow_trees` expansion: tokens [rows, m] (right-padded), counts, and the TreeMask
    over each row's region (fed_before[b] region slots already written; node j of this feed goes at slot
    fed_before[b] + j and sees its ancestors' slots and itself). Rows with nothing to feed get one dummy token
    (the caller drops it by trimming back)."""
    rows = len(request)
    m = max((len(items) for items in request), default=0)
    m = max(m, 1)
    tokens = torch.zeros(rows, m, dtype=torch.long)
    counts = []
    span = max(f + m for f in fed_before)
    visible = np.zeros((rows, m, span), dtype=bool)
    positions = np.zeros((rows, m), dtype=np.int64)
    for b, items in enumerate(request):
        counts.append(max(len(items), 1))
        for j in range(m):
            slot = fed_before[b] + j
            visible[b, j, slot] = True
            positions[b, j] = region_start[b]  # padding: at the region's start
        for j, (token, _, ancestors, depth) in enumerate(items):
            tokens[b, j] = token
            for a in ancestors:
                visible[b, j, a] = True
            positions[b, j] = region_start[b] + depth - 1
    mask = TreeMask(torch.from_numpy(positions).to(device), list(region_start), torch.from_numpy(visible).to(device))
    return tokens.to(device), counts, mask


def grow_on(runner, root_logprobs: torch.Tensor,
            feed: Callable[[torch.Tensor, list[int], TreeMask, list[list[tuple[int, int, list[int], int]]]],
                           torch.Tensor],
            *, budgets: Sequence[int], max_depths: Sequence[int], top_k: int = TREE_TOP_K,
            stop_tokens: frozenset[int] = frozenset(), min_probs: Sequence[float] | None = None,
            token_ids: Sequence[int] | None = None) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """`grow_trees` over a drafter's own cache (rows 0 .. n - 1 of `runner`): each expansion feeds the frontier
    nodes after the row's committed length, each seeing its ancestors; afterwards the rows are trimmed back, so
    the drafter's cache holds committed tokens only. feed(tokens [rows, m], counts, mask, request) runs the
    forward and returns log-probabilities [rows, m, vocab]."""
    rows = root_logprobs.shape[0]
    region_start = list(runner.lengths[:rows])
    fed = [0] * rows

    def expand(request):
        tokens, counts, mask = region_mask(request, fed, region_start, root_logprobs.device)
        logprobs = feed(tokens, counts, mask, request)
        for b, items in enumerate(request):
            fed[b] += len(items)
            runner.trim_row(b, region_start[b] + fed[b])  # a row that fed nothing fed one dummy token
        return logprobs

    try:
        return grow_trees(root_logprobs, expand, budgets=budgets, max_depths=max_depths, top_k=top_k,
                          stop_tokens=stop_tokens, min_probs=min_probs, token_ids=token_ids)
    finally:
        for b in range(rows):
            runner.trim_row(b, min(region_start[b], runner.lengths[b]))


def merge_trees(trees: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]], budget: int
                ) -> tuple[list[int], list[int], list[float]]:
    """One tree from several (tokens, parents, path scores): a node whose path is in several trees is one node
    with the best of its scores; the union is ordered best first (a tie puts the shallower node first, so parents
    precede children) and cut to `budget` nodes, which keeps every kept node's ancestors (a path's score never
    exceeds its parent's in any tree, so neither does the best of them)."""
    keys: list[tuple[tuple[int, ...], float]] = []  # (path, score) per union node
    where: dict[tuple[int, ...], int] = {}
    for tree_tokens, tree_parents, tree_scores in trees:
        paths: list[tuple[int, ...]] = []
        scored: list[float] = []
        for token, parent, score in zip(tree_tokens, tree_parents, tree_scores):
            path = (paths[parent] if parent >= 0 else ()) + (int(token),)
            score = float(score) if parent < 0 else min(float(score), scored[parent])  # never above its parent
            paths.append(path)
            scored.append(score)
            at = where.get(path)
            if at is None:
                where[path] = len(keys)
                keys.append((path, float(score)))
            elif score > keys[at][1]:
                keys[at] = (path, float(score))
    order = sorted(range(len(keys)), key=lambda i: (-keys[i][1], len(keys[i][0]), i))[: max(budget, 0)]
    index = {keys[i][0]: n for n, i in enumerate(order)}
    tokens = [keys[i][0][-1] for i in order]
    parents = [index[keys[i][0][:-1]] if len(keys[i][0]) > 1 else -1 for i in order]
    return tokens, parents, [keys[i][1] for i in order]
