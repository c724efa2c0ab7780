"""The decoding loop: every method is the same step with different parts plugged in.

One step = draft -> verify -> accept -> rewind, then record (counters only).
`decode` is a generator yielding the tokens each step commits, so `generate` and
`stream` share it, and an abandoned stream leaves the caches consistent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .acceptance import StepDistributions, TargetRule, speculative_sample
from .drafters import Drafter
from .models.runner import ModelRunner
from .sampling import SamplingConfig, warp


@dataclass
class Counters:
    """Raw counts; rates are computed when reported (see `Generation`)."""

    gamma: int
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0  # drafted tokens sent to verification
    accepted: int = 0  # drafted tokens kept
    accepted_per_position: list[int] = field(default_factory=list)  # [gamma]: kept at draft position i
    drafted_per_position: list[int] = field(default_factory=list)  # [gamma]: verified at draft position i

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.gamma
        self.drafted_per_position = [0] * self.gamma

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int  # already capped by the context window
    eos_token_ids: frozenset[int]


def decode(
    prompt_ids: Sequence[int],
    *,
    target: ModelRunner,
    drafter: Drafter,
    rule: TargetRule,
    sampling: SamplingConfig,
    gamma: int,
    limits: Limits,
    generator: torch.Generator,
    counters: Counters,
) -> Iterator[list[int]]:
    """Yield the newly committed tokens of each step until EOS or the token budget.

    Invariant at the top of each step: `sequence` = prompt + committed tokens; the
    target's and the draft's caches hold a prefix of `sequence` that excludes at
    least its last token (fed with the next forward pass).
    """
    sequence = list(prompt_ids)
    wants_features = getattr(drafter, "needs_target_hidden", False)  # feature-level drafters (EAGLE)
    while counters.new_tokens < limits.max_new_tokens:
        budget = limits.max_new_tokens - counters.new_tokens
        # draft: at most budget - 1 tokens, so accepted + recovered/bonus never overshoots.
        draft = drafter.propose(sequence, min(gamma, budget - 1), generator)
        k = len(draft)

        # verify: one target pass over the uncached tokens and the k drafts (+1 bonus position).
        feed = target.pending(sequence)
        if k:
            feed = feed + draft.tokens.tolist()
        verified = target.forward(feed, num_logits=k + 1, hidden_all=wants_features)
        target_logits = verified.logits  # [k + 1, vocab]
        if wants_features:
            drafter.observe(verified.hidden)  # [len(feed), hidden]; rewind below drops the rejected ones
        target_probs = warp(target_logits, sampling)  # [k + 1, vocab]

        # accept: speculative sampling towards pi = rule(draft, target).
        step = StepDistributions(draft.tokens, draft.probs, target_probs, target_logits)
        pi = rule(step) if k else target_probs[:0]
        outcome = speculative_sample(draft.tokens, draft.probs, pi, target_probs[k], generator)
        committed = draft.tokens[: outcome.num_accepted].tolist() + [outcome.next_token]
        counters.record(k, outcome.num_accepted)

        # stop at the first end-of-sequence token among the committed ones.
        for i, token in enumerate(committed):
            if token in limits.eos_token_ids:
                committed = committed[: i + 1]
                break
        sequence.extend(committed)
        counters.new_tokens += len(committed)

        # rewind: caches keep everything but the newest token, which the next step feeds.
        target.trim(len(sequence) - 1)
        drafter.rewind(len(sequence) - 1)
        yield committed
        if committed[-1] in limits.eos_token_ids:
            return
