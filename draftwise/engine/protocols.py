"""The parts the engine calls, as protocols with their declared fields: a drafter over rows (`RowsDrafter`, which
returns a `RowsDraft`) and the select phase (`VerifySelector`; `VerifyAll` verifies every drafted token), the acceptance rule (`TargetRule`, called with a
`StepDistributions`; the rules themselves are in rules/). Length policies are `drafters.policies.LengthPolicy`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from draftwise.engine.rows import Row

# How prompts are fed, by the engine's scheduler and by a drafter into its own cache (drafters.base.prefill_rows).
PREFILL_CHUNK = 128  # prompt tokens per row and prefill forward: bounds a forward's time, which a request arriving
# meanwhile waits for, at a small cost to the long prompt (benchmarks/long_prompt.py measures both)
PREFILL_TOKENS = 4096  # prompt tokens per prefill forward over several rows (each row gets at least 64)


@dataclass(frozen=True)
class RowsDraft:
    tokens: torch.Tensor  # [rows, k] int64, padded past counts[b]
    # [rows, k, vocab] the distributions the tokens were drawn from; None: one-hot at `tokens` (lookup, suffix tries,
    # greedy model drafts, beams), built only when a consumer reads `probs`
    q: torch.Tensor | None
    counts: list[int]  # [rows] drafted tokens per row (k = max)
    draft_raw: torch.Tensor | None = None  # [rows, k, vocab] unwarped, when the rule reads them
    verdicts: torch.Tensor | None = None  # [rows, k] bool: a verifier's word per drafted token (SPRINTER)
    companion_probs: torch.Tensor | None = None  # [rows, k + 1, vocab] a companion's warped distributions (SV)
    companion_raw: torch.Tensor | None = None  # [rows, k + 1, vocab] the same, unwarped
    joint: torch.Tensor | None = None  # [rows, k] log q(x_1..x_j) of a beam drafter (MTAD)
    # token trees (tree.py): per row, each node's parent (-1: the pending token), parents before children; the
    # nodes are deterministic candidates (`probs` then has no vocabulary columns). None: each row's draft is a chain
    parents: tuple[tuple[int, ...], ...] | None = None
    # per row, each tree node's path probability under the drafter (best first: any prefix is the best tree of its
    # size); the engine's TreeBudget cuts each row's tree where a node no longer pays for its verification
    scores: tuple[tuple[float, ...], ...] | None = None
    # every row's chain holds deterministic candidates (lookup, suffix tries: one-hot `probs`); under the exact rule
    # the engine then draws the target's token at each position and accepts a candidate equal to it, one uniform
    # per committed token (tree.accept_tree on chains): a row's tokens do not depend on how many were drafted
    deterministic: bool = False
    vocab_size: int = 0  # the vocabulary `probs` spans when `q` is None

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def probs(self) -> torch.Tensor:
        """[rows, k, vocab] the draft distributions: `q`, or one-hot at the tokens (built once, on first read)."""
        if self.q is not None:
            return self.q
        dense = self.__dict__.get("_one_hot")
        if dense is None:
            if not self.vocab_size:
                raise ValueError("a draft without distributions needs its vocab_size")
            dense = torch.zeros(*self.tokens.shape, self.vocab_size, device=self.tokens.device).scatter_(
                -1, self.tokens[..., None], 1.0)
            object.__setattr__(self, "_one_hot", dense)
        return dense

    def prefix(self, counts: Sequence[int]) -> "RowsDraft":
        """The draft cut to its first counts[b] tokens per row (the select phase's choice; of a tree, its first
        counts[b] nodes, which hold their own ancestors)."""
        counts = [min(int(c), d) for c, d in zip(counts, self.counts)]
        k = max(counts, default=0)

        def cut(t: torch.Tensor | None, width: int = k) -> torch.Tensor | None:
            return None if t is None else t[:, :width]

        parents = None if self.parents is None else tuple(row[:c] for row, c in zip(self.parents, counts))
        scores = None if self.scores is None else tuple(row[:c] for row, c in zip(self.scores, counts))
        return RowsDraft(self.tokens[:, :k], cut(self.q), counts, cut(self.draft_raw), cut(self.verdicts),
                         cut(self.companion_probs, k + 1), cut(self.companion_raw, k + 1), cut(self.joint), parents,
                         scores, self.deterministic, self.vocab_size)


@dataclass(frozen=True)
class StepDistributions:
    """What a rule may read at one verification step with k drafted tokens.

    The batched engine passes the same fields with a leading rows dimension ([rows, k], [rows, k, vocab],
    ...), positions past a row's `num_drafted` being padding; rules index the last dimensions only, so
    one call serves a batch.
    """

    draft_tokens: torch.Tensor  # [k] int64
    draft_probs: torch.Tensor  # [k, vocab] warped draft distributions the tokens were drawn from
    target_probs: torch.Tensor  # [k + 1, vocab] warped target distributions (last = bonus position)
    target_logits: torch.Tensor  # [k + 1, vocab] raw target logits, for rules that read unwarped probs
    draft_raw: torch.Tensor | None = None  # [k, vocab] unwarped draft distributions (cascade rules), if kept
    greedy: bool | torch.Tensor = False  # temperature 0: one flag, or per row ([rows] bool) in the engine
    verdicts: torch.Tensor | None = None  # [k] bool, SPRINTER's verifier verdicts
    draft_joint: torch.Tensor | None = None  # [k] log q(x_{1:j}), MTAD's beam drafter
    num_drafted: torch.Tensor | None = None  # [rows] drafted tokens per row (batched steps only)


class TargetRule(Protocol):
    """What the engine calls on a rule, and what a rule declares (defaults in `rules.acceptance.Rule`)."""

    name: str
    exact: bool  # pi = target (Algorithm 1): deterministic drafts may take the target's own draws, trees are allowed
    coupling: str  # how draft and target randomness are coupled (keyed.COUPLINGS), read for an exact rule only
    bonus_from_pi: bool  # Algorithm 4's bonus: pi = T(q, p) after the last drafted token (the drafter's
    #                      `next_distribution` gives q there) and `bonus(q, q_warped, p, p_warped, greedy)` mixes them
    needs_draft_raw: bool  # reads the draft's unwarped distributions (StepDistributions.draft_raw)
    cuts_draft: bool  # keeps a prefix of each draft after verification: `prefix(step, greedy) -> [rows] counts`

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        """pi for the k drafted positions: [k, vocab]."""
        ...


class RowsDrafter(Protocol):
    """Proposes per-row drafts and follows the rows the engine keeps (admit / move / rewind). The package's drafters
    extend drafters.base.Drafter, which does nothing in every hook a drafter leaves out."""

    calls: int
    wants_features: bool  # the verify forward hands it the target's states (`observe`)
    feature_layers: tuple[int, ...]  # which target layers those states come from (EAGLE-3: several; () the last)

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None: ...

    def propose(self, rows: Sequence[Row], limits: Sequence[int], *, tree_nodes: int = 0,
                tree_min_prob: float = 0.0) -> RowsDraft:
        """Chains of at most limits[b] tokens; with tree_nodes > 0 (a method that grows trees) trees of at most that
        many nodes a row, depth at most limits[b], no node's path probability below tree_min_prob."""

    def update(self, rows: Sequence[Row], accepted: Sequence[int]) -> None:
        """The feedback hook, after a step: row b kept accepted[b] of its drafted tokens."""

    def rewind(self, row: int, keep: int) -> None: ...

    def move_row(self, src: int, dst: int) -> None: ...

    def release(self, live: int) -> None: ...

    def observe(self, row: int, start: int, states: torch.Tensor) -> None: ...


@runtime_checkable
class ScoringDrafter(RowsDrafter, Protocol):
    """A drafter a rule with `bonus_from_pi` needs (the cascades): it also scores the token after a context."""

    def next_distribution(self, contexts: Sequence[Sequence[int]], configs: Sequence[Any]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(unwarped, warped) [rows, vocab] distributions of the token after each row's context; NaN rows where it
        cannot score (the engine then takes the target's distribution)."""


class VerifySelector(Protocol):
    """The select phase: how many of each row's drafted tokens the target verifies (a prefix; the
    rest are discarded). Reads draft-side information only, so exact rules stay exact."""

    discards: bool  # may discard drafted tokens unverified (a request's stats then report what was proposed)
    # `observe` reads the target's distributions (False: a greedy step may never build them; a selector that does
    # not say is taken to read them)
    observes: bool

    def limits(self, rows: Sequence[Row], limits: list[int]) -> list[int]:
        """Each row's drafting limit this step (at most the engine's)."""

    def select(self, rows: Sequence[Row], draft: RowsDraft) -> list[int]: ...

    def observe(self, rows: Sequence[Row], draft: RowsDraft, target_probs: torch.Tensor,
                target_logits: torch.Tensor, num_accepted: Sequence[int]) -> None:
        """After acceptance: what the target said (history-based selectors and profiling learn here)."""


class VerifyAll:
    """The default select phase: every drafted token is verified."""

    discards = False
    observes = False

    def limits(self, rows: Sequence[Row], limits: list[int]) -> list[int]:
        return limits

    def select(self, rows: Sequence[Row], draft: RowsDraft) -> list[int]:
        return draft.counts

    def observe(self, rows, draft, target_probs, target_logits, num_accepted) -> None:
        pass


def empty_draft(rows: int, vocab: int, device: torch.device) -> RowsDraft:
    return RowsDraft(torch.zeros(rows, 0, dtype=torch.long, device=device), None, [0] * rows, vocab_size=vocab)


def one_hot_draft(found: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> RowsDraft:
    """Deterministic drafts (lookup, suffix tries): each row's tokens, one-hot (no distributions built)."""
    tokens, counts = pad_rows(found)
    if tokens.shape[1] == 0:
        return empty_draft(len(found), vocab_size, device)
    return RowsDraft(tokens.to(device), None, counts, deterministic=True, vocab_size=vocab_size)


def pad_rows(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    """Right-padded token rows (host) and their lengths: [rows, longest] int64, [rows]."""
    counts = [len(seq) for seq in sequences]
    out = torch.zeros(len(counts), max(counts, default=0), dtype=torch.long)
    for b, seq in enumerate(sequences):
        out[b, : counts[b]] = torch.as_tensor(list(seq), dtype=torch.long)
    return out, counts
