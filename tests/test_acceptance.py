"""`speculative_sample` (Narasimhan et al. Algorithm 4), `residual`, `output_distribution` and the rules,
on hand-built tensors.

Empirical checks use `ALPHA` = 1e-3 as their significance level (binomial tests and
Pearson chi-square); their draws are cheap, 20,000 per check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, chisquare

from draftwise.rules.acceptance import (
    ExactRule,
    LossyGreedyRule,
    LossyRule,
    output_distribution,
    residual,
)
from draftwise.engine.protocols import StepDistributions
from draftwise.errors import DraftwiseError
from draftwise.engine.sampling import SamplingConfig, make_generator, warp

from conftest import speculative_sample

ALPHA = 1e-3
DRAWS = 20_000


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def tokens(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def random_dist(generator: torch.Generator, vocab: int, *, zeros: int = 0) -> torch.Tensor:
    """A random distribution over `vocab` tokens with `zeros` of them at probability 0."""
    weights = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 3
    if zeros:
        weights[torch.randperm(vocab, generator=generator)[:zeros]] = 0.0
    return (weights / weights.sum()).float()


def chi2_pvalue(counts, probs) -> float:
    """Pearson chi-square p-value of counts against probs (zero-probability cells must be empty)."""
    counts = np.asarray(counts, dtype=float)
    probs = np.asarray(probs, dtype=float)
    support = probs > 0
    assert counts[~support].sum() == 0, "a zero-probability token was drawn"
    expected = counts.sum() * probs[support] / probs[support].sum()
    assert expected.min() >= 5
    return float(chisquare(counts[support], expected).pvalue)




def draw_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


# ----------------------------------------------------------------------------- hand-built cases


def test_draft_equal_to_target_accepts_everything_and_draws_the_bonus():
    draft = t([[0.2, 0.3, 0.5, 0.0], [0.1, 0.1, 0.1, 0.7], [0.25, 0.25, 0.25, 0.25]])
    bonus = t([0.0, 0.0, 1.0, 0.0])
    for seed in range(200):
        generator = make_generator(seed)
        drafted = tokens(*[draw_from(row, generator) for row in draft])
        out = speculative_sample(drafted, draft, draft.clone(), bonus, generator)
        assert (out.num_drafted, out.num_accepted, out.next_token) == (3, 3, 2)
        assert out.bonus


def test_early_rejection_recovers_from_a_one_hot_residual():
    # position 0: pi == draft, accepted for sure; position 1: pi(token 0) = 0, rejected for sure;
    # residual max(0, pi - draft) = [0, 0, 0.5, 0] -> token 2 for sure. Position 2 is never reached.
    draft = t([[0.1, 0.6, 0.3, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    pi = t([[0.1, 0.6, 0.3, 0.0], [0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    bonus = t([0.0, 0.0, 0.0, 1.0])
    for seed in range(200):
        out = speculative_sample(tokens(1, 0, 3), draft, pi, bonus, make_generator(seed))
        assert (out.num_drafted, out.num_accepted, out.next_token) == (3, 1, 2)
        assert not out.bonus


def test_residual_is_norm_of_positive_part():
    pi = t([0.1, 0.4, 0.3, 0.2])
    draft = t([0.3, 0.1, 0.1, 0.5])
    assert torch.allclose(residual(pi, draft), t([0.0, 0.6, 0.4, 0.0]))


def test_draft_token_with_zero_target_probability_is_always_rejected():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        target = random_dist(generator, 8, zeros=3)
        draft = random_dist(generator, 8)
        zero_tokens = (target == 0).nonzero().flatten()
        x = int(zero_tokens[trial % len(zero_tokens)])
        out = speculative_sample(tokens(x), draft[None], target[None], target, make_generator(trial))
        assert out.num_accepted == 0
        assert target[out.next_token] > 0  # recovered from the residual, which is 0 wherever the target is


def test_zero_residual_falls_back_to_norm_pi_without_crashing():
    # pi <= draft everywhere (a sub-normalised pi): max(0, pi - draft) == 0, so multinomial on it would raise.
    # Token 0 has pi = 0 and is rejected; the fallback norm(pi) puts all mass on token 1.
    draft = t([[0.5, 0.5, 0.0, 0.0]])
    pi = t([[0.0, 0.5, 0.0, 0.0]])
    for seed in range(50):
        out = speculative_sample(tokens(0), draft, pi, t([0.0, 0.0, 0.0, 1.0]), make_generator(seed))
        assert (out.num_accepted, out.next_token) == (0, 1)


def test_zero_residual_with_pi_equal_to_draft():
    draft = t([0.2, 0.3, 0.5, 0.0])
    res = residual(draft.clone(), draft)
    assert torch.isfinite(res).all()
    assert torch.allclose(res, draft)
    # rounding-size differences count as zero too: the result is a distribution, never NaN
    res = residual(draft * (1 + 1e-7), draft)
    assert torch.isfinite(res).all() and torch.allclose(res.sum(), torch.tensor(1.0))
    assert torch.allclose(output_distribution(draft, draft.clone()), draft)


def test_sub_normalised_pi_recovers_from_norm_pi_empirically():
    # pi = draft / 2: every token accepted with probability 1/2, residual zero -> recovered ~ norm(pi) = draft.
    draft = t([0.1, 0.2, 0.3, 0.4])
    pi = draft / 2
    generator = make_generator(1)
    recovered = np.zeros(4)
    rejections = 0
    for _ in range(4000):
        x = draw_from(draft, generator)
        out = speculative_sample(tokens(x), draft[None], pi[None], t([1.0, 0, 0, 0]), generator)
        if out.num_accepted == 0:
            rejections += 1
            recovered[out.next_token] += 1
    assert binomtest(rejections, 4000, 0.5).pvalue > ALPHA
    assert chi2_pvalue(recovered, draft) > ALPHA


def test_no_draft_samples_the_bonus():
    empty_tokens = torch.empty(0, dtype=torch.long)
    empty = torch.empty(0, 4)
    out = speculative_sample(empty_tokens, empty, empty, t([0.0, 1.0, 0.0, 0.0]), make_generator(0))
    assert (out.num_drafted, out.num_accepted, out.next_token) == (0, 0, 1)
    assert out.bonus
    bonus = t([0.1, 0.2, 0.3, 0.4])
    generator = make_generator(2)
    counts = np.bincount(
        [speculative_sample(empty_tokens, empty, empty, bonus, generator).next_token for _ in range(DRAWS)],
        minlength=4,
    )
    assert chi2_pvalue(counts, bonus) > ALPHA


def test_same_seed_same_outcome_and_generator_advances():
    generator = torch.Generator().manual_seed(3)
    draft = torch.stack([random_dist(generator, 10) for _ in range(4)])
    pi = torch.stack([random_dist(generator, 10) for _ in range(4)])
    bonus = random_dist(generator, 10)
    drafted = tokens(*[draw_from(row, generator) for row in draft])

    def run(seed: int) -> list:
        g = make_generator(seed)
        return [speculative_sample(drafted, draft, pi, bonus, g) for _ in range(30)]

    first, again = run(11), run(11)
    assert first == again
    # successive calls on one generator draw fresh uniforms (no reseeding inside)
    assert len({(o.num_accepted, o.next_token) for o in first}) > 1
    assert run(12) != first


# ----------------------------------------------------------------------------- output distribution


def test_output_distribution_is_pi_for_normalised_pi():
    generator = torch.Generator().manual_seed(4)
    for zeros in (0, 2, 5):
        for _ in range(50):
            draft = random_dist(generator, 8, zeros=zeros)
            pi = random_dist(generator, 8, zeros=zeros)
            assert torch.allclose(output_distribution(draft, pi), pi, atol=1e-6)


def test_speculative_sample_commits_output_distribution_empirically():
    # Both for a normalised pi (the output is pi) and for lossy's sub/super-normalised pi.
    generator = torch.Generator().manual_seed(5)
    draft = random_dist(generator, 6)
    target = random_dist(generator, 6, zeros=1)
    lossy = LossyRule(alpha=0.4, beta=1.0)
    lossy_pi = lossy(StepDistributions(tokens(0), draft[None], torch.stack([target, target]), torch.zeros(2, 6)))[0]
    assert lossy_pi.sum() > 1.01
    for pi in (target, lossy_pi):
        sampler = make_generator(6)
        counts = np.zeros(6)
        for _ in range(DRAWS):
            x = draw_from(draft, sampler)
            out = speculative_sample(tokens(x), draft[None], pi[None], target, sampler)
            counts[x if out.num_accepted else out.next_token] += 1
        assert chi2_pvalue(counts, output_distribution(draft, pi)) > ALPHA


# ----------------------------------------------------------------------------- acceptance-rate theory


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_frequency_of_one_draft_token_is_total_variation(seed: int):
    """P(reject) = 1 - sum min(p, q) = TV(p, q) (Leviathan et al. 2023, Theorem 3.5)."""
    generator = torch.Generator().manual_seed(100 + seed)
    draft = random_dist(generator, 7)
    target = random_dist(generator, 7, zeros=seed)
    total_variation = 0.5 * float((target.double() - draft.double()).abs().sum())
    assert 0.1 < total_variation < 0.9
    sampler = make_generator(seed)
    rejections = 0
    for _ in range(DRAWS):
        x = draw_from(draft, sampler)
        rejections += speculative_sample(tokens(x), draft[None], target[None], target, sampler).num_accepted == 0
    assert binomtest(rejections, DRAWS, total_variation).pvalue > ALPHA


# ----------------------------------------------------------------------------- Lemma 2 (lossy)


@pytest.mark.parametrize("alpha, beta", [(0.0, 1.0), (0.3, 1.0), (0.3, 0.7), (0.3, 1.5), (0.6, 2.0), (0.9, 1.0)])
def test_lossy_rule_gives_tran_thien_acceptance_and_residual(alpha: float, beta: float):
    """Narasimhan et al. Lemma 2: Algorithm 4 on pi = max{min{q, p/(1-alpha)}, p/beta} accepts with
    min(1, p / ((1 - alpha) q)) (eq. 17) and recovers from norm(max(0, p/beta - q)) (eq. 18)."""
    rule = LossyRule(alpha=alpha, beta=beta)
    generator = torch.Generator().manual_seed(7)
    checked = 0
    for trial in range(200):
        k = 3
        draft = torch.stack([random_dist(generator, 9, zeros=trial % 3) for _ in range(k)]).double()
        target = torch.stack([random_dist(generator, 9, zeros=(trial + 1) % 4) for _ in range(k + 1)]).double()
        drafted = tokens(*[draw_from(row, generator) for row in draft])
        step = StepDistributions(drafted, draft, target, target.log())
        pi = rule(step)
        assert pi.shape == (k, 9)
        for j in range(k):
            q, p = draft[j], target[j]
            support = q > 0
            # acceptance probability of Algorithm 4 for every token the draft can propose
            acceptance = torch.clamp(pi[j][support] / q[support], max=1.0)
            assert torch.allclose(acceptance, torch.clamp(p[support] / ((1 - alpha) * q[support]), max=1.0))
            excess = torch.clamp(p / beta - q, min=0.0)
            if excess.sum() > 1e-3:
                assert torch.allclose(residual(pi[j], q), excess / excess.sum())
                checked += 1
    assert checked > 100


def test_lossy_acceptance_probability_empirically():
    draft = t([0.5, 0.3, 0.2])
    target = t([0.2, 0.2, 0.6])
    alpha = 0.3
    pi = LossyRule(alpha=alpha)(StepDistributions(tokens(0), draft[None], torch.stack([target, target]), torch.zeros(2, 3)))
    expected = min(1.0, 0.2 / ((1 - alpha) * 0.5))  # 0.571...
    generator = make_generator(8)
    accepted = sum(speculative_sample(tokens(0), draft[None], pi, target, generator).num_accepted for _ in range(DRAWS))
    assert binomtest(accepted, DRAWS, expected).pvalue > ALPHA


def test_lossy_rule_validates_parameters():
    with pytest.raises(DraftwiseError):
        LossyRule(alpha=1.0)
    with pytest.raises(DraftwiseError):
        LossyRule(alpha=-0.1)
    with pytest.raises(DraftwiseError):
        LossyRule(alpha=0.3, beta=0.5)  # beta < 1 - alpha
    LossyRule(alpha=0.3, beta=0.7)


def test_exact_rule_is_the_target():
    target = t([[0.1, 0.9], [0.5, 0.5], [0.3, 0.7]])
    step = StepDistributions(tokens(0, 1), t([[1.0, 0.0], [0.0, 1.0]]), target, target.log())
    assert torch.equal(ExactRule()(step), target[:-1])


# ----------------------------------------------------------------------------- LossyGreedyRule (Narasimhan et al. §C.4)


def greedy_step(draft_tokens: list[int], target_probs: list[list[float]], vocab: int) -> StepDistributions:
    """A temperature-0 step: one-hot greedy drafts, target warped to one-hot, raw logits kept."""
    logits = torch.tensor(target_probs, dtype=torch.float64).log().float()
    drafted = tokens(*draft_tokens)
    draft_probs = torch.zeros(len(draft_tokens), vocab).scatter_(1, drafted[:, None], 1.0)
    return StepDistributions(drafted, draft_probs, warp(logits, SamplingConfig(temperature=0)), logits)


def run_greedy(rule: LossyGreedyRule, step: StepDistributions):
    pi = rule(step)
    return speculative_sample(step.draft_tokens, step.draft_probs, pi, step.target_probs[-1], make_generator(0))


@pytest.mark.parametrize(
    "alpha, draft_token, kept",
    [
        # unwarped target [0.5, 0.3, 0.15, 0.05]: keep v iff p(v) >= (1 - alpha) * 0.5
        (0.0, 0, True),  # the argmax is always kept
        (0.0, 1, False),  # alpha 0 = exact greedy
        (0.45, 1, True),  # 0.3 >= 0.275
        (0.35, 1, False),  # 0.3 < 0.325
        (0.5, 2, False),  # 0.15 < 0.25
        (0.72, 2, True),  # 0.15 >= 0.14
        (0.92, 3, True),  # 0.05 >= 0.04
        (0.85, 3, False),  # 0.05 < 0.075
        (1.0, 3, True),  # alpha 1 keeps every draft token
    ],
)
def test_lossy_greedy_keeps_draft_iff_in_top_set(alpha: float, draft_token: int, kept: bool):
    step = greedy_step([draft_token], [[0.5, 0.3, 0.15, 0.05], [0.1, 0.1, 0.1, 0.7]], vocab=4)
    out = run_greedy(LossyGreedyRule(alpha=alpha), step)
    if kept:
        assert (out.num_accepted, out.next_token) == (1, 3)  # bonus: argmax of the next position
    else:
        assert (out.num_accepted, out.next_token) == (0, 0)  # replaced by the target's argmax


def test_lossy_greedy_keeps_a_token_tied_with_the_argmax():
    # p = [0.5, 0.5, 0, ...] exactly: token 1 satisfies p(1) >= (1 - 0) * max p with equality, so it is
    # kept even at alpha 0, although the warped (temperature-0) target is one-hot at token 0.
    logits = torch.tensor([[0.0, 0.0, -1e4, -1e4], [0.0, -1e4, -1e4, -1e4]])
    step = StepDistributions(tokens(1), torch.eye(4)[[1]], warp(logits, SamplingConfig(temperature=0)), logits)
    assert step.target_probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    out = run_greedy(LossyGreedyRule(alpha=0.0), step)
    assert (out.num_accepted, out.next_token) == (1, 0)


def test_lossy_greedy_multi_token_block():
    target = [
        [0.6, 0.3, 0.1, 0.0001],  # draft 1: 0.3 >= 0.5 * 0.6 -> kept
        [0.2, 0.2, 0.55, 0.05],  # draft 0: 0.2 < 0.275 -> replaced by argmax 2
        [0.25, 0.25, 0.25, 0.25],  # never reached
        [0.0, 0.0, 0.0, 1.0],
    ]
    step = greedy_step([1, 0, 3], target, vocab=4)
    out = run_greedy(LossyGreedyRule(alpha=0.5), step)
    assert (out.num_drafted, out.num_accepted, out.next_token) == (3, 1, 2)


def test_lossy_greedy_reads_the_unwarped_target():
    # Warped with top-k 1 the target is one-hot at token 0, yet the rule reads raw logits:
    # token 1 has p = 0.45 >= (1 - 0.2) * 0.5 and is kept. Tokens 2, 3 are not.
    raw = torch.tensor([[0.5, 0.45, 0.04, 0.01], [0.7, 0.1, 0.1, 0.1]]).log()
    warped = warp(raw, SamplingConfig(temperature=1.0, top_k=1))
    rule = LossyGreedyRule(alpha=0.2)
    for token, expected in ((1, (1, 0)), (2, (0, 0))):
        step = StepDistributions(tokens(token), torch.eye(4)[[token]], warped, raw)
        out = speculative_sample(step.draft_tokens, step.draft_probs, rule(step), warped[-1], make_generator(0))
        assert (out.num_accepted, out.next_token) == expected


def test_lossy_greedy_with_alpha_zero_is_greedy_decoding():
    generator = torch.Generator().manual_seed(9)
    for trial in range(100):
        target = torch.stack([random_dist(generator, 6) for _ in range(3)])
        drafted = [int(torch.randint(6, (1,), generator=generator)) for _ in range(2)]
        step = greedy_step(drafted, target.tolist(), vocab=6)
        out = run_greedy(LossyGreedyRule(alpha=0.0), step)
        argmax = target.argmax(-1).tolist()
        agree = 0
        while agree < 2 and drafted[agree] == argmax[agree]:
            agree += 1
        assert out.num_accepted == agree
        assert out.next_token == argmax[agree]


def test_a_rule_declares_whether_it_is_exact():
    """The engine reads `rule.exact` (the Gumbel coupling, argmax acceptance, trees), never the rule's type: only the
    exact rule declares it, under either coupling, and every method declared exact runs a rule that is."""
    from draftwise.methods import METHODS

    assert ExactRule().exact and ExactRule(coupling="rejection").exact
    assert not LossyRule().exact and not LossyGreedyRule().exact
    for name, method in METHODS.items():
        rule = method.make_rule({o.name: o.default for o in method.options})
        assert rule.exact == (type(rule) is ExactRule), name
        if method.exact:
            assert rule.exact, name
