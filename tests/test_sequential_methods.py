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

import dataclasses
import math

import numpy as np

import pytest
import torch

import draftwise
from draftwise.engine.protocols import StepDistributions
from draftwise.rules.cascades import AcceptDraftRule, BildRollbackRule, FLyRule, aligned_ahead, chow_stop, sequence_confidence
from draftwise.engine.sampling import SamplingConfig, make_generator, sample, unwarped, warp

from conftest import near_copy, tiny_llama, speculative_sample


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


# ----------------------------------------------------------------------------- bild, token-cascade: the pieces


def test_bild_rollback_keeps_a_token_while_its_surprise_is_within_alpha():
    # draft 1 then 2. Position 0: -log p(1) = -log 0.2 = 1.61 <= 2: kept although the argmax is 0.
    # Position 1: -log p(2) = -log 0.1 = 2.30 > 2: replaced by the target's argmax 3.
    rows = [[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.1, 0.1, 0.1, 0.6, 0.05, 0.05], CERTAIN]
    step = fly_step([1, 2], rows, greedy=True)
    pi = BildRollbackRule(alpha=2.0)(step)
    assert pi.argmax(-1).tolist() == [1, 3] and torch.equal(pi.sum(-1), torch.ones(2))
    out = speculative_sample(step.draft_tokens, step.draft_probs, pi, step.target_probs[-1], make_generator(0))
    assert (out.num_accepted, out.next_token) == (1, 3)
    # alpha 2.5 keeps both: the bonus is the target's argmax after them (0)
    pi = BildRollbackRule(alpha=2.5)(step)
    out = speculative_sample(step.draft_tokens, step.draft_probs, pi, step.target_probs[-1], make_generator(0))
    assert (out.num_accepted, out.next_token) == (2, 0)
    # alpha 1.0 rolls back at once; the target's argmax 0 replaces the draft's 1
    pi = BildRollbackRule(alpha=1.0)(step)
    out = speculative_sample(step.draft_tokens, step.draft_probs, pi, step.target_probs[-1], make_generator(0))
    assert (out.num_accepted, out.next_token) == (0, 0)


def test_accept_draft_rule_keeps_every_drafted_token():
    gen = torch.Generator().manual_seed(1)
    draft_probs = torch.softmax(torch.randn(5, VOCAB, generator=gen), -1)
    tokens = sample(draft_probs, gen)
    logits = torch.randn(6, VOCAB, generator=gen)
    step = StepDistributions(tokens, draft_probs, torch.softmax(logits, -1), logits)
    pi = AcceptDraftRule()(step)
    for seed in range(50):
        out = speculative_sample(tokens, draft_probs, pi, step.target_probs[-1], make_generator(seed))
        assert out.num_accepted == 5


def test_chow_stop_and_sequence_confidence_by_hand():
    q = torch.tensor([0.6, 0.3, 0.1])
    assert chow_stop(0.3)(q)  # 0.6 < 1 - 0.3: the draft defers
    assert not chow_stop(0.5)(q)  # 0.6 >= 0.5
    logs = [math.log(0.5), math.log(0.8)]
    assert sequence_confidence(logs, "product") == pytest.approx(0.4)
    assert sequence_confidence(logs, "mean") == pytest.approx(math.sqrt(0.4))
    assert sequence_confidence([], "mean") == 1.0


# ----------------------------------------------------------------------------- whole runs against references

N = 16
PROMPTS = [[3, 17, 42, 8, 25], [1, 2, 3], [60]]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, near_copy(target, 0.15)


def last_logits(model, sequence: list[int], n: int = 1) -> torch.Tensor:
    """Cache-free: one full forward; the logits of the last n positions [n, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0, -n:].float()


def greedy(model, prompt: list[int], n: int = N) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(last_logits(model, prompt + out).argmax()))
    return out


def run(models, method: str, prompt: list[int], **options):
    target, draft = models
    return draftwise.generate(target=target, draft=draft, prompt=prompt, method=method, temperature=0,
                              max_new_tokens=N, ignore_eos=True, **options)


def fly_reference(models, prompt, *, gamma: int, window: int, threshold: float) -> tuple[list[int], int, int]:
    """(tokens, accepted drafted tokens, forgiven mismatches) of greedy FLy, spelled out."""
    target, draft = models
    out: list[int] = []
    accepted = forgiven = 0
    while len(out) < N:
        k = min(gamma, N - len(out) - 1)
        drafted: list[int] = []
        for _ in range(k):
            drafted.append(int(last_logits(draft, prompt + out + drafted).argmax()))
        p = torch.softmax(last_logits(target, prompt + out + drafted, k + 1), -1)  # [k + 1, vocab]
        best = p.argmax(-1).tolist()
        entropy = (-torch.special.xlogy(p, p).sum(-1)).tolist()
        aligned = [drafted[j] == best[j] for j in range(k)]
        committed = []
        for j in range(k):
            lenient = entropy[j] >= threshold and j + window < k and all(aligned[j + 1 : j + 1 + window])
            if aligned[j] or lenient:
                committed.append(drafted[j])
                forgiven += not aligned[j]
            else:
                committed.append(best[j])
                break
        else:
            committed.append(best[k])
        accepted += len(committed) - 1
        out += committed
    return out, accepted, forgiven


@pytest.mark.parametrize("gamma, window, threshold", [(4, 2, 0.0), (5, 1, 0.3), (6, 2, 0.0)])
def test_fly_greedy_matches_a_cache_free_reference(models, gamma: int, window: int, threshold: float):
    forgiven_somewhere = False
    for prompt in PROMPTS:
        expected, accepted, forgiven = fly_reference(models, prompt, gamma=gamma, window=window, threshold=threshold)
        out = run(models, "fly", prompt, gamma=gamma, window=window, entropy_threshold=threshold)
        assert out.token_ids == expected, prompt
        assert out.stats["accepted"] == accepted
        forgiven_somewhere |= forgiven > 0
    assert forgiven_somewhere  # FLy's leniency did change something (else this is plain sd)


def oracle_greedy(models, prompt, *, alpha: float) -> tuple[list[int], int]:
    """Algorithm 3 with the Diff rule at temperature 0: defer when max q < max p - alpha, then the deferred-to
    model's argmax; (tokens, tokens taken from the draft)."""
    target, draft = models
    out: list[int] = []
    kept = 0
    while len(out) < N:
        q_logits, p_logits = last_logits(draft, prompt + out), last_logits(target, prompt + out)
        defer = bool(unwarped(q_logits).max() < unwarped(p_logits).max() - alpha)
        out.append(int((p_logits if defer else q_logits).argmax()))
        kept += not defer
    return out, kept


def test_oracle_diff_greedy_matches_a_cache_free_reference(models):
    target, draft = models
    mixed = False
    for prompt in PROMPTS:
        for alpha in (0.0, 0.05):
            expected, kept = oracle_greedy(models, prompt, alpha=alpha)
            out = run(models, "oracle-diff", prompt, alpha=alpha)
            assert out.token_ids == expected, (prompt, alpha)
            assert out.stats["steps"] - 1 <= out.stats["drafted"] <= out.stats["steps"]  # one-token drafts (none
            # at the last step, when one token is left)
            mixed |= 0 < kept < N
    assert mixed  # both models' tokens were taken somewhere


SAMPLED = SamplingConfig(temperature=0.8, top_k=10)
N_EXACT = 1500  # seeded runs of the goodness-of-fit test


def oracle_joint(models, prompt, alpha: float) -> dict[tuple[int, int], float]:
    """The exact distribution of Algorithm 3's first two tokens: pi_t = S(p) where it defers, else S(q)."""
    target, draft = models

    def pi(sequence):
        q_logits, p_logits = last_logits(draft, sequence), last_logits(target, sequence)
        defer = bool(unwarped(q_logits).max() < unwarped(p_logits).max() - alpha)
        return warp(p_logits if defer else q_logits, SAMPLED)[0]

    first = pi(prompt)
    joint = {}
    for x1 in first.nonzero()[:, 0].tolist():
        second = pi(prompt + [x1])
        for x2 in second.nonzero()[:, 0].tolist():
            joint[(x1, x2)] = first[x1].item() * second[x2].item()
    return joint


def _oracle_runs(models, prompt, alpha: float) -> dict[tuple[int, ...], int]:
    target, draft = models
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(N_EXACT):
        out = draftwise.generate(target=target, draft=draft, prompt=prompt, method="oracle-diff", alpha=alpha,
                                 max_new_tokens=2, ignore_eos=True, seed=seed, temperature=SAMPLED.temperature,
                                 top_k=SAMPLED.top_k)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    return counts


def _fit(counts, exact) -> float:
    from test_exactness import pooled_chisquare

    if set(counts) - set(exact):
        return 0.0
    cells = sorted(exact)
    return pooled_chisquare(np.array([counts.get(c, 0) for c in cells], float), np.array([exact[c] for c in cells]))


def test_oracle_diff_samples_the_oracle_cascade_distribution(models):
    """The engine's one-token drafts with Algorithm 4's bonus from pi commit each token from pi_t, as Algorithm 3
    does: Pearson chi-square on the first two tokens' joint (ALPHA), against the brute-force distribution."""
    from test_exactness import ALPHA

    prompt = PROMPTS[0]
    exact = oracle_joint(models, prompt, 0.0)
    assert _fit(_oracle_runs(models, prompt, 0.0), exact) > ALPHA


def test_negative_control_a_target_bonus_is_caught(models, monkeypatch):
    """The same runs with the bonus drawn from the target (not pi) are rejected by the same test."""
    from test_exactness import ALPHA
    from draftwise import methods
    from draftwise.rules.cascades import CascadeRule

    spec = methods.METHODS["oracle-diff"]
    monkeypatch.setitem(methods.METHODS, "oracle-diff", dataclasses.replace(
        spec, make_rule=lambda o: CascadeRule(rule="diff", alpha=o["alpha"], bonus_from="target")))
    prompt = PROMPTS[0]
    assert _fit(_oracle_runs(models, prompt, 0.0), oracle_joint(models, prompt, 0.0)) < ALPHA


def test_seq_cascade_keeps_or_discards_the_whole_draft_at_its_threshold(models):
    target, draft = models
    for prompt in PROMPTS[:2]:
        response = greedy(draft, prompt)
        with torch.no_grad():
            logits = draft(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
        log_probs = torch.log_softmax(logits, -1)[torch.arange(N), response].tolist()
        target_alone = greedy(target, prompt)
        assert response != target_alone
        for aggregate in ("mean", "product"):
            confidence = math.exp(sum(log_probs) / (N if aggregate == "mean" else 1))
            for margin, keeps in ((1e-4, True), (-1e-4, False)):
                alpha = 1 - confidence * (1 - margin)  # keep iff confidence >= 1 - alpha
                out = run(models, "seq-cascade", prompt, alpha=alpha, aggregate=aggregate)
                assert out.token_ids == (response if keeps else target_alone), (aggregate, margin)
                assert out.stats["drafted"] == N
                assert out.stats["accepted"] == (N if keeps else 0)
                assert (out.stats["target_calls"] == 0) == keeps


def bild_reference(models, prompt, *, alpha: float, fallback: float, max_window: int) -> list[int]:
    """Original BiLD, greedy: the draft runs until max q < 1 - fallback (or the window is full); the target
    keeps drafted tokens while -log p(x) <= alpha (or x is its argmax), then its own token."""
    target, draft = models
    out: list[int] = []
    while len(out) < N:
        drafted: list[int] = []
        while len(drafted) < min(max_window, N - len(out) - 1):
            q = torch.softmax(last_logits(draft, prompt + out + drafted)[0], -1)
            if q.max() < 1 - fallback:
                break
            drafted.append(int(q.argmax()))
        p = torch.softmax(last_logits(target, prompt + out + drafted, len(drafted) + 1), -1)
        committed = []
        for j, x in enumerate(drafted):
            if -math.log(p[j, x]) <= alpha or x == int(p[j].argmax()):
                committed.append(x)
            else:
                committed.append(int(p[j].argmax()))
                break
        else:
            committed.append(int(p[-1].argmax()))
        out += committed
    return out


@pytest.mark.parametrize("alpha, fallback, max_window", [(2.0, 0.5, 10), (3.0, 0.7, 3), (4.0, 0.9, 6)])
def test_bild_matches_a_cache_free_reference(models, alpha: float, fallback: float, max_window: int):
    target, draft = models
    lossy = False
    for prompt in PROMPTS:
        expected = bild_reference(models, prompt, alpha=alpha, fallback=fallback, max_window=max_window)
        out = run(models, "bild", prompt, alpha=alpha, fallback=fallback, max_window=max_window)
        assert out.token_ids == expected, prompt
        lossy |= expected != greedy(target, prompt)
    assert lossy  # a rollback threshold that kept a token the target would not have chosen


def token_cascade_reference(models, prompt, *, alpha: float, max_run: int) -> tuple[list[int], int]:
    """Sequential token-level cascade, greedy: the draft writes while max q >= 1 - alpha (at most max_run
    tokens), every drafted token is kept, then the target writes one token."""
    target, draft = models
    out: list[int] = []
    drafted_total = 0
    while len(out) < N:
        drafted: list[int] = []
        while len(drafted) < min(max_run, N - len(out) - 1):
            q = torch.softmax(last_logits(draft, prompt + out + drafted)[0], -1)
            if q.max() < 1 - alpha:
                break
            drafted.append(int(q.argmax()))
        out += drafted + [int(last_logits(target, prompt + out + drafted).argmax())]
        drafted_total += len(drafted)
    return out, drafted_total


@pytest.mark.parametrize("alpha, max_run", [(0.5, 10), (0.3, 4), (0.8, 2)])
def test_token_cascade_matches_a_cache_free_reference(models, alpha: float, max_run: int):
    target, draft = models
    both = False
    for prompt in PROMPTS:
        expected, drafted = token_cascade_reference(models, prompt, alpha=alpha, max_run=max_run)
        out = run(models, "token-cascade", prompt, alpha=alpha, max_run=max_run)
        assert out.token_ids == expected, prompt
        assert out.stats["accepted"] == out.stats["drafted"] == drafted
        both |= 0 < drafted < N - 1
    assert both  # the draft wrote some tokens and deferred some


@pytest.mark.parametrize("method", ["mtad", "mtjd", "oracle-diff", "seq-cascade"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_moved_methods_batch_like_single_requests(models, method, temperature):
    """mtad, mtjd, oracle-diff and seq-cascade run on the batched engine: each request of a batch gets the tokens it
    gets alone (seeded), and the batch's stats add up per request."""
    target, draft = models
    kwargs = dict(method=method, temperature=temperature, seed=7, max_new_tokens=N, ignore_eos=True)
    if method != "mtjd":
        kwargs["draft"] = draft
    if method == "seq-cascade":
        kwargs["alpha"] = 0.9  # some answers kept, some deferred
    batch = draftwise.generate(target=target, prompt=PROMPTS, max_batch_size=2, **kwargs)  # continuous batching
    alone = [draftwise.generate(target=target, prompt=p, **kwargs) for p in PROMPTS]
    assert [g.token_ids for g in batch] == [g.token_ids for g in alone]
    for g in batch:
        assert g.stats["new_tokens"] == N and g.stats["accepted"] <= g.stats["drafted"]
