"""The output of a step: commit (cut at EOS and stop strings), log-probabilities, counters, events, and a
finished request's result. A mixin of `core.Engine`."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from draftwise.engine.rows import Event, Result, Row, cut_at_eos, token_logprobs


class Output:
    """Commit, events and results of `core.Engine` (see its docstring)."""

    def _commit_rows(self, rows: Sequence[Row], committed: list[list[int]], logits: Sequence[torch.Tensor],
                     accepted: Sequence[int], record: Callable[[int, Row, int], None], verifier: Sequence[int],
                     counts: Sequence[int], proposed: Sequence[int], drafter_calls: int, hidden: torch.Tensor | None,
                     plan: list[int], started: float) -> list[Event]:
        """Commit, record and rewind, for chains and trees alike: row b appends committed[b] (cut at EOS and stop
        strings; logits[b][j] came before its token j), its counters record the step (`record(b, row, accepted
        tokens kept)`), and every cache keeps the row's sequence minus its new pending token."""
        events, done, kept_drafts = [], [], []
        now = time.perf_counter()
        for b, row in enumerate(rows):
            kept = self._conclude(b, row, committed[b], logits[b], now, drafter_calls, verifier[b])
            kept_drafts.append(min(accepted[b], len(kept)))
            record(b, row, kept_drafts[-1])
            row.counters.target_tokens += counts[b]
            row.counters.proposed += proposed[b]
            events.append(self._event(row, kept))
            # rewind: the row keeps everything but its newest token
            self.target.trim_row(b, len(row.sequence) - 1)
            self.drafter.rewind(b, len(row.sequence) - 1)
            if row.finish_reason is not None:
                done.append(b)
        if self._feedback is not None:  # the drafter learns what the target kept (HF's update_candidate_strategy)
            self._feedback(rows, kept_drafts)
        if self.prefixes is not None:
            self._store_last_blocks(rows, hidden)
        self._end_step(done, started, plan)
        return events

    def _conclude(self, b: int, row: Row, committed: list[int], logits: torch.Tensor, now: float,
                  drafter_calls: int, verifier: int) -> list[int]:
        """Commit a row's tokens of this step (cut at EOS), its log-probabilities (logits[j] came before committed
        token j) and counters; returns the tokens kept. The caller records the step's acceptance, then makes the
        row's event (a finished row's event carries its final counters)."""
        committed = cut_at_eos(committed, row.request.eos_token_ids)
        kept = self._commit(row, committed, now)  # may cut further, at a stop string
        if row.grammar is not None and not row.grammar.commit(kept) and row.finish_reason is None:
            row.finish_reason = "grammar"  # the grammar engine failed (a parser limit): the answer ends here
        if row.request.params.logprobs is not None:
            row.logprobs += token_logprobs(logits, kept, row.request.params.logprobs)
        row.counters.draft_calls += drafter_calls
        row.counters.verifier_accepted += verifier
        return kept

    def _store_last_blocks(self, rows: Sequence[Row], hidden: torch.Tensor | None) -> None:
        """After a decoding step: the prefix store gets the last block of each prompt whose last token this step
        fed (the token at the step's first slot; `hidden[b, 0]` its features, for a drafter that wants them)."""
        for b, row in enumerate(rows):
            if not row.last_block_pending:
                continue
            row.last_block_pending = False
            prompt = row.request.prompt_ids
            if self.target.lengths[b] < len(prompt):  # nothing kept past the prompt (a stop string cut it all)
                continue
            states = row.last_block_states
            if self.drafter.wants_features:
                if hidden is None or states is None and len(prompt) > 1:
                    continue
                last = hidden[b, :1]
                states = last if states is None else torch.cat([states, last.to(states.dtype)])
            row.last_block_states = None
            self.prefixes.insert(prompt, self.target.cache, b, states)

    def _commit(self, row: Row, committed: list[int], now: float) -> list[int]:
        """Append the step's tokens (cut at a stop string) and decide whether the row ends; returns the kept tokens."""
        stop_hit = False
        if row.request.stop and self.tokenizer is not None:
            kept = []
            for token in committed:  # token by token, so the cut is exact
                kept.append(token)
                row.text += row.detok.push([token])
                cut = _find_stop(row.text, row.request.stop)
                if cut is not None:
                    row.text = row.text[:cut]
                    stop_hit = True
                    break
            committed = kept
        elif self.stream_text:
            row.text += row.detok.push(committed)
        row.sequence.extend(committed)
        row.token_ids.extend(committed)
        if row.first_token_at is None:
            row.first_token_at = now
        if stop_hit:
            row.finish_reason = "stop"
        elif committed and committed[-1] in row.request.eos_token_ids:
            row.finish_reason = "eos"
        elif row.budget <= 0:
            row.finish_reason = "length"
        return committed

    def _event(self, row: Row, kept: list[int]) -> Event:
        """The step's event for a row, after its counters were recorded (a finished row's stats are final)."""
        if row.finish_reason is not None:
            self._finish(row, row.finish_reason)
            ready = len(row.text)
        else:
            ready = _safe_prefix(row.text, row.request.stop)
        piece = row.text[row.emitted:ready] if ready > row.emitted else ""
        row.emitted = max(row.emitted, ready)
        logprobs = row.logprobs[len(row.logprobs) - len(kept):] if row.request.params.logprobs is not None else None
        first = row.request.params.prompt_logprobs is not None and row.counters.steps == 1
        return Event(row.id, kept, piece, row.finish_reason is not None, row.finish_reason, logprobs,
                     row.prompt_logprobs if first else None)

    def _finish(self, row: Row, reason: str) -> None:
        row.finish_reason = reason
        row.finished_at = time.perf_counter()
        if self.tokenizer is not None and reason != "stop":
            row.text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        c = row.counters
        stats = {
            "method": self.method,
            "new_tokens": len(row.token_ids),
            "target_calls": c.steps,
            "draft_calls": c.draft_calls,  # forwards shared by the batch: each row counts the ones it took part in
            "target_tokens": c.target_tokens,
            "steps": c.steps,
            "drafted": c.drafted,
            "accepted": c.accepted,
            "accepted_per_position": c.accepted_per_position,
            "drafted_per_position": c.drafted_per_position,
            "prompt_tokens": len(row.request.prompt_ids),
            "cached_tokens": row.cached,  # prompt positions restored from the prefix store, not prefilled
            "prefill_calls": c.prefill_calls,
            "verifier_accepted": c.verifier_accepted,
            "finish_reason": reason,
            "seed": row.seed,
            "wall_time_s": row.finished_at - row.submitted,
            "time_to_first_token_s": (row.first_token_at - row.submitted) if row.first_token_at else None,
        }
        if self.selector.discards:
            stats["proposed"] = c.proposed  # drafted, before the select phase dropped some unverified
        self.finished[row.id] = Result(
            row.id, list(row.token_ids), row.text, reason, stats,
            list(row.logprobs) if row.request.params.logprobs is not None else None,
            list(row.prompt_logprobs) if row.request.params.prompt_logprobs is not None else None)


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _safe_prefix(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` can be shown: not a trailing incomplete character, not a possible stop-string start."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for n in range(min(len(s) - 1, end), 0, -1):
            if text[end - n : end] == s[:n]:
                end -= n
                break
    return end
