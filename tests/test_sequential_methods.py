"""Hand-built cases for the methods without statistical tests: fly, oracle-diff, seq-cascade, bild
and token-cascade.

Two kinds of check:
- the rules on hand-crafted distributions, where the accept / defer decision and the committed
  tokens are worked out in the comments;
- whole runs on the tiny random models of conftest.py against a cache-free reference written
  here: every model call is a full forward over the whole sequence, and the method's definition
  is spelled out step by step (greedy, so the runs are deterministic; for oracle-diff also at
  temperature > 0, drawing with the same sampler from the same generator).
Each reference run is also checked to be non-vacuous: the decisions it takes differ from the
target's greedy decoding and from the draft's, so a method that ignored its rule would fail.
"""

from __future__ import annotations

import math

import pytest
import torch

import draftwise
from draftwise.acceptance import StepDistributions, speculative_sample
from draftwise.cascades import AcceptDraftRule, BildRollbackRule, FLyRule, aligned_ahead, chow_stop, sequence_confidence
from draftwise.sampling import SamplingConfig, make_generator, sample, unwarped, warp

from conftest import tiny_llama


# ----------------------------------------------------------------------------- FLy: the rule


def aligned_ahead_loop(aligned: torch.Tensor, window: int) -> torch.Tensor:
    """The per-position loop that `aligned_ahead` replaced (one row)."""
    k = aligned.shape[0]
    ahead = torch.zeros(k, dtype=torch.bool)
    for j in range(max(0, k - window)):
        ahead[j] = bool(aligned[j + 1 : j + 1 + window].all())
    return ahead


def test_aligned_ahead_equals_the_loop_on_random_cases():
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        k = int(torch.randint(0, 12, (1,), generator=gen))
        window = int(torch.randint(1, 6, (1,), generator=gen))
        rate = float(torch.rand(1, generator=gen))
        aligned = torch.rand(3, k, generator=gen) < rate  # mostly aligned to mostly not
        got = aligned_ahead(aligned, window)  # batched rows
        for row in range(3):
            assert torch.equal(got[row], aligned_ahead_loop(aligned[row], window)), (aligned[row], window)
        assert torch.equal(aligned_ahead(aligned[0], window), got[0])  # one row


def test_aligned_ahead_by_hand():
    a = torch.tensor([False, True, True, False, True, True, True])
    # window 2: j=0 sees (1,2) aligned; j=1 (2,3) no; j=2 (3,4) no; j=3 (4,5) yes; j=4 (5,6) yes; j>=5 too few
    assert aligned_ahead(a, 2).tolist() == [True, False, False, True, True, False, False]
    assert aligned_ahead(a, 3).tolist() == [False, False, False, True, False, False, False]
    assert aligned_ahead(a, 7).tolist() == [False] * 7


VOCAB = 6


def fly_step(tokens: list[int], target_rows: list[list[float]], greedy: bool = False) -> StepDistributions:
    """k drafted tokens with one-hot draft distributions and the given unwarped target rows (+1 bonus row)."""
    draft_tokens = torch.tensor(tokens)
    draft_probs = torch.nn.functional.one_hot(draft_tokens, VOCAB).float()
    logits = torch.tensor(target_rows).log()
    target_probs = warp(logits, SamplingConfig(temperature=0.0 if greedy else 1.0))
    return StepDistributions(draft_tokens, draft_probs, target_probs, logits, greedy=greedy)


UNCERTAIN = [0.30, 0.25, 0.20, 0.15, 0.05, 0.05]  # entropy 1.60 nats, argmax 0
CERTAIN = [0.95, 0.01, 0.01, 0.01, 0.01, 0.01]  # entropy 0.28 nats, argmax 0
AT_2 = [0.02, 0.02, 0.90, 0.02, 0.02, 0.02]  # argmax 2
AT_3 = [0.02, 0.02, 0.02, 0.90, 0.02, 0.02]  # argmax 3


def test_fly_forgives_an_uncertain_mismatch_followed_by_aligned_drafts():
    # draft 4 at position 0 disagrees with argmax 0, but the target is uncertain there (1.60 >= 0.5)
    # and the next two drafts (2, 3) are the target's argmax: lenient at 0. Positions 1, 2 agree;
    # position 3 has too few drafts after it to judge.
    rule = FLyRule(window=2, entropy_threshold=0.5)
    rows = [UNCERTAIN, AT_2, AT_3, UNCERTAIN, CERTAIN]
    greedy = fly_step([4, 2, 3, 1], rows, greedy=True)
    assert rule.lenient(greedy).tolist() == [True, False, False, False]
    pi = rule(greedy)
    assert torch.equal(pi[0], torch.nn.functional.one_hot(torch.tensor(4), VOCAB).float())
    assert torch.equal(pi[1:], greedy.target_probs[1:4])
    # greedy: 4 forgiven, 2 and 3 are the argmax, 1 is not (judged exactly): recovered argmax 0
    out = speculative_sample(greedy.draft_tokens, greedy.draft_probs, pi, greedy.target_probs[-1], make_generator(0))
    assert (out.num_accepted, out.next_token) == (3, 0)
    # at temperature 1 position 0 is never rejected (exact: kept with p(4) = 0.05); the rest are judged
    # exactly: all four kept with probability 0.9 * 0.9 * p(1) = 0.2025
    sampled = fly_step([4, 2, 3, 1], rows)
    pi = rule(sampled)
    outcomes = [speculative_sample(sampled.draft_tokens, sampled.draft_probs, pi, sampled.target_probs[-1],
                                   make_generator(s)).num_accepted for s in range(400)]
    assert min(outcomes) >= 1
    assert 0.13 < sum(n == 4 for n in outcomes) / len(outcomes) < 0.28


@pytest.mark.parametrize("case, lenient", [
    # the same mismatch where the target is certain (0.28 < 0.5): judged exactly
    (([4, 2, 3, 1], [CERTAIN, AT_2, AT_3, UNCERTAIN, CERTAIN], 2, 0.5), [False, False, False, False]),
    # the drafts after it are not aligned (5 against argmax 3): not forgiven
    (([4, 2, 5, 1], [UNCERTAIN, AT_2, AT_3, UNCERTAIN, CERTAIN], 2, 0.5), [False, False, False, False]),
    # window 1 only needs draft 2 aligned; position 2 (5 vs 3) is followed by 1 vs uncertain argmax 0
    (([4, 2, 5, 1], [UNCERTAIN, AT_2, AT_3, UNCERTAIN, CERTAIN], 1, 0.5), [True, False, False, False]),
    # a threshold above the entropy turns leniency off
    (([4, 2, 3, 1], [UNCERTAIN, AT_2, AT_3, UNCERTAIN, CERTAIN], 2, 1.7), [False, False, False, False]),
    # window 3 needs three drafts after position 0: only 1..3 exist and 3 is misaligned
    (([4, 2, 3, 1], [UNCERTAIN, AT_2, AT_3, UNCERTAIN, CERTAIN], 3, 0.5), [False, False, False, False]),
    # window 3 with drafts 2, 3, 0 aligned after it
    (([4, 2, 3, 0], [UNCERTAIN, AT_2, AT_3, UNCERTAIN, CERTAIN], 3, 0.5), [True, False, False, False]),
])
def test_fly_leniency_by_hand(case, lenient):
    tokens, rows, window, threshold = case
    assert FLyRule(window=window, entropy_threshold=threshold).lenient(fly_step(tokens, rows)).tolist() == lenient
