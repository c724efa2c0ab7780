"""The select phase and the companion: Speculative Verification (Kim et al.) and its baselines.

A method here is still a triple (drafter, length policy, acceptance rule) plus a *selector*:
after the draft, the selector says how many of each row's drafted tokens the target verifies
(a prefix; the rest are discarded). It reads draft-side information only, so the exact rule
keeps the target's distribution whatever it chooses.

- `CompanionRowsDrafter` (`drafters.companion`): any model drafter, plus a companion model that reads the drafted
  tokens in one forward per step (its own KV cache rows) and reports its distributions at
  every drafted position. It never changes which tokens are sampled.
- `GoodputSelector` (`sv`): P(accept | S, A) from a profile, then §5's batch scheduler.
- `HistorySelector` (`adaptive-verify`): the same scheduler, with each slot scored by the
  running product of its request's per-position acceptance rates so far (vLLM's adaptive
  verification: history, no companion).
- `SmartSpecSelector` (`smartspec`, Liu et al. 2024): a moving average of each request's
  acceptance rate picks one draft length for the batch that maximises estimated goodput; the
  drafter drafts only that many.
- `StagedRowsDrafter` (`staged`, Spector & Re 2023; `drafters.companion`): the companion verifies the draft first by
  speculative sampling; what it keeps (plus its correction) goes to the target with the
  companion's distributions as the proposal, which keeps the output exact.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from draftwise.engine.protocols import RowsDraft
from draftwise.engine.rows import Row
from draftwise.selectors.sv import LatencyModel, AcceptanceTable, indicators, schedule


def indicator_pair(rows: Sequence[Row], draft: RowsDraft) -> tuple[torch.Tensor, torch.Tensor]:
    """S and A [rows, k] for a companion draft: the warped (drawn-from) distributions for sampling rows,
    the unwarped ones for greedy rows (one-hot distributions carry no information)."""
    k = draft.width
    greedy = torch.tensor([r.request.sampling.greedy for r in rows], device=draft.tokens.device)[:, None, None]
    if bool(greedy.any()):
        if draft.draft_raw is None or draft.companion_raw is None:
            raise RuntimeError("greedy rows need the draft's and the companion's unwarped distributions")
        q_d = torch.where(greedy, draft.draft_raw, draft.probs)
        q_c = torch.where(greedy, draft.companion_raw[:, :k], draft.companion_probs[:, :k])
    else:
        q_d, q_c = draft.probs, draft.companion_probs[:, :k]
    return indicators(q_d, q_c, draft.tokens)


QUIET_AFTER = 4  # a request whose last this many selections were all 0 goes quiet (drafts nothing)
PROBE_EVERY = 16  # a request that verified nothing in its last selections drafts again in every this-many-th step
BEFORE_DRAW_TOP = 32  # likeliest draft tokens scored one by one in the before-draw estimate


def _masked(values: torch.Tensor, counts: Sequence[int]) -> list[list[float]]:
    host = values.tolist()
    return [row[:c] for row, c in zip(host, counts)]


class GoodputSelector:
    """SV: estimate each drafted token's acceptance from (S, A), then schedule the batch (§5)."""

    discards = True  # the select phase may drop drafted tokens unverified
    observes = True

    uses_companion = True

    def __init__(self, table: AcceptanceTable, latency: LatencyModel, *, lookahead: int | None = 1,
                 memory: int = QUIET_AFTER, probe: int = PROBE_EVERY) -> None:
        self.table = table
        self.latency = latency
        self.last_estimates: list[list[float]] = []  # per row, for tests and diagnostics
        self._sa: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's (S, A), read twice
        self._actual: torch.Tensor | None = None  # this step's P(accept | S, A) from the actual A
        self.lookahead = lookahead  # None: always draft the full gamma
        self.selected: dict[int, deque] = {}  # request -> its last `memory` selections
        self.memory = memory
        self.probe = probe  # 0: a request that verified nothing lately still drafts `lookahead` tokens a step
        self.batch_at: dict[int, int] = {}  # request -> the batch size when its last selection was made
        self.steps = 0  # steps seen: every quiet request probes in the same steps (see `limits`)
        self._could_pay: dict[tuple[int, int], bool] = {}  # (batch size, longest draft) -> see `could_pay`
        self._mean_rate: float | None = None  # the profile's, once read (`mean_rate`)

    def limits(self, rows: Sequence[Row], limits: list[int]) -> list[int]:
        """Draft no more than the row verified lately, plus `lookahead`: tokens the scheduler keeps dropping
        are not worth drafting (a request starts at the full gamma and can grow by `lookahead` a step).

        A request whose last `memory` selections were all 0 (verifying costs more than it brings: at a batch where
        a verification forward is compute-bound, say) drafts nothing, so its steps cost what target-only decoding's
        do, except for a probe of `lookahead` tokens in every `probe`-th step and whenever the batch is smaller than
        at its last selection (verification got cheaper). The quiet requests probe together, in the same steps: the
        draft model runs for every row whenever one row drafts, so probes spread over the steps would run it in
        most of them; together, it runs once in `probe` steps and catches every row up in one wide forward.
        A quiet request does not probe at a batch size where even a draft the target accepted whole would not pay
        (`could_pay`): there the draft model would only be kept up to date for nothing. Nor does a new request
        draft at such a batch size (its first `memory` steps would otherwise draft the full limit for nothing); it
        starts drafting when the batch shrinks to one where drafting could pay. Where a whole draft could pay but
        a draft accepted at the selector's mean rate (`mean_rate`: the profile's, or the pooled history's) would
        not (`expected_pays`), a new request starts quiet: it probes with the quiet ones instead of drafting (and,
        for SV, running the companion) through its first `memory` steps.
        Reads only past selections, so exactness is untouched."""
        if self.lookahead is None:
            return limits
        self.steps += 1
        if len(self.selected) > len(rows):
            self._forget({row.id for row in rows})
        n = len(rows)
        out = []
        for row, limit in zip(rows, limits):
            history = self.selected.get(row.id)
            if not history:  # a new request drafts its full limit, unless at this batch no draft could pay
                if self.probe and not self.could_pay(n, limit):  # it drafts once the batch shrinks to where one could
                    out.append(0)
                    continue
                if not self.probe or self.expected_pays(n, limit):
                    out.append(limit)
                    continue
                history = self.selected[row.id] = deque([0] * self.memory, maxlen=self.memory)  # starts quiet
                self.batch_at[row.id] = n
            quiet = self.probe and len(history) == self.memory and not any(history)
            if quiet and ((self.steps % self.probe and n >= self.batch_at.get(row.id, n))
                          or not self.could_pay(n, min(limit, self.lookahead))):
                out.append(0)
                continue
            out.append(min(limit, max(history) + self.lookahead))
        return out

    def could_pay(self, n: int, longest: int) -> bool:
        """Whether, at a batch of `n` rows, drafting up to `longest` tokens a row that the target then accepted in
        full would commit tokens faster than target-only decoding, by the profile's latency model (the drafting
        forwards and the companion counted). False for longest 0."""
        key = (n, longest)
        if key not in self._could_pay:
            self._could_pay[key] = self._pays(n, longest, 1.0)
        return self._could_pay[key]

    def expected_pays(self, n: int, longest: int) -> bool:
        """`could_pay` for a draft the target accepts token by token at `mean_rate` (1 + a + ... + a^k tokens a row
        on average) instead of whole. True without a mean rate."""
        rate = self.mean_rate()
        return rate is None or self._pays(n, longest, rate)

    def _pays(self, n: int, longest: int, rate: float) -> bool:
        """Whether some draft length k <= `longest`, each drafted token accepted at `rate` given the ones before it,
        commits tokens faster at a batch of `n` rows than target-only decoding, by the latency model."""
        alone = 1.0 / self.latency.verify_ms([1] * n)
        step_ms = lambda k: self._drafting_ms(n, k) + self.latency.verify_ms([1 + k] * n)  # noqa: E731
        return any(sum(rate ** i for i in range(k + 1)) / step_ms(k) > alone for k in range(1, longest + 1))

    def mean_rate(self) -> float | None:
        """The acceptance probability of a drafted token on average, before a request has a history: the profile's
        mean over the tokens it was fitted on (None without a table: no start-quiet check). The mean, not the best
        cell's: a new request pays its first `memory` steps of drafting (and companion) whatever its tokens turn out
        to be; one whose draft does better than the mean is found by the probes."""
        if self.table is None:
            return None
        if self._mean_rate is None:
            self._mean_rate = self.table.overall_mean()
        return self._mean_rate

    def _drafting_ms(self, n: int, width: int) -> float:
        """The modelled time a step at a batch of `n` rows spends before verification: `width` drafting forwards
        and the companion (when this selector runs one)."""
        companion = self.latency.companion_ms(n) if self.uses_companion else 0.0
        return width * self.latency.draft_ms(n) + companion

    def _remember(self, rows: Sequence[Row], chosen: Sequence[int]) -> None:
        n = len(rows)
        for row, count in zip(rows, chosen):
            self.selected.setdefault(row.id, deque(maxlen=self.memory)).append(count)
            self.batch_at[row.id] = n
        if len(self.selected) > n:
            self._forget({row.id for row in rows})

    def _forget(self, live: set[int]) -> None:
        """Drop what finished requests left."""
        for table in (self.selected, self.batch_at):
            for gone in [r for r in table if r not in live]:
                del table[gone]

    def estimates(self, rows: Sequence[Row], draft: RowsDraft) -> list[list[float]]:
        """P(accept | S_i, A_i) per drafted token, from the token's actual A."""
        self._sa = indicator_pair(rows, draft)
        self._actual = self.table.lookup(*self._sa)  # [rows, k], read again by before_draw
        return _masked(self._actual, draft.counts)

    def before_draw(self, rows: Sequence[Row], draft: RowsDraft) -> list[list[float]] | None:
        """Token i's estimate before it was drawn: E_{t ~ q_i}[P(accept | S_i, A_i(t))], over the draft
        distribution it was drawn from (its BEFORE_DRAW_TOP likeliest tokens, the rest lumped into one
        with their summed masses). Exactness needs the decision to verify token i not to read token i;
        this reads only the distributions at i, which follow from the tokens before it. Greedy rows keep
        the actual A: their output is the target's argmax whatever is verified."""
        greedy = [r.request.sampling.greedy for r in rows]
        if all(greedy):
            return None
        k = draft.width
        q, c = draft.probs, draft.companion_probs[:, :k]  # the warped distributions the tokens came from
        s, a = self._sa if self._sa is not None else indicator_pair(rows, draft)  # S_i is known before t_i
        top_q, index = q.topk(min(BEFORE_DRAW_TOP, q.shape[-1]), dim=-1)  # [rows, k, m]
        top_c = c.gather(-1, index)
        a_top = torch.where(top_q > 0, top_c / top_q.clamp(min=1e-30), torch.ones_like(top_q)).clamp(max=1.0)
        p_top = self.table.lookup(s[..., None].expand_as(a_top).contiguous(), a_top.contiguous())
        rest_q = (1.0 - top_q.sum(-1)).clamp(min=0.0)  # [rows, k]
        rest_c = (1.0 - top_c.sum(-1)).clamp(min=0.0)
        a_rest = torch.where(rest_q > 1e-12, rest_c / rest_q.clamp(min=1e-12), torch.ones_like(rest_q)).clamp(max=1.0)
        expected = (p_top * top_q.double()).sum(-1) + rest_q.double() * self.table.lookup(s, a_rest)
        actual = self._actual if self._sa is not None else self.table.lookup(s, a)
        mixed = torch.where(torch.tensor(greedy, device=expected.device)[:, None], actual, expected)
        return _masked(mixed, draft.counts)

    def select(self, rows: Sequence[Row], draft: RowsDraft) -> list[int]:
        p = self.last_estimates = self.estimates(rows, draft)
        n = len(rows)  # drafting is paid already, but it is part of the step the goodput divides by
        fixed = self._drafting_ms(n, draft.width)  # once a step: the schedule's search calls the cost many times
        chosen = schedule(p, lambda chosen: fixed + self.latency.verify_ms([1 + c for c in chosen]),
                          self.before_draw(rows, draft))
        self._sa = None
        self._remember(rows, chosen)
        return chosen

    def observe(self, rows, draft, target_probs, target_logits, num_accepted) -> None:
        pass


class HistorySelector(GoodputSelector):
    """adaptive-verify: slot (request, position i) scores the running product of that request's
    acceptance rates at positions 1 .. i so far (reached -> accepted), with a prior of `prior_weight`
    pseudo-observations at the batch's pooled rate; the same goodput scheduler admits slots."""

    uses_companion = False

    def __init__(self, latency: LatencyModel, gamma: int, *, prior: float = 0.5, prior_weight: float = 2.0,
                 lookahead: int | None = 1, probe: int = PROBE_EVERY) -> None:
        super().__init__(None, latency, lookahead=lookahead, probe=probe)  # type: ignore[arg-type]
        self.gamma = gamma
        self.prior, self.prior_weight = prior, prior_weight
        self.reached: dict[int, list[int]] = {}
        self.accepted: dict[int, list[int]] = {}
        self.pooled = [[0, 0] for _ in range(gamma)]  # [accepted, reached] over every request

    def mean_rate(self) -> float:
        """The pooled rate at the first drafted position so far (with the prior), what a new request's first
        token is estimated at."""
        accepted, reached = self.pooled[0] if self.pooled else (0, 0)
        return (accepted + self.prior) / (reached + 1.0)

    def _rate(self, request: int, i: int) -> float:
        pooled_acc, pooled_reach = self.pooled[i]
        prior = (pooled_acc + self.prior) / (pooled_reach + 1.0)
        reached = self.reached.get(request, [0] * self.gamma)[i]
        accepted = self.accepted.get(request, [0] * self.gamma)[i]
        return (accepted + self.prior_weight * prior) / (reached + self.prior_weight)

    def estimates(self, rows, draft) -> list[list[float]]:
        return [[self._rate(r.id, i) for i in range(draft.counts[b])] for b, r in enumerate(rows)]

    def before_draw(self, rows, draft) -> None:
        return None  # history never reads the drafted tokens

    def observe(self, rows, draft, target_probs, target_logits, num_accepted) -> None:
        for b, row in enumerate(rows):
            reached = self.reached.setdefault(row.id, [0] * self.gamma)
            accepted = self.accepted.setdefault(row.id, [0] * self.gamma)
            for i in range(min(num_accepted[b] + 1, draft.counts[b])):  # positions the rule looked at
                reached[i] += 1
                self.pooled[i][1] += 1
                if i < num_accepted[b]:
                    accepted[i] += 1
                    self.pooled[i][0] += 1


class SmartSpecSelector:
    """SmartSpec: each request's acceptance rate as a moving average (EMA of accepted / verified per step);
    one draft length k for the batch maximises sum_r (1 - a_r^(k+1)) / (1 - a_r) over the step's
    estimated time (k drafting forwards + verifying k + 1 tokens a row). Everything drafted is verified."""

    discards = True  # the select phase may drop drafted tokens unverified
    observes = True

    def __init__(self, latency: LatencyModel, gamma: int, *, decay: float = 0.7, prior: float = 0.5) -> None:
        self.latency, self.gamma, self.decay, self.prior = latency, gamma, decay, prior
        self.rate: dict[int, float] = {}

    def limits(self, rows: Sequence[Row], limits: list[int]) -> list[int]:
        rates = [min(self.rate.get(r.id, self.prior), 0.999) for r in rows]
        n = len(rows)
        best_k, best = 0, -1.0
        for k in range(0, self.gamma + 1):
            expected = sum((1 - a ** (k + 1)) / (1 - a) for a in rates)
            value = expected / (k * self.latency.draft_ms(n) + self.latency.verify_ms([1 + k] * n))
            if value > best:
                best_k, best = k, value
        return [min(limit, best_k) for limit in limits]

    def select(self, rows, draft) -> list[int]:
        return list(draft.counts)

    def observe(self, rows, draft, target_probs, target_logits, num_accepted) -> None:
        for b, row in enumerate(rows):
            if draft.counts[b]:
                step_rate = num_accepted[b] / draft.counts[b]
                old = self.rate.get(row.id, self.prior)
                self.rate[row.id] = self.decay * old + (1 - self.decay) * step_rate
