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

Drafters grow the trees (`drafters.tree_growth`: EAGLE-2's dynamic tree for the draft model and the EAGLE head; the
suffix tries' `suffix.SuffixTrie.speculate_tree` for suffix decoding); `TreeBudget` here says how many nodes pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from draftwise.engine.keyed import Draws, as_draws
from draftwise.engine.sampler import RowsAcceptance, accept_own_draws
from draftwise.errors import DraftwiseError
from draftwise.models.runner import TreeMask
from draftwise.engine.sampling import argmax_last


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (a child of the pending token has depth 1)."""
    out: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise DraftwiseError(f"tree node {i} has parent {p}: parents must come before their children")
        out.append(1 if p < 0 else out[p] + 1)
    return out


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

    target_probs [rows, 1 + k, vocab]: the warped target distribution at each slot (for greedy rows any scores with
    the target's argmax: their logits).
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
