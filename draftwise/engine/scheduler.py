"""The scheduler: which rows the engine holds and what prompt tokens each step feeds (admission, prefill
chunks and their time budget, rows starting to decode, rows freed). A mixin of `core.Engine`."""

from __future__ import annotations

import time

import torch

from draftwise.engine.protocols import PREFILL_CHUNK, PREFILL_TOKENS, pad_rows
from draftwise.engine.rows import Row, token_logprobs
from draftwise.models.kvcache import TRIM_AFTER_BYTES, release_heap


LONG_PIECE = 8  # a long prompt beside decoding rows advances this many tokens at least (a piece reads its whole
# context once, as the attention kernel's tile of 8 queries does: a token or two at a time would read it for each)
PREFILL_FORWARD_S = 0.25  # a forward of prompts alone is cut to about this long: a request arriving meanwhile waits
SHORT_PROMPT_STEPS = 8.0  # prompts fed at once beside decoding rows may cost this many decoding steps in a step,
SHORT_SHARE = 0.5  # or this share of the decoding rows' remaining steps when that is more (mean over the rows,
SHORT_HORIZON = 64  # each row's counted up to this many steps). At concurrency 16 (SmolLM2-135M bf16, Zen 5 with
# the AVX-512 attention, guidellm, 256-token prompts, one 120 s run each): 4 steps gave TTFT p50 2,405 ms at 273
# tokens/s (ITL 37 ms), 8 gave 739 ms at 273 (ITL 50 ms), 12 gave 979 ms at 252 (ITL 54 ms). Share 0.5 against
# 0.25 (4 steps, before that kernel): 709 against 2,115 ms
PREFILL_FIRST = 8  # prompt tokens per step beside decoding rows before their cost is measured
PREFILL_SHARED = 16  # prompt tokens per forward of an engine with nothing decoding while another engine decodes
DECODE_SAMPLE = 16  # one step in this many feeds no prompt tokens: it times a decoding step alone


def _average(old: float | None, new: float, weight: float) -> float:
    """A moving average: `new` counts `weight`, the past the rest (the first value stands alone)."""
    return new if old is None else (1.0 - weight) * old + weight * new



class Scheduler:
    """Admission and prefill scheduling of `core.Engine` (see its docstring)."""

    def _schedule(self) -> None:
        """Admit what fits; with nothing decoding here, one forward of prompts alone."""
        self._admit()
        if not self.live and self.prefilling:  # nothing decoding here: prompts in wide chunks (short ones when
            # another engine of the server decodes: its steps wait for this one's)
            wide = PREFILL_SHARED if self.others_decoding else PREFILL_TOKENS
            if self._idle_token_s is not None and not self.prefill_first:  # no longer than PREFILL_FORWARD_S at
                # the measured cost a token, though the prompt nearest its end may finish (a short one arriving
                # beside a long one starts now)
                nearest = min(row.unfed for row in self.prefilling)
                finish = nearest + len(self.prefilling) - 1 if nearest <= PREFILL_CHUNK else 0
                wide = max(LONG_PIECE, min(wide, max(int(PREFILL_FORWARD_S / self._idle_token_s), finish)))
            self._feed_prompts(self._prompt_plan(wide, min(wide, PREFILL_CHUNK)))

    def _shared_plan(self) -> list[int]:
        """The prompt tokens per prefilling row that a decoding step's forward feeds beside its rows."""
        return self._prompt_plan(self._prompt_budget(), PREFILL_CHUNK) if self.prefilling else []

    def _admit(self) -> None:
        """Take waiting requests while they fit; they prefill from the next forward on (see `step`). One whose
        prompt needs no forward (a stored prefix, a scored prefill, a one-token prompt) starts decoding now."""
        whole = False
        while self.waiting and len(self.live) + len(self.prefilling) < self.max_batch_size:
            candidate = self.waiting[0]
            held = self.admitted
            if self.kv_budget_tokens is not None and held:
                # each row may reach its prompt, its new tokens and a draft window; admit only what the cache's
                # buffers would then hold (pages a row, or the longest row's capacity in every row) within budget
                lengths = [len(r.request.prompt_ids) + r.request.max_new_tokens + self.draft_width + 1
                           for r in [*held, candidate]]
                if self.target.cache.slots_for(lengths) > self.kv_budget_tokens:
                    break
            row = self.waiting.pop(0)
            self.target.cache.reset_row(len(held))
            if self.prefixes is not None and row.request.params.prompt_logprobs is None:  # a stored prefix: no prefill
                wants = self.drafter.wants_features
                row.cached, features = self.prefixes.restore(row.request.prompt_ids[:-1], self.target.cache,
                                                             len(held), want_features=wants)
                row.fed = row.cached
                if features is not None:
                    row.prefill_states.append(features)
            row.counters.target_tokens += len(row.request.prompt_ids) - 1 - row.cached
            if row.request.params.prompt_logprobs is not None:
                self._prefill_scored(row, len(held))
            self.prefilling.append(row)
            whole = whole or row.unfed == 0
        if whole:  # rows fed by a forward start where it ran (`_feed_prompts`, `_end_step`)
            self._start_decoding()

    def _prompt_budget(self) -> int:
        """Prompt tokens the next step feeds beside the decoding rows, keyed on what waits. Prompts are fed at once
        (up to a chunk a forward), fewest unfed tokens first, while together they cost at most the allowance of
        `_short_allowance`: a short request does not queue behind a long prompt, a wave of requests starts as soon
        as the decoding rows can afford it, and those rows pay a share of their own remaining time. A prompt
        costing more than the allowance is long: the long ones share a time credit, each step earning
        `prefill_share` of a decoding step (more when more of them wait than rows decode), spent in pieces of at
        least LONG_PIECE tokens a prompt, so a long prompt advances without slowing the decoding rows by more
        than that share on average. Every `DECODE_SAMPLE`-th step (and before the first measure) feeds none, to
        time a decoding step alone."""
        self._steps += 1
        if self.prefill_first:
            return min(PREFILL_TOKENS, sum(min(row.unfed, PREFILL_CHUNK) for row in self.prefilling))
        if self._decode_s is None or self._steps % DECODE_SAMPLE == 0:
            return 0
        if self._prompt_token_s is None:
            return PREFILL_FIRST
        cost = max(self._prompt_token_s, 1e-9)
        allowance = self._short_allowance()
        now, spent, waiting_long = 0, 0.0, 0
        for unfed in sorted(row.unfed for row in self.prefilling):
            if unfed * cost > allowance:
                waiting_long += 1
            elif spent + min(unfed, PREFILL_CHUNK) * cost <= allowance or not now:  # short: fed now if it fits
                spent += min(unfed, PREFILL_CHUNK) * cost
                now += min(unfed, PREFILL_CHUNK)
        now = min(PREFILL_TOKENS, now)
        if not waiting_long:
            self._credit = 0.0
            return now
        # time credit for the long prompts, built up over steps that feed none until it buys each a piece
        share = self.prefill_share * max(1.0, waiting_long / max(len(self.live), 1))
        self._credit = min(self._credit + share * self._decode_s, PREFILL_TOKENS * cost)
        budget = min(PREFILL_TOKENS - now, int(self._credit / cost))
        if budget < LONG_PIECE * waiting_long:  # short prompts only (a forward takes a token of every row)
            return min(PREFILL_TOKENS, now + waiting_long) if now else 0
        self._credit -= budget * cost
        return now + budget

    def _short_allowance(self) -> float:
        """Seconds of prompt feeding one step may spend at once beside the decoding rows: SHORT_PROMPT_STEPS
        decoding steps, or SHORT_SHARE of the rows' remaining steps when that is more (the mean over the rows of
        what each has left, at its own tokens a step, counted up to SHORT_HORIZON). Rows with long to go can
        afford a prompt that starts another row now; rows about to end are not held for one."""
        left = []
        for row in self.live:
            per_step = len(row.token_ids) / row.counters.steps if row.counters.steps else 1.0
            left.append(min(row.budget / max(per_step, 1.0), SHORT_HORIZON))
        mean = sum(left) / len(left) if left else 0.0
        return max(SHORT_PROMPT_STEPS, SHORT_SHARE * mean) * self._decode_s

    def _prompt_plan(self, budget: int, chunk: int) -> list[int]:
        """Tokens per prefilling row for one forward: at least one each (the forward covers them all), the rest
        to the rows with the fewest left first, so a short prompt is not held behind a long one; when some rows
        can finish in this forward, the others get one token each, so the finishing ones start decoding soon (not
        with `prefill_first`: every row gets its chunk).
        [] when the budget is 0."""
        if budget <= 0:
            return []
        plan = [min(1, row.unfed) for row in self.prefilling]
        left = budget - sum(plan)
        for j in sorted(range(len(plan)), key=lambda j: self.prefilling[j].unfed):
            if left <= 0:
                break
            extra = min(min(self.prefilling[j].unfed, chunk) - plan[j], left)
            plan[j] += extra
            left -= extra
        finishing = [n == row.unfed for n, row in zip(plan, self.prefilling)]
        if any(finishing) and not all(finishing) and not self.prefill_first:
            plan = [n if done else 1 for n, done in zip(plan, finishing)]
        return plan

    def _feed_prompts(self, plan: list[int]) -> None:
        """One forward over the prefilling rows alone (nothing is decoding)."""
        pieces = [list(row.request.prompt_ids[row.fed: row.fed + n]) for row, n in zip(self.prefilling, plan)]
        tokens, counts = pad_rows(pieces)
        started = time.perf_counter()
        out = self.target.forward_rows(tokens, counts, begin=len(self.live),
                                       logits_at=torch.zeros(len(pieces), 1, dtype=torch.long),
                                       hidden=self.drafter.wants_features, prompt=True)
        # a prompt token's cost in such forwards (it grows with the context the prompts have reached)
        per_token = (time.perf_counter() - started) / max(sum(counts), 1)
        self._idle_token_s = _average(self._idle_token_s, per_token, 0.5)
        self._fed(plan, out.hidden if self.drafter.wants_features else None)
        self._start_decoding()

    def _prefill_scored(self, row: Row, index: int) -> None:
        """Prefill a prompt whose log-probabilities were asked for, alone and now (logits at every position:
        too wide to share a forward with decoding rows), in chunks; the row then waits to start decoding."""
        prompt = row.request.prompt_ids
        row.prompt_logprobs = [None]
        while row.unfed:
            n = min(row.unfed, PREFILL_CHUNK)
            out = self.target.forward_rows(torch.tensor([prompt[row.fed: row.fed + n]]), [n], begin=index,
                                           hidden=self.drafter.wants_features, prompt=True)
            row.prompt_logprobs += token_logprobs(out.logits[0], prompt[row.fed + 1: row.fed + n + 1],
                                                  row.request.params.prompt_logprobs)
            self._fed([n], out.hidden, rows=[row])

    def _fed(self, plan: list[int], hidden: torch.Tensor | None, rows: list[Row] | None = None) -> None:
        for j, (row, n) in enumerate(zip(self.prefilling if rows is None else rows, plan)):
            row.fed += n
            row.counters.prefill_calls += 1
            if hidden is not None:
                row.prefill_states.append(hidden[j, :n])

    def _start_decoding(self) -> None:
        """Prefilled rows join the live ones (row len(live) of the cache), and the drafter hears of them (then
        `live[row].id` is the request's id, for a drafter that keeps something per request)."""
        while True:
            j = next((j for j, row in enumerate(self.prefilling) if row.unfed == 0), None)
            if j is None:
                return
            begin = len(self.live)
            if j:
                self.target.cache.swap_rows(begin, begin + j)
                self.prefilling[0], self.prefilling[j] = self.prefilling[j], self.prefilling[0]
            row = self.prefilling.pop(0)
            if self.prefixes is not None:  # its prompt's blocks, for the requests that share them
                wants = self.drafter.wants_features
                states = torch.cat(row.prefill_states) if wants and row.prefill_states else None
                self.prefixes.insert(row.request.prompt_ids[:-1], self.target.cache, begin, states)
                if len(row.request.prompt_ids) % self.prefixes.block == 0:  # the last block: after the first step
                    row.last_block_pending, row.last_block_states = True, states
            self.live.append(row)
            self.drafter.admit(begin, row.request.prompt_ids)
            if row.prefill_states and self.drafter.wants_features:
                self.drafter.observe(begin, 0, torch.cat(row.prefill_states))
            row.prefill_states = []

    def _timed(self, seconds: float, prompt_tokens: int) -> None:
        """Moving averages of a decoding step and of what a prompt token adds to it (the prompt budget's basis)."""
        if prompt_tokens == 0:
            self._decode_s = _average(self._decode_s, seconds, 0.2)
        elif self._decode_s is not None:
            self._prompt_token_s = _average(self._prompt_token_s, max(seconds - self._decode_s, 0.0) / prompt_tokens,
                                            0.2)

    def _unprefill(self, j: int) -> None:
        """Drop prefilling row j: the last prefilling row takes its place in the cache."""
        begin, last = len(self.live), len(self.prefilling) - 1
        if j != last:
            self.target.cache.move_row(begin + last, begin + j)
            self.prefilling[j] = self.prefilling[last]
        self.prefilling.pop()
        self.target.cache.drop_rows(begin + len(self.prefilling))

    def _free(self, index: int) -> None:
        self._unseat(index)
        self._release_rows()

    def _unseat(self, index: int) -> None:
        """Live row `index` leaves: the last live row takes its place (and the last prefilling row the last live
        slot). The caches' rows past the new ones stay until `_release_rows`."""
        last = len(self.live) - 1
        if index != last:
            self.target.cache.move_row(last, index)
            self.drafter.move_row(last, index)
            self.live[index] = self.live[last]
        self.live.pop()
        if self.prefilling:  # the prefilling rows follow the live ones: the last of them fills the hole
            self.target.cache.move_row(last + len(self.prefilling), last)
            self.prefilling.insert(0, self.prefilling.pop())

    def _release_rows(self) -> None:
        """The caches drop the rows past the live and prefilling ones, and give back what those rows held."""
        self.target.cache.drop_rows(len(self.live) + len(self.prefilling))
        self.drafter.release(len(self.live))
        if not self.live and not self.prefilling:
            held = self.target.cache.allocated_bytes
            self.target.cache.shrink()  # idle: a long prompt's memory goes back
            if not self.waiting and held >= TRIM_AFTER_BYTES:
                release_heap()
        else:  # a long row's memory goes back when it ends, though others go on
            self.target.cache.fit()

    def _end_step(self, done: list[int], started: float, plan: list[int]) -> None:
        for b in reversed(done):  # highest first: moving the last row never touches a pending index
            self._unseat(b)
        if done:  # the caches drop and compact once for all the rows that ended
            self._release_rows()
        self._timed(time.perf_counter() - started, sum(plan))
        self._start_decoding()
