"""The sequence-level cascade (Narasimhan et al. eq. 1) as two passes of the batched engine.

The draft writes each whole response on an `ar` engine of its own (the draft model as that
engine's model), which returns each token's log-probability under the draft (raw, before
warping, as `Result.logprobs`). A response whose confidence (`cascades.sequence_confidence`)
is at least `threshold` = 1 - alpha is the answer; otherwise it is discarded and the target's
`ar` engine writes one from the prompt. Both passes batch: many drafts decode together, and
the deferred prompts decode together on the target.

`SequenceCascadeEngine` has the engine's interface (`submit`, `step`, `cancel`, `result`,
`results`, `has_work`, `finished`, `waiting`, `admitted`, `live`), so the API, the benchmarks and
the server drive it as they drive an `Engine`. Nothing of a request is emitted before its
decision: a kept response arrives as one event, a deferred one streams from the target.
Counters: drafted = the draft's tokens, accepted = the same when kept (else 0); the target runs
only for deferred requests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable

from draftwise.engine.core import Engine
from draftwise.engine.rows import Event, Request, Result


@dataclass
class _Pending:
    id: int  # the outer request id
    request: Request
    draft_id: int | None = None  # in the draft engine, while it writes
    target_id: int | None = None  # in the target engine, after a deferral
    draft: Result | None = None


class SequenceCascadeEngine:
    def __init__(self, draft: Engine, target: Engine, confidence: Callable[[list[float]], float],
                 threshold: float, *, method: str = "seq-cascade") -> None:
        self.draft, self.target = draft, target
        self.confidence = confidence
        self.threshold = threshold
        self.method = method
        self.finished: dict[int, Result] = {}
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._by_draft: dict[int, _Pending] = {}
        self._by_target: dict[int, _Pending] = {}

    # ---- the engine's interface ----

    @property
    def max_batch_size(self) -> int:
        return self.target.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int) -> None:
        self.draft.max_batch_size = self.target.max_batch_size = value

    @property
    def others_decoding(self) -> bool:
        return self.target.others_decoding

    @others_decoding.setter
    def others_decoding(self, value: bool) -> None:
        self.draft.others_decoding = self.target.others_decoding = value

    @property
    def has_work(self) -> bool:
        return bool(self._pending)

    @property
    def waiting(self) -> list[_Pending]:
        return [p for p in self._pending.values() if not self._holds_row(p)]

    @property
    def admitted(self) -> list[_Pending]:
        return [p for p in self._pending.values() if self._holds_row(p)]

    @property
    def live(self) -> list[Any]:
        return [*self.draft.live, *self.target.live]

    def _holds_row(self, pending: _Pending) -> bool:
        engine, inner = (self.draft, pending.draft_id) if pending.target_id is None else (self.target, pending.target_id)
        return any(row.id == inner for row in engine.admitted)

    def submit(self, request: Request) -> int:
        pending = _Pending(next(self._ids), request)
        pending.draft_id = self.draft.submit(replace(request, logprobs=0, prompt_logprobs=None))
        self._pending[pending.id] = pending
        self._by_draft[pending.draft_id] = pending
        return pending.id

    def cancel(self, request_id: int) -> bool:
        pending = self._pending.get(request_id)
        if pending is None:
            return False
        if pending.target_id is None:
            self.draft.cancel(pending.draft_id)
            self._by_draft.pop(pending.draft_id, None)
            result = self.draft.finished.pop(pending.draft_id)
            result.token_ids, result.text = [], ""  # nothing was emitted before the decision
            self._done(pending, result, drafted=0, kept=False)
        else:
            self.target.cancel(pending.target_id)
            self._by_target.pop(pending.target_id, None)
            self._done(pending, self.target.finished.pop(pending.target_id), drafted=len(pending.draft.token_ids),
                       kept=False)
        return True

    def result(self, request_id: int) -> Result | None:
        return self.finished.get(request_id)

    def results(self) -> dict[int, Result]:
        return dict(self.finished)

    def run(self) -> dict[int, Result]:
        while self.has_work:
            self.step()
        return self.results()

    def step(self) -> list[Event]:
        events = []
        if self.draft.has_work:
            for event in self.draft.step():
                if event.finished:
                    events += self._decide(self._by_draft.pop(event.request_id))
        if self.target.has_work:
            for event in self.target.step():
                pending = self._by_target[event.request_id]
                if event.finished:
                    del self._by_target[event.request_id]
                    self._done(pending, self.target.finished.pop(event.request_id),
                               drafted=len(pending.draft.token_ids), kept=False)
                events.append(replace(event, request_id=pending.id))
        return events

    # ---- the decision ----

    def _decide(self, pending: _Pending) -> list[Event]:
        draft = self.draft.finished.pop(pending.draft_id)
        pending.draft = draft
        if draft.finish_reason == "cancelled":
            return []
        log_probs = [score.logprob for score in draft.logprobs or ()]
        if self.confidence(log_probs) >= self.threshold:
            self._done(pending, draft, drafted=len(draft.token_ids), kept=True)
            return [Event(pending.id, list(draft.token_ids), draft.text, True, draft.finish_reason)]
        pending.target_id = self.target.submit(pending.request)
        self._by_target[pending.target_id] = pending
        return []

    def _done(self, pending: _Pending, result: Result, *, drafted: int, kept: bool) -> None:
        """The request's result: the kept draft's, or the target's, with the cascade's counters."""
        self._pending.pop(pending.id, None)
        draft_stats = pending.draft.stats if pending.draft is not None else {}
        stats = dict(result.stats)
        stats.update(method=self.method, drafted=drafted, accepted=drafted if kept else 0,
                     draft_calls=draft_stats.get("target_calls", stats["target_calls"] if kept else 0),
                     accepted_per_position=[], drafted_per_position=[])
        if kept:  # the target never ran
            stats.update(target_calls=0, steps=0, target_tokens=0, prefill_calls=0)
        elif pending.draft is not None:
            stats["wall_time_s"] = stats.get("wall_time_s", 0.0) + draft_stats.get("wall_time_s", 0.0)
            if stats.get("time_to_first_token_s") is not None:
                stats["time_to_first_token_s"] += draft_stats.get("wall_time_s", 0.0)
        self.finished[pending.id] = Result(pending.id, result.token_ids, result.text, result.finish_reason, stats,
                                           None, None)
