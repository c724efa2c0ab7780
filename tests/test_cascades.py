"""Speculative cascades (Narasimhan et al.): the rules' target distributions, the lemmas, and the baselines.

Statistical checks follow `test_exactness.py`: Pearson chi-square with small cells pooled,
significance `ALPHA` = 1e-3 per test, seeded runs of the public `draftwise.generate`, and a
negative control per family that the same test must catch.

- Every rule's pi is a distribution (random inputs) and matches hand-computed examples.
- A speculative cascade's first two tokens follow pi_0(x0) pi_1(x1 | x0), with pi computed
  here in numpy from the two models' next-token distributions (deferral on the unwarped,
  mixture of the warped ones, §C.1). N_CASCADE = 2000 runs per rule (8 rules); negative control:
  the deferral computed on the warped distributions (ignoring §C.1) is rejected.
- Lemma 3: the rejection frequency is delta * TV(p, q) (binomial test, 20k draws).
- Lemma 2: Algorithm 4 with Lemma 2's pi accepts and recovers exactly as Tran-Thien's lossy
  speculative sampling, written out independently here.
- Lemma 7: `cascade` with token-v3 at temperature 0 equals `lossy-greedy`, token for token.
- Extremes: always deferring is `sd` token for token; never deferring (bonus from pi) is the
  draft decoding alone.
"""

from __future__ import annotations

import math
import zlib
from functools import lru_cache

import numpy as np
import pytest
import torch
from scipy.stats import binomtest

import draftwise
import draftwise.rules.cascades as cascades
from draftwise.engine.protocols import StepDistributions
from draftwise.rules.acceptance import LossyRule, residual
from draftwise.rules.cascades import CASCADE_RULES, CascadeRule, cascade_pi, tv_distance
from draftwise.errors import DraftwiseError
from draftwise.engine.sampling import SamplingConfig, make_generator, sample, warp

from conftest import sweep, tiny_llama, speculative_sample
from test_exactness import ALPHA, PAIRS, SD_PROMPTS, WARPED, next_token_probs, pooled_chisquare, tv

N_CASCADE = 2000
N_CONTROL = 1500
VOCAB = 12
PROMPT = SD_PROMPTS[VOCAB]


# ----------------------------------------------------------------------------- the rules, by hand


def numpy_pi(rule: str, alpha: float, q, p, qw, pw, greedy: bool = False) -> np.ndarray:
    """Table 1 / eq. 11-16 / eq. 28 / §F.1, written out independently of draftwise.rules.cascades."""
    q, p, qw, pw = (np.asarray(a, dtype=float) for a in (q, p, qw, pw))
    tv_warped = np.clip(pw - qw, 0, None).sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        nq = np.where(q > 0, q * np.log(q), 0).sum()
        np_ = np.where(p > 0, p * np.log(p), 0).sum()
        cross = -np.where(q > 0, q * np.log(p), 0).sum()
    if rule.startswith("token"):
        if rule == "token-v1":
            r = q < p.max() - alpha
        elif rule == "token-v2":
            r = p < p.max() - alpha
        else:
            r = p < (1 - alpha) * p.max()
        return qw * (~r) + pw * (r * qw).sum()
    delta = {
        "chow": q.max() < 1 - alpha,
        "diff": q.max() < p.max() - alpha,
        "opt": q.max() < p.max() - alpha * tv_warped,
        "opt-log": nq < np_ - alpha * tv_warped,
        "bild": (-math.log(p[q.argmax()]) if greedy else cross) > alpha,
    }[rule]
    return pw if delta else qw


Q = [0.5, 0.3, 0.2]
P = [0.2, 0.7, 0.1]
HAND = [  # (rule, alpha, greedy, expected pi) for q = Q, p = P, no warping; worked in the comments
    ("chow", 0.4, False, P),  # max q 0.5 < 0.6: defer
    ("chow", 0.6, False, Q),  # 0.5 < 0.4 is false
    ("diff", 0.1, False, P),  # 0.5 < 0.7 - 0.1
    ("diff", 0.3, False, Q),  # 0.5 < 0.4 is false
    ("opt", 0.4, False, P),  # TV = 0.4: 0.5 < 0.7 - 0.16
    ("opt", 0.6, False, Q),  # 0.5 < 0.7 - 0.24 is false
    ("opt-log", 0.5, False, P),  # sum q log q = -1.0297 < -0.8018 - 0.2
    ("opt-log", 0.6, False, Q),  # -1.0297 < -1.0418 is false
    ("bild", 1.3, False, P),  # cross-entropy 1.3722 > 1.3
    ("bild", 1.4, False, Q),
    ("bild", 1.6, True, P),  # greedy: -log p(argmax q) = -log 0.2 = 1.609 > 1.6
    ("bild", 1.7, True, Q),
    ("token-v1", 0.3, False, [0.6, 0.35, 0.05]),  # r = q < 0.4 = [F, T, T]; eta 0.5
    ("token-v2", 0.3, False, [0.14, 0.79, 0.07]),  # r = p < 0.4 = [T, F, T]; eta 0.7
    ("token-v3", 0.5, False, [0.14, 0.79, 0.07]),  # r = p < 0.35 = [T, F, T]
    ("token-v3", 0.8, False, [0.54, 0.44, 0.02]),  # r = p < 0.14 = [F, F, T]; eta 0.2
]


@pytest.mark.parametrize("rule, alpha, greedy, expected", HAND, ids=[f"{h[0]}-{h[1]}-{h[2]}" for h in HAND])
def test_rule_matches_hand_computed_example(rule, alpha, greedy, expected):
    q, p = torch.tensor([Q], dtype=torch.float64), torch.tensor([P], dtype=torch.float64)
    pi = cascade_pi(rule, alpha, q, p, q, p, greedy=greedy)[0]
    np.testing.assert_allclose(pi.numpy(), expected, atol=1e-12)
    np.testing.assert_allclose(numpy_pi(rule, alpha, Q, P, Q, P, greedy), expected, atol=1e-12)


@pytest.mark.parametrize("rule", CASCADE_RULES)
@pytest.mark.parametrize("greedy", [False, True])
def test_pi_is_a_distribution_on_random_inputs(rule: str, greedy: bool):
    generator = torch.Generator().manual_seed(zlib.crc32(rule.encode()) % 1000)  # str hash() changes per process
    q_logits = 3 * torch.randn(200, 50, generator=generator, dtype=torch.float64)
    p_logits = 3 * torch.randn(200, 50, generator=generator, dtype=torch.float64)
    sampling = SamplingConfig(temperature=0.0) if greedy else SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)
    q, p = torch.softmax(q_logits, -1), torch.softmax(p_logits, -1)
    qw, pw = warp(q_logits, sampling).double(), warp(p_logits, sampling).double()
    # warp works in float32: renormalise in float64 so the sum checks the formula, not float32 rounding (up to 2e-7)
    qw, pw = qw / qw.sum(-1, keepdim=True), pw / pw.sum(-1, keepdim=True)
    for alpha in (-0.5, 0.0, 0.05, 0.3, 0.9, 1.0, 3.0):
        pi = cascade_pi(rule, alpha, q, p, qw, pw, greedy=greedy)
        assert (pi >= 0).all()
        torch.testing.assert_close(pi.sum(-1), torch.ones(200, dtype=torch.float64))
        for row in (0, 7, 199):  # and it is the formula
            np.testing.assert_allclose(pi[row].numpy(), numpy_pi(rule, alpha, q[row], p[row], qw[row], pw[row], greedy),
                                       atol=1e-12)


def test_bad_rule_and_alpha_are_rejected():
    with pytest.raises(DraftwiseError, match="unknown cascade rule 'nope'.*token-v3"):
        CascadeRule(rule="nope")
    with pytest.raises(DraftwiseError, match="alpha must be a finite number"):
        CascadeRule(rule="opt", alpha=float("nan"))
    with pytest.raises(DraftwiseError, match="unknown cascade rule"):
        draftwise.plan.check_options(method="cascade", rule="token-v9", max_new_tokens=4, temperature=1.0, top_k=0,
                                    top_p=1.0, seed=0, gamma=2, stop=None, ignore_eos=False, draft_given=True)
    with pytest.raises(DraftwiseError, match="greedy decoding only"):
        draftwise.plan.check_options(method="bild", max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                                    gamma=2, stop=None, ignore_eos=False, draft_given=True)


# ----------------------------------------------------------------------------- lemmas on fixed distributions


def test_lemma3_rejection_probability_is_delta_times_tv():
    """Draw x ~ q, run Algorithm 4 towards a cascaded pi, count rejections: delta * TV(p, q)."""
    q = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05], dtype=torch.float64)
    p = torch.tensor([0.1, 0.2, 0.3, 0.3, 0.1], dtype=torch.float64)
    tv_pq = float(tv_distance(p, q))
    assert abs(tv_pq - 0.4) < 1e-12
    generator = make_generator(7)
    draws = 6_000  # a rejection rate off by 0.02 (5% of 0.4) is 3 standard errors: the test still sees it
    for alpha, delta in ((-0.2, 1), (-1.0, 1), (0.0, 0)):  # diff: max q 0.4 < max p 0.3 - alpha
        pi = cascade_pi("diff", alpha, q, p, q, p, greedy=False)
        assert bool((pi == p).all()) == bool(delta)
        rejections = 0
        for _ in range(draws):
            x = sample(q[None].float(), generator)
            outcome = speculative_sample(x, q[None].float(), pi[None].float(), p.float(), generator)
            rejections += outcome.num_accepted == 0
        expected = delta * tv_pq
        if delta:
            assert binomtest(rejections, draws, expected).pvalue > ALPHA, (rejections / draws, expected)
        else:
            assert rejections == 0


def test_lemma2_algorithm4_with_lossy_pi_is_lossy_speculative_sampling():
    """Tran-Thien: accept x with min(1, p(x) / ((1 - alpha) q(x))); recover from norm(max(0, p / beta - q)).
    Algorithm 4 with pi = max{min{q, p / (1 - alpha)}, p / beta}: accept with min(1, pi(x) / q(x)),
    recover from norm(max(0, pi - q)). Equal for every x, on random q, p, alpha, beta."""
    generator = torch.Generator().manual_seed(3)
    for trial in range(200):
        q = torch.softmax(2 * torch.randn(30, generator=generator, dtype=torch.float64), -1)
        p = torch.softmax(2 * torch.randn(30, generator=generator, dtype=torch.float64), -1)
        alpha = float(torch.rand((), generator=generator, dtype=torch.float64)) * 0.9
        beta = 1.0 - alpha + float(torch.rand((), generator=generator, dtype=torch.float64)) * 2
        pi = LossyRule(alpha=alpha, beta=beta)(StepDistributions(torch.zeros(1, dtype=torch.long), q[None], torch.stack([p, p]),
                                                                 torch.stack([p, p]).log()))[0]
        tran_thien_accept = torch.clamp(p / ((1 - alpha) * q), max=1.0)
        algorithm4_accept = torch.clamp(pi / q, max=1.0)
        torch.testing.assert_close(algorithm4_accept, tran_thien_accept)
        tran_thien_residual = torch.clamp(p / beta - q, min=0)
        if tran_thien_residual.sum() > 1e-9:
            torch.testing.assert_close(residual(pi, q), tran_thien_residual / tran_thien_residual.sum())


# ----------------------------------------------------------------------------- statistical: generate() follows pi


@lru_cache(maxsize=None)
def pair():
    target_seed, draft_seed = PAIRS[VOCAB]
    return (tiny_llama(target_seed, vocab=VOCAB, layers=1, width=16, init=0.3),
            tiny_llama(draft_seed, vocab=VOCAB, layers=1, width=16, init=0.3))


def expected_joint(rule: str, alpha: float, sampling: SamplingConfig, *, decide_on_warped: bool = False) -> np.ndarray:
    """pi_0(x0) * pi_1(x1 | x0) from plain forward passes of both models (no cache)."""
    target, draft = pair()
    plain = SamplingConfig(temperature=1.0)
    def both(lm, config):  # rows: after the prompt, then after prompt + v for every v
        first = next_token_probs(lm, PROMPT, [()], config)
        return np.concatenate([first, next_token_probs(lm, PROMPT, [(v,) for v in range(VOCAB)], config)])

    p, q, pw, qw = both(target, plain), both(draft, plain), both(target, sampling), both(draft, sampling)
    if decide_on_warped:
        p, q = pw, qw
    pis = np.stack([numpy_pi(rule, alpha, q[i], p[i], qw[i], pw[i]) for i in range(VOCAB + 1)])
    return pis[0][:, None] * pis[1:]


def cascade_counts(n: int, rule: str, alpha: float, sampling: SamplingConfig) -> np.ndarray:
    target, draft = pair()
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for i in range(n):
        out = draftwise.generate(target=target, draft=draft, prompt=PROMPT, method="cascade", rule=rule, alpha=alpha,
                                 gamma=2, max_new_tokens=3, temperature=sampling.temperature, top_k=sampling.top_k,
                                 top_p=sampling.top_p, seed=i, ignore_eos=True)
        counts[tuple(out.token_ids[:2])] += 1
    return counts


# alpha per rule picked so that pi differs from both models' joints (asserted in the test)
CASES = [("token-v3", 0.5), ("token-v2", 0.2), ("token-v1", 0.1), ("opt", 0.1), ("opt-log", 0.1), ("diff", 0.1),
         ("chow", 0.7), ("bild", 3.0)]


@pytest.mark.parametrize("rule, alpha", sweep(CASES, {0, 6}, ids=lambda c: f"{c[0]}-{c[1]}"))
def test_cascade_first_tokens_follow_pi(rule: str, alpha: float):
    expected = expected_joint(rule, alpha, WARPED)
    target_only = expected_joint("chow", -1.0, WARPED)  # always defers: the target's joint
    draft_only = expected_joint("chow", 1.0, WARPED)  # never defers: the draft's joint
    assert tv(expected, target_only) > 0.05 and tv(expected, draft_only) > 0.05  # pi is a real mixture here
    counts = cascade_counts(N_CASCADE, rule, alpha, WARPED)
    p_value = pooled_chisquare(counts, expected)
    print(f"{rule} alpha={alpha}: p = {p_value:.3g}; against the target p = {pooled_chisquare(counts, target_only):.3g}")
    assert p_value > ALPHA
    assert pooled_chisquare(counts, target_only) < ALPHA


def test_control_deferral_on_warped_distributions_is_rejected(monkeypatch):
    """Ignoring §C.1 (deciding on the warped distributions) changes pi; the test catches it."""
    rule, alpha = "token-v3", 0.5
    right, wrong = expected_joint(rule, alpha, WARPED), expected_joint(rule, alpha, WARPED, decide_on_warped=True)
    assert tv(right, wrong) > 0.1
    original = cascades.cascade_pi
    monkeypatch.setattr(cascades, "cascade_pi",
                        lambda r, a, q, p, qw, pw, greedy: original(r, a, qw, pw, qw, pw, greedy=greedy))
    counts = cascade_counts(N_CONTROL, rule, alpha, WARPED)
    p_value = pooled_chisquare(counts, right)
    print(f"control p = {p_value:.3g}; against its own pi p = {pooled_chisquare(counts, wrong):.3g}")
    assert p_value < ALPHA


# ----------------------------------------------------------------------------- token for token


PROMPTS = [[1, 2, 3], [5, 9, 14, 2, 7], [40, 41, 42, 43], [7]]


@pytest.fixture(scope="module")
def models():
    return tiny_llama(0), tiny_llama(1, layers=1)


def run(models, method: str, prompt, **kwargs) -> list[int]:
    target, draft = models
    kwargs.setdefault("max_new_tokens", 24)
    return draftwise.generate(target=target, draft=draft, prompt=prompt, method=method, ignore_eos=True,
                              **kwargs).token_ids


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 1.0])
def test_lemma7_token_v3_at_temperature_0_is_lossy_greedy(models, alpha: float):
    for prompt in PROMPTS:
        for gamma in (1, 3):
            cascade = run(models, "cascade", prompt, rule="token-v3", alpha=alpha, bonus="target", temperature=0,
                          gamma=gamma)
            assert cascade == run(models, "lossy-greedy", prompt, alpha=alpha, temperature=0, gamma=gamma)


def test_token_v3_is_really_lossy_at_temperature_0(models):
    """The equivalence above is not vacuous: with alpha = 0.7 the output departs from greedy decoding."""
    target, _ = models
    greedy = [draftwise.generate(target=target, prompt=p, method="ar", temperature=0, max_new_tokens=24,
                                 ignore_eos=True).token_ids for p in PROMPTS]
    lossy = [run(models, "cascade", p, rule="token-v3", alpha=0.7, temperature=0) for p in PROMPTS]
    assert any(a != b for a, b in zip(greedy, lossy))


@pytest.mark.parametrize("rule", ["chow", "diff", "opt", "token-v1", "token-v3"])
def test_always_deferring_is_sd_token_for_token(models, rule: str):
    """alpha chosen so the rule always defers: pi = S(p) everywhere, the bonus too; same seed, same tokens."""
    always = {"chow": -1.0, "diff": -1.0, "opt": -10.0, "token-v1": -1.0, "token-v3": -1.0}[rule]
    for prompt in PROMPTS:
        for seed in (0, 1):
            kwargs = dict(temperature=0.9, top_k=20, seed=seed, gamma=3)
            # a cascade samples by rejection (its pi is defined by it): sd under the same coupling, keyed alike
            assert run(models, "cascade", prompt, rule=rule, alpha=always, **kwargs) == \
                run(models, "sd", prompt, coupling="rejection", **kwargs)


def test_never_deferring_is_draft_decoding(models):
    """chow with alpha = 1 never defers: pi = S(q), bonus included, so the output is the draft's own decoding."""
    _, draft = models
    for prompt in PROMPTS:
        draft_alone = draftwise.generate(target=draft, prompt=prompt, method="ar", temperature=0, max_new_tokens=24,
                                         ignore_eos=True).token_ids
        for gamma in (1, 4):
            assert run(models, "cascade", prompt, rule="chow", alpha=1.0, temperature=0, gamma=gamma) == draft_alone
    # and at temperature 1 it never rejects
    out = draftwise.generate(target=models[0], draft=draft, prompt=PROMPTS[0], method="cascade", rule="chow", alpha=1.0,
                             max_new_tokens=30, seed=0, ignore_eos=True, temperature=1.0)
    assert out.stats["accepted"] == out.stats["drafted"] > 0
