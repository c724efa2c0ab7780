"""The drafters' base class `Drafter`; the drafters over the engine's rows that need no model of their own kind:
none (`ar`), prompt lookup, an independent draft model; the per-row state helper `RetiringRows`; and prefilling rows
in chunks (the engine and the drafters share it)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from draftwise.engine.keyed import row_draws
from draftwise.engine.sampler import sample_rows, warp_rows, warped_and_raw
from draftwise.engine.grammar import mask_rows, push_rows
from draftwise.models.runner import ModelRunner, full_vocabulary_logits
from draftwise.drafters.policies import FixedLength, LengthPolicy
from draftwise.engine.sampling import SamplingConfig, argmax_last
from draftwise.engine.protocols import PREFILL_CHUNK, PREFILL_TOKENS, RowsDraft, empty_draft, one_hot_draft, pad_rows
from draftwise.engine.rows import Row, cut_at_eos


CATCH_UP = 256  # prompt tokens a draft model is fed per step for a row admitted with a longer prompt
LAZY_PROMPT = 16  # a row this many tokens behind its sequence (a prompt not yet fed) is fed them as a prompt first


class Drafter:
    """The base of every rows drafter (engine.protocols.RowsDrafter): a drafter writes `propose` and overrides only
    the hooks it needs; the rest do nothing. The engine keeps its rows contiguous, so a drafter that holds per-row
    state follows them: `admit` (a request takes row `row`), `rewind` (row keeps its first `keep` tokens), `move_row`
    (row src becomes row dst) and `release` (rows from `live` on are gone). `observe` hands a drafter that
    `wants_features` the target's states at positions start.. of a row (of `feature_layers`; () the last).

    `update` is the feedback hook (HF transformers' CandidateGenerator has `update_candidate_strategy`): after each
    step the engine tells the drafter how many of its drafted tokens each row kept, so a drafter may adapt what it
    proposes next (the default ignores it).

    Token trees: `propose(rows, limits, tree_nodes=n, tree_min_prob=p)` asks for trees of at most n nodes a row,
    grown no lower than path probability p; the engine gives them (its TreeBudget's figures for the step) only when
    the method grows trees: chains are the two-argument call."""

    calls = 0  # drafting forwards so far (a model's drafter counts its runner's; lookups run none)
    wants_features = False  # the verify forward hands it the target's states (`observe`)
    feature_layers: tuple[int, ...] = ()  # the target layers those states come from (EAGLE-3: several; () the last)

    def propose(self, rows: Sequence[Row], limits: Sequence[int], *, tree_nodes: int = 0,
                tree_min_prob: float = 0.0) -> RowsDraft:
        """Up to limits[b] drafted tokens for row b (a chain), or a token tree of at most `tree_nodes` nodes."""
        raise NotImplementedError

    def update(self, rows: Sequence[Row], accepted: Sequence[int]) -> None:
        """After a step: row b (its sequence now holds what it committed) kept accepted[b] of its drafted tokens."""

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None:
        """A request's prompt takes row `row` (its last token is fed by the first decoding step)."""

    def rewind(self, row: int, keep: int) -> None:
        """Row `row` keeps its first `keep` tokens."""

    def move_row(self, src: int, dst: int) -> None:
        """Row `src` becomes row `dst` (the engine fills a finished row with its last one)."""

    def release(self, live: int) -> None:
        """Rows `live` and after are gone."""

    def observe(self, row: int, start: int, states: torch.Tensor) -> None:
        """The target's states at positions start.. of row `row` (for a drafter that `wants_features`)."""


class WrappingDrafter(Drafter):
    """A drafter around another (`inner`): it counts the inner one's calls, wants its features and follows its rows
    through it. A subclass writes `propose` and adds what its own state needs to the hooks."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def calls(self) -> int:
        return self.inner.calls

    @property
    def wants_features(self) -> bool:
        return self.inner.wants_features

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.inner.feature_layers)

    def update(self, rows: Sequence[Row], accepted: Sequence[int]) -> None:
        self.inner.update(rows, accepted)

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None:
        self.inner.admit(row, prompt_ids)

    def rewind(self, row: int, keep: int) -> None:
        self.inner.rewind(row, keep)

    def move_row(self, src: int, dst: int) -> None:
        self.inner.move_row(src, dst)

    def release(self, live: int) -> None:
        self.inner.release(live)

    def observe(self, row: int, start: int, states: torch.Tensor) -> None:
        self.inner.observe(row, start, states)


class NoRowsDrafter(Drafter):
    """Proposes nothing: every step is one target token per row (`ar`)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.empty_draft: dict[int, RowsDraft] = {}

    def propose(self, rows, limits) -> RowsDraft:
        n = len(rows)
        if n not in self.empty_draft:
            self.empty_draft[n] = empty_draft(n, self.vocab_size, self.device)
        return self.empty_draft[n]


class LookupRowsDrafter(NoRowsDrafter):
    """Prompt lookup per row (n-gram continuation of the row's own text), one-hot draft distributions."""

    def __init__(self, vocab_size: int, device: torch.device, *, max_ngram: int, min_ngram: int,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        super().__init__(vocab_size, device)
        self.ngrams = {"max_ngram": max_ngram, "min_ngram": min_ngram}
        self.eos = eos_token_ids

    def propose(self, rows, limits) -> RowsDraft:
        from draftwise.drafters.lookup import prompt_lookup

        # a continuation stops after an end-of-sequence token: nothing past it is drafted
        found = [cut_at_eos(prompt_lookup(r.sequence, limit, **self.ngrams), self.eos) for r, limit in zip(rows, limits)]
        return one_hot_draft(found, self.vocab_size, self.device)


class RetiringRows:
    """Per-row state of a rows drafter that outlives its row: when a request leaves (its row is reused,
    overwritten by a move, or dropped), `retire(state)` receives what it held."""

    def __init__(self) -> None:
        self.rows: list[Any] = []

    def put(self, row: int, state: Any) -> None:
        while len(self.rows) <= row:
            self.rows.append(None)
        self._retire(row)
        self.rows[row] = state

    def move_row(self, src: int, dst: int) -> None:
        self._retire(dst)
        self.rows[dst] = self.rows[src]
        self.rows[src] = None

    def release(self, live: int) -> None:
        for row in range(live, len(self.rows)):
            self._retire(row)
        del self.rows[live:]

    def retire(self, state: Any) -> None:
        raise NotImplementedError

    def _retire(self, row: int) -> None:
        state = self.rows[row] if row < len(self.rows) else None
        if state is not None:
            self.retire(state)
            self.rows[row] = None


class ModelRowsDrafter(Drafter):
    """An independent draft model over rows: each row samples from its own warped distribution with its
    keyed draws. A row stops drafting at EOS, at its limit, or when its length policy says so."""

    def __init__(self, runner: ModelRunner, vocab_size: int, *, eos_token_ids: frozenset[int] = frozenset(),
                 keep_raw: bool = False, policy: LengthPolicy | None = None) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=runner.device)
        self.policy = policy or FixedLength()
        self.keep_raw = keep_raw
        self.prefill_calls = 0

    @property
    def calls(self) -> int:
        """Drafting forwards (prefill forwards are counted apart, in `prefill_calls`)."""
        return self.runner.calls - self.prefill_calls

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None:
        # the prompt is fed when the row first drafts (`pending_feed`): a row the engine never lets draft (a batch
        # where no drafted token pays, SV / adaptive-verify) costs the draft model nothing
        self.runner.cache.reset_row(row)

    def propose(self, rows: Sequence[Row], limits: Sequence[int], *, tree_nodes: int = 0,
                tree_min_prob: float = 0.0) -> RowsDraft:
        width = max(limits, default=0)
        n = len(rows)
        if width == 0:
            return empty_draft(n, self.vocab_size, self.runner.device)
        if tree_nodes > 0:
            return self._propose_trees(rows, limits, tree_nodes, tree_min_prob)
        # 1 or 2 tokens a row; a row admitted with a long prompt feeds it CATCH_UP tokens a step and drafts
        # nothing until its cache has caught up, so its prompt never stalls the other rows' step
        feed, counts, limits = self.pending_feed(rows, limits)
        device = self.runner.device
        needs_hidden = self.policy.needs_hidden
        at = torch.tensor(counts, device=device)[:, None] - 1  # [rows, 1] the last fed position

        def scored(out) -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden = out.hidden.gather(1, at[:, :, None].expand(-1, -1, out.hidden.shape[-1]))[:, -1] \
                if needs_hidden else None  # [rows, hidden] at the last fed position
            return out.logits[:, -1], hidden

        one = torch.zeros(n, 1, dtype=torch.long, device=device)  # a drafted token's feed: position 0 of each row

        def advance(token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            nonlocal at
            at = one
            return scored(self.runner.forward_rows(token[:, None], [1] * n, logits_at=one, hidden=needs_hidden))

        first = scored(self.runner.forward_rows(feed, counts, logits_at=at, hidden=needs_hidden))
        return draft_chains(rows, limits, first, advance, vocab_size=self.vocab_size, eos=self.eos,
                            policy=self.policy, keep_raw=self.keep_raw)

    def _propose_trees(self, rows: Sequence[Row], limits: Sequence[int], nodes: int, min_prob: float) -> RowsDraft:
        """EAGLE-2's dynamic tree from the draft model's log-probabilities (tree_growth.grow_on), depth at most each
        row's limit; deterministic candidates, so exact at any temperature."""
        from draftwise.drafters.tree_growth import grow_on, tree_draft

        feed, counts, limits = self.pending_feed(rows, limits)
        at = torch.tensor(counts, device=self.runner.device)[:, None] - 1
        root = self.runner.forward_rows(feed, counts, logits_at=at).logits[:, -1]  # [rows, vocab]

        def expand(tokens, fed_counts, mask, request):
            return torch.log_softmax(self.runner.forward_rows(tokens, fed_counts, tree=mask).logits.float(), -1)

        tokens, parents, scores = grow_on(self.runner, torch.log_softmax(root.float(), -1), expand,
                                          budgets=[nodes if limit > 0 else 0 for limit in limits],
                                          max_depths=limits, stop_tokens=frozenset(self.eos.tolist()),
                                          min_probs=[min_prob] * len(rows))
        return tree_draft(tokens, parents, self.vocab_size, self.runner.device, scores)

    def pending_feed(self, rows, limits: Sequence[int]) -> tuple[torch.Tensor, list[int], list[int]]:
        """Each row's tokens not yet in its cache, at most CATCH_UP (right-padded [rows, width] and counts), and the
        rows' drafting limits: 0 for a row admitted with a long prompt that is still catching up.

        When every row is catching up, no batch-mate's step is held up by feeding them now: their whole prompts
        go in at once, in prefill chunks (counted in `prefill_calls`), and they draft in this very step. (Fed
        CATCH_UP a step, a 7.6k-token prompt drafted nothing for its first 30 steps: a request for 16 tokens
        drafted nothing at all.)"""
        # a prompt not yet fed (admission feeds nothing) goes in as a prompt
        self.prefill_calls += prefill_unfed(self.runner, rows, max_behind=CATCH_UP + 1)
        lengths = self.runner.lengths
        behind = [len(r.sequence) - lengths[b] > CATCH_UP for b, r in enumerate(rows)]
        if behind and all(behind):
            self.prefill_calls += prefill_unfed(self.runner, rows)
            lengths = self.runner.lengths
            behind = [False] * len(rows)
        feed, counts = pad_rows([r.sequence[lengths[b]: lengths[b] + CATCH_UP] for b, r in enumerate(rows)])
        return feed, counts, [0 if late else limit for late, limit in zip(behind, limits)]

    def next_distribution(self, contexts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(unwarped, warped) draft distributions after each row's context: one forward over the rows."""
        lengths = self.runner.lengths
        for b, context in enumerate(contexts):  # rows that drafted past their own stop hold extra tokens
            if lengths[b] >= len(context):
                self.runner.trim_row(b, len(context) - 1)
        feed, counts = pad_rows([context[lengths[b]:] for b, context in enumerate(contexts)])
        at = torch.tensor(counts, device=self.runner.device)[:, None] - 1
        logits = self.runner.forward_rows(feed, counts, logits_at=at).logits[:, -1]  # [rows, vocab]
        warped, raw = warped_and_raw(logits, configs)
        return raw, warped

    def rewind(self, row: int, keep: int) -> None:
        # the last drafted token was never fed, so the row may already be shorter than `keep`
        self.runner.trim_row(row, min(keep, self.runner.lengths[row]))

    def move_row(self, src: int, dst: int) -> None:
        self.runner.cache.move_row(src, dst)

    def release(self, live: int) -> None:
        self.runner.cache.drop_rows(live)
        self.runner.cache.fit()


def draft_chains(rows: Sequence[Row], limits: Sequence[int], first: tuple[torch.Tensor, torch.Tensor | None],
                 advance: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]], *, vocab_size: int,
                 eos: torch.Tensor, policy: LengthPolicy, keep_raw: bool = False, ids: torch.Tensor | None = None
                 ) -> RowsDraft:
    """The draft loop of every model-based chain drafter (a draft model, an EAGLE head): up to max(limits) tokens
    per row, each row sampling from its own warped distribution with its keyed draws (the token at position t from
    (seed, t) alone; Gumbel-coupled rows with the target's noise at t). A row stops at its limit,
    after drafting EOS, or when its length policy says so.

    first: (logits [rows, V], the drafter's state behind them [rows, H] or None) scoring each row's first drafted
    token; V is the vocabulary, or the columns `ids` names (a head's smaller draft vocabulary, zero probability
    elsewhere). advance(tokens [rows]) feeds every row its drafted token and returns the next (logits, state).
    When every row is greedy (and nothing reads the distributions: no grammar, no unwarped copy kept, no verifier
    policy) a token is the argmax and the draft carries no distributions (one-hot, `RowsDraft.probs` None)."""
    n = len(rows)
    width = max(limits, default=0)
    device = first[0].device
    configs = [r.request.sampling for r in rows]
    greedy = [c.greedy for c in configs]
    draws = None  # the rows' keyed draws (engine.keyed), built when a row samples
    grammar = any(getattr(r, "grammar", None) is not None for r in rows)
    fast = all(greedy) and not keep_raw and not policy.needs_hidden and not grammar
    # which rows still draft, and how many tokens each has drafted, are kept on the host: each step's tokens and
    # stop flags come over in one copy each, rather than a tensor op per condition and a read-back per step
    active = [limit > 0 for limit in limits]
    drafted = [0] * n
    stop_tokens = frozenset(eos.tolist())
    tokens, probs, raws, verdicts = [], [], [], []
    policy.start(n, device)
    logits, state = first
    for step in range(width):
        raw = None
        if fast:  # the argmax only: no full-vocabulary tensor
            if policy.needs_raw:  # stop rules read the max / entropy: over V, the same as over the vocabulary
                raw = torch.softmax(logits.float(), dim=-1)
                active = _unstopped(active, policy.stop_before(raw))
            pick = argmax_last(logits)  # [rows]
            token = pick if ids is None else ids.index_select(0, pick)
        else:
            # zero probability outside a head's draft vocabulary (and past a padded target vocabulary): exact
            full = logits if ids is None else full_vocabulary_logits(logits, ids, vocab_size)  # [rows, vocab]
            if grammar:  # a grammar row drafts only what it allows
                full, allowed = mask_rows(rows, full, torch.tensor(active, device=device))
                active = allowed.tolist()
            if keep_raw or policy.needs_raw:  # [rows, vocab] each
                step_probs, raw = warped_and_raw(full, configs)
            else:
                step_probs = warp_rows(full, configs)
            if policy.needs_raw:
                active = _unstopped(active, policy.stop_before(raw))
            if keep_raw:
                raws.append(raw)
            if draws is None and not all(greedy):
                draws = row_draws(rows, device)
            # the token at position len(sequence) + step: keyed there (Gumbel rows share the target's noise)
            token = argmax_last(step_probs) if draws is None else sample_rows(step_probs, draws, step, greedy)
            if grammar:
                active = push_rows(rows, token, torch.tensor(active, device=device)).tolist()
            probs.append(step_probs)
        drafted = [d + a for d, a in zip(drafted, active)]
        tokens.append(token)
        stop, verdict = policy.after(state if policy.needs_hidden else None, token, raw)
        if verdict is not None:
            verdicts.append(verdict)
        # a row stops after drafting EOS, on its policy's word, or at its limit; the rest go on
        active = [a and t not in stop_tokens and d < limit
                  for a, t, d, limit in zip(_unstopped(active, stop), token.tolist(), drafted, limits)]
        if step + 1 < width:
            if not any(active):
                break
            logits, state = advance(token)
    k = max(drafted, default=0)
    if k == 0:
        return empty_draft(n, vocab_size, device)
    return RowsDraft(torch.stack(tokens, 1)[:, :k], None if fast else torch.stack(probs, 1)[:, :k], drafted,
                     torch.stack(raws, 1)[:, :k] if keep_raw else None,
                     torch.stack(verdicts, 1)[:, :k] if verdicts else None, vocab_size=vocab_size)


def _unstopped(active: list[bool], stop: torch.Tensor | None) -> list[bool]:
    """`active` without the rows a length policy stops (`stop`: [rows] bool, None when it stops none)."""
    if stop is None:
        return active
    return [a and not s for a, s in zip(active, stop.tolist())]


def prefill_unfed(runner, rows: Sequence[Row], *, max_behind: int | None = None) -> int:
    """Feed each row whose cache is more than LAZY_PROMPT tokens behind its sequence (at most `max_behind`) all its
    unfed tokens but the last (which the step's own forward feeds) in prefill chunks; returns the forwards taken.
    How a drafter's model, or SV's companion, catches up on a prompt it was not fed at admission."""
    calls = 0
    lengths = runner.lengths
    for b, r in enumerate(rows):
        if LAZY_PROMPT < len(r.sequence) - lengths[b] <= (max_behind or len(r.sequence)):
            calls += len(prefill_row(runner, b, r.sequence[lengths[b]: len(r.sequence) - 1]))
    return calls


def prefill_row(runner: ModelRunner, row: int, tokens: Sequence[int], *, hidden: bool = False) -> list[torch.Tensor]:
    """Feed `tokens` to one row in chunks (one forward each); returns the last-layer states per chunk
    when `hidden`, else an empty tensor per chunk."""
    states, _ = prefill_rows(runner, row, [tokens], hidden=hidden)
    return states[0]


def prefill_rows(runner: ModelRunner, begin: int, prompts: Sequence[Sequence[int]], *, hidden: bool = False
                 ) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Feed prompts[i] to row `begin + i`, every row with tokens left in the same forward, chunk by chunk.

    `prompts` must be sorted longest first (the rows still feeding are then always a leading block).
    Returns per row its last-layer states per chunk (`hidden`; else empty tensors) and the forwards it
    took part in."""
    lengths = [len(p) for p in prompts]
    assert lengths == sorted(lengths, reverse=True), "prefill_rows needs prompts sorted longest first"
    states: list[list[torch.Tensor]] = [[] for _ in prompts]
    calls = [0] * len(prompts)
    start = [0] * len(prompts)
    while True:
        active = [i for i, n in enumerate(lengths) if start[i] < n]  # a leading block: sorted longest first
        if not active:
            break
        chunk = max(64, min(PREFILL_CHUNK, PREFILL_TOKENS // len(active)))
        pieces = [list(prompts[i][start[i]: start[i] + chunk]) for i in active]
        tokens, counts = pad_rows(pieces)
        out = runner.forward_rows(tokens, counts, begin=begin, logits_at=torch.zeros(len(active), 1, dtype=torch.long),
                                  hidden=hidden, prompt=True)
        for b, i in enumerate(active):
            states[i].append(out.hidden[b, : counts[b]] if hidden else tokens[b, :0])
            start[i] += counts[b]
            calls[i] += 1
    return states, calls
