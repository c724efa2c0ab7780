"""Drafters with a companion model beside the draft (Speculative Verification, Kim et al.; staged speculative
decoding, Spector & Re): `CompanionRowsDrafter` adds the companion's distributions at every drafted position for
SV's selectors (`selectors.selection`); `StagedRowsDrafter` lets the companion verify the draft first."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from draftwise.drafters.base import ModelRowsDrafter, WrappingDrafter, prefill_unfed
from draftwise.engine.protocols import RowsDraft, pad_rows
from draftwise.engine.rows import Row
from draftwise.engine.keyed import STAGED, row_draws
from draftwise.engine.sampler import speculative_sample_rows, warp_rows, warped_and_raw
from draftwise.models.runner import ModelRunner


class CompanionRowsDrafter(WrappingDrafter):
    """A model drafter whose drafts the companion reads: RowsDraft.companion_probs / companion_raw hold the
    companion's warped / unwarped distributions at positions 0 .. k (k + 1: after every drafted token)."""

    def __init__(self, inner: ModelRowsDrafter, companion: ModelRunner, vocab_size: int) -> None:
        super().__init__(inner)
        self.companion = companion
        self.vocab_size = vocab_size
        self.companion_prefill_calls = 0

    @property
    def companion_calls(self) -> int:
        return self.companion.calls - self.companion_prefill_calls

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None:
        # as the draft model, the companion is fed the prompt when the row first drafts (`propose`)
        self.inner.admit(row, prompt_ids)
        self.companion.cache.reset_row(row)

    def propose(self, rows: Sequence[Row], limits: Sequence[int]) -> RowsDraft:
        draft = self.inner.propose(rows, limits)
        if not draft.width:  # nothing to score: the companion catches up in the next step that drafts
            return draft
        self.companion_prefill_calls += prefill_unfed(self.companion, rows)  # a prompt not yet fed, as a prompt
        lengths = self.companion.lengths
        drafted = draft.tokens.tolist()
        pending = [len(r.sequence) - lengths[b] for b, r in enumerate(rows)]  # 1-2 a row; more after undrafted steps
        feed, counts = pad_rows([r.sequence[lengths[b]:] + drafted[b][: draft.counts[b]] for b, r in enumerate(rows)])
        k = draft.width
        device = self.companion.device
        at = torch.tensor(pending, device=device)[:, None] - 1 + torch.arange(k + 1, device=device)[None]  # [rows, k+1]
        at = torch.minimum(at, torch.tensor(counts, device=device)[:, None] - 1)  # past a row's draft: padding
        logits = self.companion.forward_rows(feed, counts, logits_at=at).logits  # [rows, k + 1, vocab]
        configs = [r.request.sampling for r in rows]
        probs, raw = warped_and_raw(logits, configs)
        return replace(draft, companion_probs=probs, companion_raw=raw)

    def rewind(self, row: int, keep: int) -> None:
        self.inner.rewind(row, keep)
        self.companion.trim_row(row, min(keep, self.companion.lengths[row]))

    def move_row(self, src: int, dst: int) -> None:
        self.inner.move_row(src, dst)
        self.companion.cache.move_row(src, dst)

    def release(self, live: int) -> None:
        self.inner.release(live)
        self.companion.cache.drop_rows(live)
        self.companion.cache.fit()


class StagedRowsDrafter(CompanionRowsDrafter):
    """Staged speculative decoding: the companion accepts a prefix of the draft by speculative sampling
    (and draws its correction at the first rejection); the target then verifies those tokens with the
    companion's distributions as the proposal. Each staged token is distributed as the companion's, so
    the target's exact rule keeps the output exact."""

    def propose(self, rows: Sequence[Row], limits: Sequence[int]) -> RowsDraft:
        draft = super().propose(rows, limits)
        k = draft.width
        if k == 0:
            return draft
        q_c = draft.companion_probs  # [rows, k + 1, vocab]
        # a row that drafted nothing draws no uniform (flagged greedy), as when it is alone and k == 0
        outcome = speculative_sample_rows(draft.tokens, draft.probs, q_c[:, :k], q_c, draft.counts,
                                          row_draws(rows, draft.tokens.device),
                                          [r.request.sampling.greedy or not n for r, n in zip(rows, draft.counts)],
                                          stage=STAGED)  # its own keys: the target's acceptance draws afresh
        counts, tokens = [], draft.tokens.clone()
        for b in range(len(rows)):
            kept = outcome.num_accepted[b]
            if kept < draft.counts[b]:  # the companion's correction replaces the rejected token
                tokens[b, kept] = outcome.next_tokens[b]
                self.rewind(b, len(rows[b].sequence) + kept)  # both caches hold the replaced token: drop it
                kept += 1
            counts.append(kept)  # all accepted: the companion's bonus is not added (the row's limit)
        width = max(counts)
        return RowsDraft(tokens[:, :width], q_c[:, :width], counts, None, None,
                         q_c[:, : width + 1], draft.companion_raw[:, : width + 1])
