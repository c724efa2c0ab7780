"""The decoding loop: every method is the same step with different parts plugged in.

One step = draft -> verify -> accept -> rewind, then record (counters only).
`decode` is a generator yielding the tokens each step commits, so `generate` and
`stream` share it, and an abandoned stream leaves the caches consistent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .acceptance import ExactRule, StepDistributions, TargetRule, speculative_sample
from .drafters import Drafter, NoDrafter, empty_draft
from .models.runner import ModelRunner
from .sampling import SamplingConfig, sample, unwarped, warp


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


def cut_at_eos(committed: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """The committed tokens up to and including the first end-of-sequence token."""
    for i, token in enumerate(committed):
        if token in eos_token_ids:
            return committed[: i + 1]
    return committed


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int  # already capped by the context window
    eos_token_ids: frozenset[int]

    def cut_at_eos(self, committed: list[int]) -> list[int]:
        return cut_at_eos(committed, self.eos_token_ids)


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

    Counters are recorded after the EOS cut: when an accepted drafted token is an EOS, the
    step counts the drafted tokens up to it as drafted and accepted, and none after it.
    """
    sequence = list(prompt_ids)
    wants_features = getattr(drafter, "needs_target_hidden", False)  # feature-level drafters (EAGLE)
    if wants_features:
        target.feature_layers = tuple(getattr(drafter, "feature_layers", ()))  # EAGLE-3 reads several layers
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
        step = StepDistributions(draft.tokens, draft.probs, target_probs, target_logits, draft.raw_probs,
                                 sampling.greedy, draft.verifier_accepts, draft.joint_log_probs)
        pi = rule(step) if k else target_probs[:0]
        # a rule with `prefix` (MTAD) decides how many drafted tokens reach the sampler; the next
        # token then comes from the target's distribution right after them.
        keep = rule.prefix(step) if k and hasattr(rule, "prefix") else k
        def pi_bonus() -> torch.Tensor:  # pi at the bonus position reads the draft: one more forward
            q_raw, q_warped = drafter.next_distribution(sequence + draft.tokens.tolist())
            return rule.bonus(q_raw, q_warped, unwarped(target_logits[k]), target_probs[k], sampling.greedy)

        bonus: torch.Tensor | Callable[[], torch.Tensor] = (
            pi_bonus if getattr(rule, "bonus_from_pi", False) else target_probs[keep])
        outcome = speculative_sample(draft.tokens[:keep], draft.probs[:keep], pi[:keep], bonus, generator)
        accepted = outcome.num_accepted
        committed = limits.cut_at_eos(draft.tokens[:accepted].tolist() + [outcome.next_token])
        if len(committed) <= accepted:  # an accepted drafted token is an EOS: the drafts after it do not count
            k = accepted = len(committed)
        counters.record(k, accepted)
        sequence.extend(committed)
        counters.new_tokens += len(committed)

        # rewind: caches keep everything but the newest token, which the next step feeds.
        target.trim(len(sequence) - 1)
        drafter.rewind(len(sequence) - 1)
        yield committed
        if committed[-1] in limits.eos_token_ids:
            return


def decode_oracle(
    prompt_ids: Sequence[int],
    *,
    target: ModelRunner,
    draft: ModelRunner,
    defer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], bool],
    sampling: SamplingConfig,
    limits: Limits,
    generator: torch.Generator,
    counters: Counters,
) -> Iterator[list[int]]:
    """OracleCascade (Narasimhan et al. Algorithm 3): both models run at every position, one token per step.

    defer(q, p, S(q), S(p)) -> bool on the unwarped and warped distributions; the token is
    drawn from S(p) when it defers, else from S(q) (through Algorithm 4 with no draft, so the
    one sampler draws it). Counters: drafted = steps, accepted = tokens taken from q.
    """
    sequence = list(prompt_ids)
    none = empty_draft(draft.vocab_size or 0, draft.device)
    while counters.new_tokens < limits.max_new_tokens:
        q_logits = draft.forward(draft.pending(sequence), num_logits=1).logits  # [1, vocab]
        p_logits = target.forward(target.pending(sequence), num_logits=1).logits  # [1, vocab]
        q_warped, p_warped = warp(q_logits, sampling)[0], warp(p_logits, sampling)[0]
        deferred = defer(unwarped(q_logits)[0], unwarped(p_logits)[0], q_warped, p_warped)
        pi = p_warped if deferred else q_warped
        token = speculative_sample(none.tokens, none.probs, none.probs, pi, generator).next_token
        counters.steps += 1
        counters.drafted += 1
        counters.accepted += 0 if deferred else 1
        sequence.append(token)
        counters.new_tokens += 1
        yield [token]
        if token in limits.eos_token_ids:
            return


def decode_sequence_cascade(
    prompt_ids: Sequence[int],
    *,
    target: ModelRunner,
    draft: ModelRunner,
    confidence: Callable[[list[float]], float],
    threshold: float,
    sampling: SamplingConfig,
    limits: Limits,
    generator: torch.Generator,
    counters: Counters,
) -> Iterator[list[int]]:
    """SeqCascade [Chow] (Narasimhan et al. eq. 1): the draft writes the whole response; if its confidence
    (from the unwarped log-probabilities of the tokens it chose) is below `threshold` = 1 - alpha,
    the response is discarded and the target writes one from the prompt.

    Nothing is yielded until the decision. Counters: drafted = draft tokens, accepted = the same
    when kept, else 0; target calls happen only on deferral.
    """
    drafted: list[int] = []
    log_probs: list[float] = []
    sequence = list(prompt_ids)
    while len(drafted) < limits.max_new_tokens:
        logits = draft.forward(draft.pending(sequence), num_logits=1).logits  # [1, vocab]
        probs = warp(logits, sampling)
        token = int(probs.argmax(-1)) if sampling.greedy else int(sample(probs, generator))
        log_probs.append(float(torch.log_softmax(logits.float(), dim=-1)[0, token]))
        drafted.append(token)
        sequence.append(token)
        if token in limits.eos_token_ids:
            break
    keep = confidence(log_probs) >= threshold
    counters.drafted += len(drafted)
    if keep:
        counters.accepted += len(drafted)
        counters.new_tokens = len(drafted)
        yield drafted
        return
    yield from decode(prompt_ids, target=target, drafter=NoDrafter(target.vocab_size, target.device), rule=ExactRule(),
                      sampling=sampling, gamma=0, limits=limits, generator=generator, counters=counters)


def decode_mtjd(
    prompt_ids: Sequence[int],
    *,
    target: ModelRunner,
    k: int,
    num_beams: int,
    sampling: SamplingConfig,
    limits: Limits,
    generator: torch.Generator,
    counters: Counters,
) -> Iterator[list[int]]:
    """Multi-token joint decoding (the MTAD paper Def. 3.1), target only: each step commits the best of
    `num_beams` beams over the next `k` tokens of the target itself (beam sampling at temperature
    > 0, beam search at 0), approximating a draw from the joint p(x_{t+1:t+k}). A quality
    reference, not a fast method: k target passes per k tokens, each over `num_beams` rows.
    Counters: steps only (nothing is drafted or verified).
    """
    from .mtad import beam_search

    sequence = list(prompt_ids)
    while counters.new_tokens < limits.max_new_tokens:
        length = min(k, limits.max_new_tokens - counters.new_tokens)
        committed = limits.cut_at_eos(beam_search(target, sequence, length, num_beams, sampling, generator).tokens.tolist())
        sequence.extend(committed)
        counters.steps += 1
        counters.new_tokens += len(committed)
        target.trim(len(sequence) - 1)
        yield committed
        if committed[-1] in limits.eos_token_ids:
            return
