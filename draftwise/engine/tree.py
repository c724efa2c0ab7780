"""Token trees: drafts that give the target several candidates per position, verified in one forward.

A tree draft holds, per row, nodes in topological order: node i has a token and a parent (`-1`: the row's pending
token, the last committed one, which the verification forward feeds first). Verification feeds the pending token
at slot 0 and node i at slot `1 + i` of the row's cache region: slot s sits at cache position `length + s`, has
position id `length + depth(s)`, and sees the committed prefix and its own ancestors only (`verify_mask`).

Acceptance (`accept_tree`) walks from the pending token: at a node whose target distribution is p, the row takes
the target's own token x ~ p at that position (`keyed.Draws.own`: the Gumbel-max token argmax(log p + G_t) with G_t
keyed by the row's seed and the position t, as `ar` draws; under the rejection coupling the inverse CDF at a keyed
uniform; the argmax at temperature 0); if a child of the node carries x, the child is accepted and the walk goes on
from it, otherwise x is the row's next token. The committed token at every position is a draw from p, so this is
exact at any temperature, and a child x is accepted with probability p(x), as in multi-candidate speculative
sampling with one-hot proposals (SpecInfer, EAGLE). Unlike that scheme, which draws a uniform per candidate tried,
the draw at a position is keyed by the position alone: a row's tokens depend on its seed alone, never on the
tree's shape. That matters because shapes depend on the batch (the node budget at the batch's size, the value cut
over every row's nodes): a uniform per candidate tried would let a batch whose size follows one row's random
outcome give that row a tree correlated with its own uniforms, and bias it. At temperature > 0 a tree method writes
`ar`'s tokens for the same seed, up to the rounding of the target's probabilities.

After acceptance the engine moves the accepted paths' keys and values to contiguous positions
(`PositionCache.compact_rows`, one gather per layer for every row) and trims the rest.

Trees are grown by `grow_trees` (EAGLE-2's dynamic tree: expand the top-k children of the best nodes of the last
depth, rerank every candidate by its path's draft probability, keep the best N) for the draft model and the
EAGLE head, and by the suffix tries (`suffix.SuffixTrie.speculate_tree`) for suffix decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from draftwise.engine.keyed import Draws, as_draws
from draftwise.engine.sampler import RowsAcceptance, accept_own_draws
from draftwise.errors import DraftwiseError
from draftwise.models.runner import TreeMask
from draftwise.engine.protocols import RowsDraft
from draftwise.engine.sampling import argmax_last

TREE_TOP_K = 4  # children tried per expanded node, and nodes expanded per depth
DEFAULT_TREE_NODES = 16  # a row's node budget when the engine has no cost measurements yet


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (a child of the pending token has depth 1)."""
    out: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise DraftwiseError(f"tree node {i} has parent {p}: parents must come before their children")
        out.append(1 if p < 0 else out[p] + 1)
    return out


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


def chain_parents(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def slot_structure(parents: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, each slot's depth [rows, width] and ancestor-or-self matrix [rows, width, width] (slot 0: the
    pending token, an ancestor of every node; padding slots see slot 0 and themselves)."""
    rows = len(parents)
    depth = np.zeros((rows, width), dtype=np.int64)
    visible = np.zeros((rows, width, width), dtype=bool)
    diag = np.arange(width)
    visible[:, diag, diag] = True
    visible[:, :, 0] = True
    for b, row in enumerate(parents):
        for i, p in enumerate(row):
            s = i + 1
            visible[b, s] |= visible[b, p + 1]
            depth[b, s] = depth[b, p + 1] + 1
    return depth, visible


def verify_mask(parents: Sequence[Sequence[int]], starts: Sequence[int], width: int, device: torch.device,
                extra: Sequence[int] = ()) -> TreeMask:
    """The target's TreeMask for a verification forward: row b's trees (`parents[b]`, fed after its pending token
    at cache position starts[b]), then rows `extra` (their counts) fed as plain causal chunks (prompt prefills
    sharing the forward)."""
    depth, visible = slot_structure(list(parents) + [()] * len(extra), width)
    for j in range(len(extra)):  # prompt chunks: causal
        b = len(parents) + j
        depth[b] = np.arange(width)
        visible[b] = np.tril(np.ones((width, width), dtype=bool))
    start_t = torch.as_tensor(list(starts), dtype=torch.long)
    positions = start_t[:, None] + torch.from_numpy(depth)
    return TreeMask(positions.to(device), list(starts), torch.from_numpy(visible).to(device))


@dataclass(frozen=True)
class TreeAcceptance:
    paths: list[list[int]]  # per row, the accepted nodes from the root down
    next_tokens: list[int]  # per row, the token drawn after the path
    final_slots: list[int]  # per row, the slot whose distribution the next token came from


def node_slot(node: int) -> int:
    """The verification slot of tree node `node` (-1: the pending token, at slot 0)."""
    return node + 1


def accept_tree(parents: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]], target_probs: torch.Tensor,
                draws: Draws | Sequence[torch.Generator], greedy: Sequence[bool]) -> TreeAcceptance:
    """Walk each row's tree by taking the target's own token at every node (see the module docstring).

    target_probs [rows, 1 + k, vocab]: the warped target distribution at each slot (one-hot for greedy rows).
    At depth d a walking row takes the target's own draw at its node, keyed by position starts[b] + d
    (`Draws.own`); a child carrying that token is accepted and the walk goes on from it, otherwise the token is the
    row's next token. A row's draws are keyed by position, not by the tree: its tokens do not depend on the tree's
    shape, hence not on its batch-mates (whose progress and the batch's size shape the trees)."""
    rows = len(parents)
    device = target_probs.device
    draws = as_draws(draws, rows, device)
    children: list[dict[int, dict[int, int]]] = []  # per row: node -> {token: first child carrying it}
    for b, row in enumerate(parents):
        kids: dict[int, dict[int, int]] = {}
        for i, p in enumerate(row):
            kids.setdefault(p, {}).setdefault(int(tokens[b][i]), i)
        children.append(kids)
    node = [-1] * rows
    paths: list[list[int]] = [[] for _ in range(rows)]
    next_tokens = [0] * rows
    walking = list(range(rows))
    index = torch.arange(rows, device=device)
    depth = 0
    while walking:
        slots = torch.tensor([node_slot(node[b]) for b in walking], device=device)
        probs = target_probs[index[walking], slots]  # [walking, vocab]
        if all(greedy[b] for b in walking):
            drawn = argmax_last(probs)
        else:
            drawn = draws.subset(walking).own(probs[:, None], torch.tensor([depth], device=device),
                                              [greedy[b] for b in walking])[:, 0]
        still = []
        for b, token in zip(walking, drawn.tolist()):  # one host copy a depth
            child = children[b].get(node[b], {}).get(token)
            if child is None:
                next_tokens[b] = token
            else:
                paths[b].append(child)
                node[b] = child
                still.append(b)
        walking = still
        depth += 1
    return TreeAcceptance(paths, next_tokens, [node_slot(n) for n in node])


def accept_chains(tokens_host: Sequence[Sequence[int]], counts: Sequence[int], target_probs: torch.Tensor,
                  draws: Draws | Sequence[torch.Generator], greedy: Sequence[bool]) -> RowsAcceptance:
    """`accept_tree` over chains (each row's drafted tokens on the host, padded past counts[b]), in one pass
    (`sampler.accept_own_draws`): the same outcome, the target's own draw at every position."""
    rows = len(counts)
    draws = as_draws(draws, rows, target_probs.device)
    k = max(counts, default=0)
    host = torch.zeros(rows, k, dtype=torch.long)
    for b, (row, c) in enumerate(zip(tokens_host, counts)):
        if c:
            host[b, :c] = torch.as_tensor(list(row[:c]), dtype=torch.long)
    return accept_own_draws(host.to(target_probs.device), counts, target_probs[:, : k + 1], draws, greedy)


# ------------------------------------------------------------------ growing trees from a drafter's distributions

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


class TreeBudget:
    """Each row's node budget at the current batch size, from the measured cost of verification forwards.

    The engine reports each verification forward's time and the tokens it fed; a linear fit (time = fixed +
    per_token x tokens, recent forwards weighted most) gives the fixed cost (reading the weights) and what a fed
    token adds.

    Trees are cut by value (RowsDraft.scores, every tree drafter's path probabilities): taking a node's path
    probability as its chance of being accepted, a node is verified while it raises the step's expected tokens
    per second (`cut`), and the drafter grows no node below the probability that could never pay (`min_prob`),
    so an unsure drafter stops early. A tree without scores would get a fixed budget: a step's tokens are worth
    spending while they add at most the fixed cost, rows x (1 + nodes) <= fixed / per_token (`nodes`). Every
    budget is at most `max_nodes` a row. Until forwards of a few widths are measured, the budget takes turns at
    `max_nodes`, half and a quarter of it (over the rows), so the fit has widths to fit. Not `adaptive`: every row
    grows and verifies its best `max_nodes` nodes, whatever the timings (the same trees on every machine)."""

    def __init__(self, max_nodes: int, *, min_nodes: int = 1, decay: float = 0.97, adaptive: bool = True) -> None:
        if max_nodes < 1:
            raise DraftwiseError(f"tree_nodes must be >= 1, got {max_nodes}")
        self.max_nodes, self.min_nodes, self.decay = max_nodes, min(min_nodes, max_nodes), decay
        self.adaptive = adaptive
        self._sums = np.zeros(5)  # weighted n, sum x, sum y, sum xx, sum xy
        self._draft = 0.0  # drafting seconds a step (an exponential average)
        self._probes = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One verification forward: `tokens` fed (every row's), in `seconds`."""
        self._sums *= self.decay
        self._sums += np.array([1.0, tokens, seconds, tokens * tokens, tokens * seconds])

    def observe_draft(self, seconds: float) -> None:
        """One step's drafting time (every row's tree)."""
        self._draft = seconds if self._draft == 0.0 else 0.8 * self._draft + 0.2 * seconds

    def fit(self) -> tuple[float, float] | None:
        n, sx, sy, sxx, sxy = self._sums
        if n < 4:
            return None
        var = sxx - sx * sx / n
        if var <= 1e-9 * max(sxx, 1.0):
            return None
        slope = (sxy - sx * sy / n) / var
        fixed = (sy - slope * sx) / n
        if slope <= 0 or fixed <= 0:
            return None
        return fixed, slope

    def nodes(self, rows: int) -> int:
        """A row's node budget for a tree without path probabilities (and a drafter's growth budget before a fit)."""
        fit = self.fit()
        if fit is None:  # widths in turn, so the fit has some to fit
            self._probes += 1
            budget = (self.max_nodes >> (self._probes % 3)) // max(rows, 1)
        else:
            fixed, per_token = fit
            budget = int(fixed / per_token / max(rows, 1) + 1e-6) - 1
        return max(self.min_nodes, min(self.max_nodes, budget))

    def growth(self, rows: int) -> int:
        """A row's growth budget for a drafter whose trees `cut` trims: `max_nodes` once the cost is fitted."""
        return self.max_nodes if not self.adaptive or self.fit() is not None else self.nodes(rows)

    def min_prob(self, rows: int) -> float:
        """The path probability below which a node cannot pay for itself at this batch size. With no drafts a
        step commits `rows` tokens in fixed + draft + per_token x rows seconds; a node adds per_token seconds
        and p expected tokens, which raises the rate only if p > per_token x rows / that time (and the best
        trees' rate is higher still, so `cut` is stricter). 0 before a fit."""
        fit = self.fit() if self.adaptive else None
        if fit is None:
            return 0.0
        fixed, per_token = fit
        return per_token * rows / (fixed + self._draft + per_token * rows)

    def cut(self, scores: Sequence[Sequence[float]]) -> list[int]:
        """How many of each row's nodes (best first, path probabilities `scores`) to verify: over every row,
        the most probable node next joins while its probability p, as its expected accepted tokens, beats the
        step's rate so far: p / per_token > expected tokens / seconds (each row commits 1 + the sum of its
        nodes' p, in fixed + draft + per_token x fed tokens). Each row's first nodes, so each keeps a tree.
        Before a fit, or not adaptive, every node (at most max_nodes)."""
        fit = self.fit() if self.adaptive else None
        if fit is None:
            return [min(len(row), self.max_nodes) for row in scores]
        fixed, per_token = fit
        rows = len(scores)
        value, cost = float(rows), fixed + self._draft + per_token * rows
        counts = [0] * rows
        ranked = sorted(((p, b, i) for b, row in enumerate(scores) for i, p in enumerate(row)),
                        key=lambda item: (-item[0], item[2], item[1]))
        for p, b, i in ranked:
            if p * cost <= per_token * value:
                break
            if i != counts[b] or i >= self.max_nodes:  # a row's nodes join in order (its probabilities never rise)
                continue
            counts[b] += 1
            value += p
            cost += per_token
        return counts


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
