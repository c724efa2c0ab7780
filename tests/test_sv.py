"""Speculative Verification (Kim et al. §4-§5, Appendix D): `sv`, its baselines and their parts.

Exactness (the contract of lossless methods) is tested as in test_exactness.py, with its
helpers (`pooled_chisquare`: Pearson chi-square, cells expected < 5 pooled; `exact_joint`: the
target's warped joint of the first tokens from plain cache-free forwards): the empirical joint of
the first 2 generated tokens over many seeds (seed i per request) is compared with the exact one,
per row, at significance ALPHA = 1e-3 each (6 sampling rows in the tests expected to pass: a
correct package fails about 0.6% of fresh seed sets; the seeds are fixed, so every run gives the
same verdict). Models: tiny Llamas over 8 tokens (64 cells); the companion is the target perturbed
by 0.3 of each weight's std, so (S, A) say a lot about acceptance (I(X; S, A) > 0.1 bit).

The batch is ragged: prompts of 1, 3 and 5 tokens, budgets 2, 4 and 3 (first drafts of 1, 3 and 2
tokens), T=1 and T=0.8 / top-k 5 rows, plus a greedy row that must give the target's argmax pair
every time. The latency model (`linear_latency`) makes a verified drafted token cost half a
row's step, so the select phase both keeps and drops tokens, differently per row: each run
asserts that it did (proposed > drafted, partial prefixes, rows choosing differently in a step).
1000 runs per row batched (24 rows an engine), 600 for the single-request run and the control.

Findings:
  - SV as the paper writes it is NOT exact at T > 0. Deciding whether drafted token i is verified
    from A_i = min(1, P_c(t_i) / P_d(t_i)), a function of the token t_i itself, leaves a verified
    token no longer distributed as P_d, so the exact rule (which divides by P_d) no longer yields
    the target's distribution (observed: p = 5e-12, 5e-14, 1e-20 on the three sampling rows
    batched, 5e-8 on the single request). §4's argument ("a dropped position is drawn from the
    target") misses this. `sv` therefore decides on token i from E_{t ~ P_d}[P(accept | S_i, A(t))],
    known before t_i is drawn (`GoodputSelector.before_draw`), and uses the actual A of the tokens
    before i; `ActualAGoodputSelector` keeps the paper's reading as a negative control.
  - negative controls: a selection that reads the target (`PeekingSelector`) and the actual-A
    selection are both rejected.
  - staged: both caches kept a token the companion had replaced, and a row that drafted nothing drew a
    uniform only when batch-mates drafted; the regression tests below failed before the fix.

Runtime: about 35 s on one CPU thread (the five goodness-of-fit runs take about 5 s each).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
from functools import lru_cache

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import draftwise
import draftwise.atomic as atomic
from conftest import near_copy, tiny_llama
from draftwise.selectors import sv
from draftwise.bench import sv_profile
from draftwise.rules.acceptance import ExactRule
from draftwise.drafters.base import ModelRowsDrafter
from draftwise.engine.core import Engine
from draftwise.engine.protocols import RowsDraft
from draftwise.engine.rows import Request
from draftwise.errors import DraftwiseError
from draftwise.models.loading import LoadedModel
from draftwise.models.runner import ModelRunner
from draftwise.engine.sampling import SamplingConfig, make_generator, unwarped, warp
from draftwise.drafters.companion import CompanionRowsDrafter, StagedRowsDrafter
from draftwise.selectors.selection import GoodputSelector, HistorySelector, indicator_pair
from test_exactness import ALPHA, exact_joint, model as small_llama, pooled_chisquare

V = 8  # vocabulary of the exactness models
GAMMA = 3
PLAIN = SamplingConfig(temperature=1.0)
WARPED = SamplingConfig(temperature=0.8, top_k=5)
GREEDY = SamplingConfig(temperature=0.0)
VERIFY_COST = 0.5  # a verified drafted token costs half a row's step (see linear_latency)
GREEDY_COST = 0.2  # the same in the greedy tests, where the 64-token models accept less


# ---------------------------------------------------------------- models and profiles


@lru_cache(maxsize=None)
def trio() -> tuple[LoadedModel, LoadedModel, LoadedModel]:
    """(target, draft, companion) over 8 tokens, named so that profiles can tell them apart."""
    target = small_llama(2, V)
    return (LoadedModel(model=target, name="tiny-target"), LoadedModel(model=small_llama(10, V), name="tiny-draft"),
            LoadedModel(model=near_copy(target, 0.3, seed=5), name="tiny-companion"))


@lru_cache(maxsize=None)
def trio64() -> tuple[LoadedModel, LoadedModel, LoadedModel]:
    """A 64-token trio for the greedy (token for token) tests: longer, more varied outputs."""
    target = tiny_llama(0)
    return (LoadedModel(model=target, name="t64"), LoadedModel(model=near_copy(target, 0.1, seed=5), name="d64"),
            LoadedModel(model=near_copy(target, 0.1, seed=9), name="c64"))


def linear_latency(cost: float, gamma: int = GAMMA) -> sv.LatencyModel:
    """A packed latency model where a step costs (rows + cost x drafted tokens verified) and drafting is free.

    Tabulated at 1 and 2 rows; at a fixed width both tables are linear in the rows, so the model's
    interpolation and extrapolation are exact, and the long-row table equals the mean-width one at the
    same total (no long-row term): `test_linear_latency_model_is_rows_plus_cost_per_token` checks it."""
    widths = range(gamma + 1)
    return sv.LatencyModel(rows=[1, 2], verify=[[1 + cost * j for j in widths], [2 + 2 * cost * j for j in widths]],
                           draft=[0.0, 0.0], companion=[0.0, 0.0],
                           verify_long=[[1 + cost * j for j in widths], [2 + cost * j for j in widths]], packed=True)


@lru_cache(maxsize=None)
def built_profile(size: int, temperature: float, cost: float = VERIFY_COST, companion_name: str = ""
                  ) -> tuple[sv.SVProfile, dict]:
    """A profile built by the real pipeline (collect_samples, build_profile) for a trio, with linear_latency;
    `companion_name`: load that companion for the trio's target in place of the trio's (e.g. "ngram")."""
    target, draft, companion = trio() if size == V else trio64()
    if companion_name:
        from draftwise.drafters.ngram_companion import load_companion

        companion = load_companion(companion_name, target)
    sampling = SamplingConfig(temperature=temperature)
    prompts = [[i % size, (3 * i + 1) % size, (5 * i + 2) % size] for i in range(16)]
    samples = sv_profile.collect_samples(target, draft, companion, prompts, sampling=sampling, gamma=GAMMA,
                                         max_new_tokens=12, batch_size=8, vocab_size=size,
                                         eos_token_ids=frozenset())
    setting = sv.profile_setting(target.name, draft.name, companion.name, sampling)
    return sv_profile.build_profile(samples, linear_latency(cost), setting), samples


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    """The T=1 profile of the 8-token trio, saved."""
    path = tmp_path_factory.mktemp("sv") / "profile.json"
    built_profile(V, 1.0)[0].save(path)
    return path


# ---------------------------------------------------------------- selectors used by the tests


class Watch:
    """Wraps a selector and records (proposed counts, chosen counts) per step."""

    def __init__(self, inner) -> None:
        self.inner, self.steps = inner, []
        self.discards = inner.discards

    def limits(self, rows, limits):
        return self.inner.limits(rows, limits)

    def select(self, rows, draft):
        chosen = self.inner.select(rows, draft)
        self.steps.append((list(draft.counts), [int(c) for c in chosen]))
        return chosen

    def observe(self, *args) -> None:
        self.inner.observe(*args)


class PreDrawGoodputSelector(GoodputSelector):
    """SV's scheduler with drafted token i scored by E_{t ~ P_d}[P(accept | S_i, A(t))]: known before t_i is
    drawn (S_i and the distributions at i follow from the tokens before i), so whether t_i is verified does not
    depend on t_i and the exact rule stays exact. The positive control of the select phase."""

    def estimates(self, rows, draft):
        s, _ = indicator_pair(rows, draft)
        k = draft.width
        greedy = torch.tensor([r.request.sampling.greedy for r in rows])[:, None, None]
        q_d = torch.where(greedy, draft.draft_raw, draft.probs)
        q_c = torch.where(greedy, draft.companion_raw[:, :k], draft.companion_probs[:, :k])
        a = torch.where(q_d > 0, q_c / q_d.clamp(min=1e-30), torch.ones_like(q_d)).clamp(max=1.0)  # A of every token
        p_hat = self.table.lookup(s[..., None].expand_as(a).contiguous(), a.contiguous())  # [rows, k, vocab]
        expected = (p_hat * draft.probs.double()).sum(-1)  # over the distribution t_i is drawn from
        return [row[:n] for row, n in zip(expected.tolist(), draft.counts)]


class ActualAGoodputSelector(GoodputSelector):
    """NEGATIVE CONTROL: SV as first written, deciding whether to verify token i from its actual A_i (a function
    of t_i itself): the verified tokens are then not distributed as the draft's q, so the output is not exact."""

    def before_draw(self, rows, draft):
        return None


class PeekingSelector(GoodputSelector):
    """NEGATIVE CONTROL: scores each drafted token by its true acceptance probability min(1, p(t) / q(t)), read
    off the target model (a cache-free forward): a selection that looks at the target, which no rule can
    make exact."""

    def __init__(self, model, latency) -> None:
        super().__init__(None, latency, lookahead=None)
        self.model = model

    def before_draw(self, rows, draft):
        return None  # the decision reads the target's view of the token itself

    def estimates(self, rows, draft):
        out = []
        for b, row in enumerate(rows):
            n, start = draft.counts[b], len(row.sequence) - 1
            if n == 0:
                out.append([])
                continue
            ids = torch.tensor([row.sequence + draft.tokens[b, :n].tolist()])
            p = warp(self.model(ids).logits[0, start : start + n], row.request.sampling)
            out.append(sv.acceptance_probability(draft.probs[b : b + 1, :n], p[None], draft.tokens[b : b + 1, :n])[0]
                       .tolist())
        return out


# ---------------------------------------------------------------- exactness at T > 0


class NotTargetDistribution(AssertionError):
    """The goodness-of-fit test rejected the target's distribution (the only failure an xfail below expects)."""


ROWS = (  # (prompt, sampling, max_new_tokens); the greedy row runs every 4th round
    ((5,), PLAIN, 2),
    ((1, 2, 3), WARPED, 4),
    ((7, 0, 4, 2, 6), PLAIN, 3),
    ((3, 3), GREEDY, 4),
)


def run_rows(kind: str, n: int, batch: int, rows=ROWS, coupling: str = "gumbel"):
    """n requests per row (seed i * len(rows) + b), through an engine of `batch` rows; returns the first-two-token
    counts per row, summed stats and the select phase's record (None for staged)."""
    target, draft, companion = trio()
    profile = built_profile(V, 1.0)[0]
    table, latency = profile.table("adaptive"), profile.latency
    inner = ModelRowsDrafter(ModelRunner(draft.model, vocab_size=V, rows=0), V, keep_raw=True)
    companion_runner = ModelRunner(companion.model, vocab_size=V, rows=0)
    drafter = (StagedRowsDrafter if kind == "staged" else CompanionRowsDrafter)(inner, companion_runner, V)
    selector = {"sv": lambda: GoodputSelector(table, latency, lookahead=None),
                "sv-lookahead": lambda: GoodputSelector(table, latency),  # drafts past recent selections trimmed
                "actual-a": lambda: ActualAGoodputSelector(table, latency, lookahead=None),
                "pre-draw": lambda: PreDrawGoodputSelector(table, latency, lookahead=None),
                "peek": lambda: PeekingSelector(target.model, latency), "staged": lambda: None}[kind]()
    watch = Watch(selector) if selector is not None else None
    engine = Engine(ModelRunner(target.model, vocab_size=V, rows=0), drafter, ExactRule(coupling=coupling),
                    gamma=GAMMA, max_batch_size=batch, selector=watch, stream_text=False)
    ids = []
    for i in range(n):
        for b, (prompt, sampling, budget) in enumerate(rows):
            if not sampling.greedy or i % 4 == 0:
                ids.append((b, engine.submit(Request(prompt, sampling, max_new_tokens=budget,
                                                     seed=i * len(rows) + b))))
    engine.run()
    counts = [np.zeros((V, V), dtype=np.int64) for _ in rows]
    totals = {"drafted": 0, "accepted": 0, "proposed": 0}
    for b, rid in ids:
        result = engine.result(rid)
        counts[b][tuple(result.token_ids[:2])] += 1
        for key in totals:
            totals[key] += result.stats.get(key, 0)
    return counts, totals, watch


def p_values(counts, rows=ROWS) -> list[float]:
    """Per sampling row: the chi-square p-value against the exact joint; per greedy row: 1 if every run gave the
    target's argmax pair, else 0."""
    target = trio()[0].model
    out = []
    for b, (prompt, sampling, _) in enumerate(rows):
        expected = exact_joint(target, list(prompt), sampling, 2)
        if sampling.greedy:
            out.append(1.0 if counts[b][expected > 0.5].sum() == counts[b].sum() else 0.0)
        else:
            out.append(pooled_chisquare(counts[b], expected))
    return out


def check_select_phase_worked(watch: Watch, batch: int) -> None:
    """The selection kept some drafted tokens and dropped others, per row, and (batched) differently per row."""
    partial = dropped_all = kept_all = differ = False
    for proposed, chosen in watch.steps:
        assert len(chosen) == len(proposed) and all(0 <= c <= p for c, p in zip(chosen, proposed))
        drafted = [(p, c) for p, c in zip(proposed, chosen) if p > 0]
        partial |= any(0 < c < p for p, c in drafted)
        dropped_all |= any(c == 0 for p, c in drafted)
        kept_all |= any(c == p for p, c in drafted)
        differ |= len({c for _, c in drafted}) > 1
    assert partial and dropped_all and kept_all, "the selection never verified a partial prefix / nothing / everything"
    assert differ or batch == 1, "no step verified different prefixes in different rows"


@pytest.mark.parametrize("kind, batch, n, rows", [  # the sweep past the first two: `make test-slow`
    pytest.param("sv", 24, 1000, ROWS, id="sv-batched-ragged"),
    pytest.param("sv", 1, 600, ROWS[1:2], id="sv-single"),
    pytest.param("sv-lookahead", 24, 1000, ROWS, id="sv-lookahead-batched-ragged", marks=pytest.mark.slow),
    pytest.param("pre-draw", 24, 1000, ROWS, id="pre-draw-selection-batched-ragged", marks=pytest.mark.slow),
    pytest.param("staged", 24, 1000, ROWS, id="staged-batched-ragged", marks=pytest.mark.slow),
])
def test_methods_follow_the_target_distribution(kind, batch, n, rows):
    counts, totals, watch = run_rows(kind, n, batch, rows)
    assert 0 < totals["accepted"] < totals["drafted"], totals  # drafts were verified, accepted and rejected
    if watch is not None:
        assert totals["proposed"] > totals["drafted"], totals  # the select phase dropped drafted tokens
        if kind != "sv-lookahead":  # (its drafts are cut to what rows verified lately: partial prefixes are rare)
            check_select_phase_worked(watch, batch)
    ps = p_values(counts, rows)
    print(kind, batch, totals, ps)
    if min(ps) <= ALPHA:
        raise NotTargetDistribution(f"{kind}: p-values per row {ps}")


@pytest.mark.parametrize("kind", ["peek", "actual-a"])
def test_control_a_selection_that_reads_the_token_it_verifies_is_rejected(kind):
    """Two selections the test must catch: one reading the target's acceptance of each token, and SV scoring
    token i by its own A_i (the paper's reading, which this package corrected). Under rejection sampling: with the
    Gumbel coupling (the default) every committed token is the target's own draw whatever was verified, so no
    selection can bias it."""
    counts, totals, watch = run_rows(kind, 600, 24, coupling="rejection")
    assert totals["proposed"] > totals["drafted"] > 0
    ps = p_values(counts)
    print(kind, totals, ps)
    assert min(ps) < ALPHA, f"a selection that reads the token it verifies was not detected: {ps}"


# ---------------------------------------------------------------- temperature 0: token for token, batch invariance


@pytest.fixture(scope="module")
def greedy_profile_path(tmp_path_factory) -> str:
    """The greedy (T=0) profile of the 64-token trio, saved."""
    path = tmp_path_factory.mktemp("sv-greedy") / "greedy.json"
    built_profile(64, 0.0, GREEDY_COST)[0].save(path)
    return str(path)


PROMPTS64 = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12]]


def _generate64(method: str, prompts, profile: str, **kwargs):
    target, draft, companion = trio64()
    options = {}
    if method in ("sv", "staged"):
        options["companion"] = companion
    if method in ("sv", "adaptive-verify", "smartspec"):
        options["profile"] = profile
    return draftwise.generate(target, prompts, draft=draft if method != "ar" else None, method=method,
                              max_new_tokens=20, gamma=4, ignore_eos=True, seed=3, **options, **kwargs)


@pytest.mark.parametrize("method", ["sv", "adaptive-verify", "smartspec", "svip", "staged"])
def test_greedy_equals_the_target_token_for_token_batched_and_alone(method, greedy_profile_path):
    """Temperature 0: batched (ragged prompts) and each request alone reproduce `ar` token for token."""
    profile = greedy_profile_path
    ar = [g.token_ids for g in _generate64("ar", PROMPTS64, profile, temperature=0.0)]
    batched = _generate64(method, PROMPTS64, profile, temperature=0.0)
    alone = [_generate64(method, p, profile, temperature=0.0) for p in PROMPTS64]
    assert [g.token_ids for g in batched] == ar
    assert [g.token_ids for g in alone] == ar
    drafted = sum(g.stats["drafted"] for g in batched)
    assert drafted > 0 and sum(g.stats["accepted"] for g in batched) > 0, method  # drafts were verified and kept
    if method in ("sv", "adaptive-verify"):
        assert sum(g.stats["proposed"] for g in batched) > drafted  # and some were dropped unverified


def test_staged_batched_request_equals_the_request_alone_at_temperature_1():
    """Regression: the companion stage drew a uniform for rows that drafted nothing only when batch-mates drafted,
    so a request's tokens depended on its batch."""
    target, draft, companion = trio64()
    kwargs = dict(draft=draft, method="staged", companion=companion, max_new_tokens=20, gamma=4, ignore_eos=True,
                  temperature=1.0)
    for seed in range(3):
        batched = draftwise.generate(target, PROMPTS64, seed=seed, **kwargs)
        alone = [draftwise.generate(target, p, seed=seed, **kwargs) for p in PROMPTS64]
        assert [g.token_ids for g in batched] == [g.token_ids for g in alone], seed


def test_generate_runs_the_profiled_selector(tmp_path):
    """generate(method="sv", profile=...) alone equals an engine of one row with GoodputSelector over the profile's
    adaptive table (bins="equal": the equal-width table), token for token at T=1; the two tables choose
    differently, so the comparison tells them apart. (A verified token costs 0.4 of a step here, under the
    profile's mean acceptance, so a new request drafts from its first step.)"""
    target, draft, companion = trio()
    profile_path = tmp_path / "profile.json"
    built_profile(V, 1.0, 0.4)[0].save(profile_path)
    profile = sv.SVProfile.load(profile_path)
    assert GoodputSelector(profile.table("adaptive"), profile.latency).expected_pays(1, GAMMA)
    outputs = {}
    for bins in ("adaptive", "equal"):
        for seed in range(2):
            got = draftwise.generate(target, [1, 2, 3], draft=draft, method="sv", companion=companion,
                                     profile=str(profile_path), bins=bins, max_new_tokens=16, gamma=GAMMA, seed=seed,
                                     ignore_eos=True, temperature=1.0)
            inner = ModelRowsDrafter(ModelRunner(draft.model, vocab_size=V, rows=0), V, keep_raw=True)
            drafter = CompanionRowsDrafter(inner, ModelRunner(companion.model, vocab_size=V, rows=0), V)
            engine = Engine(ModelRunner(target.model, vocab_size=V, rows=0), drafter, ExactRule(), gamma=GAMMA,
                            max_batch_size=1, selector=GoodputSelector(profile.table(bins), profile.latency))
            rid = engine.submit(Request((1, 2, 3), PLAIN, max_new_tokens=16, seed=seed))
            engine.run()
            assert got.token_ids == engine.result(rid).token_ids, (bins, seed)
            assert got.stats["drafted"] == engine.result(rid).stats["drafted"], (bins, seed)
            assert got.stats["proposed"] > got.stats["drafted"]
            outputs[bins, seed] = got.stats["drafted"]
    # under the Gumbel coupling a selector cannot change the answer (every token is the target's own draw): what
    # the two tables send to the target tells them apart
    assert any(outputs["adaptive", seed] != outputs["equal", seed] for seed in range(2))


# ---------------------------------------------------------------- E(N | gamma) (Def. D.4)


@pytest.mark.parametrize("p", [[0.9, 0.8, 0.5, 0.3], [1.0, 1.0, 0.0, 1.0], [0.2], [0.97, 0.1, 0.99, 0.6, 0.45]])
def test_expected_accepted_agrees_with_definition_and_simulation(p):
    expected = sv.expected_accepted(p)
    assert len(expected) == len(p) + 1 and expected[0] == 0.0
    for gamma in range(len(p) + 1):
        exactly = sv.prob_accepted_exactly(p, gamma)
        assert len(exactly) == gamma + 1 and min(exactly) >= 0.0
        assert math.isclose(sum(exactly), 1.0, abs_tol=1e-12)
        assert math.isclose(expected[gamma], sum(i * q for i, q in enumerate(exactly)), abs_tol=1e-12)  # eq. (4)
    steps = np.diff(expected)
    assert np.all(np.diff(steps) <= 1e-12)  # Lemma D.11: increasing and concave in gamma
    with pytest.raises(ValueError):
        sv.prob_accepted_exactly(p, len(p) + 1)

    # Monte Carlo: N = the leading run of successes among gamma Bernoulli(p_i) trials
    rng = np.random.default_rng(0)
    n = 100_000
    lead = np.cumprod(rng.random((n, len(p))) < np.array(p), axis=1).sum(1)
    for gamma in range(1, len(p) + 1):
        accepted = np.minimum(lead, gamma)
        sd = max(float(accepted.std()), 1e-12)
        assert abs(accepted.mean() - expected[gamma]) < 5 * sd / math.sqrt(n), gamma  # 5 standard errors
    exactly = np.array(sv.prob_accepted_exactly(p, len(p)))
    observed = np.bincount(lead, minlength=len(p) + 1)
    assert observed[exactly == 0].sum() == 0
    live = exactly > 0
    if live.sum() > 1:
        assert chisquare(observed[live], exactly[live] * n).pvalue > ALPHA


def test_expected_accepted_control_catches_a_wrong_formula():
    """The simulation above rejects E(N | gamma) = sum of p_i (no products), the classic slip."""
    p = [0.9, 0.8, 0.5, 0.3]
    rng = np.random.default_rng(0)
    n = 100_000
    lead = np.cumprod(rng.random((n, len(p))) < np.array(p), axis=1).sum(1)
    accepted = np.minimum(lead, len(p))
    assert abs(accepted.mean() - sum(p)) > 5 * accepted.std() / math.sqrt(n)


# ---------------------------------------------------------------- entropy and information gain (Table 1)


def test_information_gain_known_answers():
    # a hand-computed case: X = [0, 0, 1, 1], cells [0, 0, 0, 1]
    x, cell = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 0, 1])
    h = -(1 / 3) * math.log2(1 / 3) - (2 / 3) * math.log2(2 / 3)  # X in cell 0: {0, 0, 1}
    out = sv.information_gain(x, cell, 2, 2)
    assert math.isclose(out["H_X"], 1.0, abs_tol=1e-12)
    assert math.isclose(out["H_X_given"], 0.75 * h, abs_tol=1e-12)
    assert math.isclose(out["I"], 1.0 - 0.75 * h, abs_tol=1e-12)
    mm = 1 / (2 * 4 * math.log(2))  # Miller-Madow: (occupied - 1) / (2 n ln 2) on H(X), H(X, C), H(C)
    assert math.isclose(out["H_X_mm"], 1.0 + mm, abs_tol=1e-12)
    assert math.isclose(out["H_X_given_mm"], 0.75 * h + (3 - 2) * mm, abs_tol=1e-12)
    assert out["samples"] == 4 and out["cells_occupied"] == 2
    assert math.isclose(sv.entropy(torch.tensor([1, 1, 2, 0])), 1.5, abs_tol=1e-12)
    assert sv.entropy(torch.zeros(3)) == 0.0

    generator = torch.Generator().manual_seed(0)
    n = 20_000
    cell = torch.randint(0, 8, (n,), generator=generator)
    # X a function of the cell: knowing the cell removes all uncertainty, I = H(X)
    out = sv.information_gain(cell % 4, cell, 4, 8)
    assert abs(out["H_X_given"]) < 1e-12 and math.isclose(out["I"], out["H_X"], abs_tol=1e-12)
    assert abs(out["H_X"] - 2.0) < 0.01
    # X independent of the cell: I ~ 0; the plug-in bias is (cells - 1)(bins - 1) / (2 n ln 2), times a
    # chi-square(21) / 21 variable (below 3 with probability 1 - 1e-6); Miller-Madow removes the bias
    out = sv.information_gain(torch.randint(0, 4, (n,), generator=generator), cell, 4, 8)
    bias = 7 * 3 / (2 * n * math.log(2))
    assert 0.0 <= out["I"] < 3 * bias
    assert abs(out["I_mm"]) < 2 * bias
    assert abs(out["I"] - out["I_mm"] - bias) < 1e-12


def test_acceptance_table_bins_and_shrinks_towards_the_mean():
    # bins are closed on the left (Def. D.8: s0 <= S < s1); 1.0 falls in the last bin
    edges = [0.0, 0.5, 1.0]
    assert sv.bucket(torch.tensor([0.0, 0.49, 0.5, 1.0], dtype=torch.float64), edges).tolist() == [0, 0, 1, 1]
    s = torch.tensor([0.1, 0.1, 0.9, 0.9, 0.9], dtype=torch.float64)
    a = torch.tensor([0.2, 0.2, 0.8, 0.8, 0.2], dtype=torch.float64)
    x = torch.tensor([0.0, 0.5, 1.0, 0.9, 0.4], dtype=torch.float64)
    table = sv.AcceptanceTable.fit(s, a, x, edges, edges)
    prior, w = float(x.mean()), sv.AcceptanceTable.PRIOR_WEIGHT
    assert table.count == [[2, 0], [1, 2]]
    assert math.isclose(table.mean[0][0], (0.5 + w * prior) / (2 + w))
    assert math.isclose(table.mean[0][1], prior)  # an empty cell is the global mean
    assert math.isclose(table.mean[1][1], (1.9 + w * prior) / (2 + w))
    got = table.lookup(torch.tensor([0.95, 0.3]), torch.tensor([0.6, 0.1]))
    assert torch.allclose(got, torch.tensor([table.mean[1][1], table.mean[0][0]], dtype=torch.float64))
    assert sv.AcceptanceTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    edges = sv.quantile_edges(torch.tensor([1.0] * 50 + [0.3] * 50), 8)  # a point mass at 1 merges duplicates
    assert edges[0] == 0.0 and edges[-1] == 1.0 and edges == sorted(set(edges))


# ---------------------------------------------------------------- §5: the scheduler


def goodput(p, chosen, cost) -> float:
    """Estimated committed tokens (1 + E(N | chosen) per row) per unit of cost."""
    return sum(1 + sv.expected_accepted(row)[c] for row, c in zip(p, chosen)) / cost(list(chosen))


def test_schedule_reaches_the_brute_force_optimum_under_a_packed_cost():
    """With a packed cost (fixed + per row + per verified token) the greedy is optimal: within a row the marginal
    gains prod_{j<=i} p_j never increase, so the k best gains over all rows form a prefix selection and are the
    best k-token selection; goodput as a function of k rises while the next gain exceeds cost-per-token x
    goodput and falls after (the gains only shrink), so stopping at the first non-improvement is the peak.
    (Padded costs, which charge the longest row, are not covered by this argument.)"""
    rng = random.Random(0)
    for _ in range(400):
        rows = rng.randint(1, 3)
        p = [[rng.choice([0.0, 1.0, rng.random(), rng.random() ** 3, rng.random() ** 0.3])
              for _ in range(rng.randint(0, 3))] for _ in range(rows)]
        fixed, per_row, per_token = rng.uniform(0, 2), rng.uniform(0.1, 2), rng.uniform(0.01, 1.5)

        def cost(chosen):
            return fixed + per_row * len(chosen) + per_token * sum(chosen)

        got = sv.schedule(p, cost)
        assert len(got) == rows and all(0 <= c <= len(row) for c, row in zip(got, p))  # every row, a prefix each
        best = max(goodput(p, c, cost) for c in itertools.product(*(range(len(row) + 1) for row in p)))
        assert goodput(p, got, cost) >= best * (1 - 1e-12), (p, got)
        if rows == 1:
            assert got[0] == sv.best_single_length(p[0], lambda g: cost([g]))


def test_schedule_extremes_and_no_starvation():
    p = [[0.9, 0.8, 0.7], [0.5], [], [0.99, 0.01]]
    assert sv.schedule(p, lambda c: len(c) + 1e9 * sum(c)) == [0, 0, 0, 0]  # too expensive: nothing drafted
    assert sv.schedule(p, lambda c: 1.0) == [3, 1, 0, 2]  # free: everything with a positive gain
    assert sv.schedule([], lambda c: 1.0) == []
    # by hand: goodput 2/2 -> +0.95 (row 1): 2.95/2.8 = 1.054 -> +0.9 (row 0): 3.85/3.6 = 1.069 -> +0.9 * 0.8:
    # 4.57/4.4 = 1.039, lower: stop with one token each
    assert sv.schedule([[0.9, 0.8], [0.95]], lambda c: 2 + 0.8 * sum(c)) == [1, 1]
    # padded cost (every row pays for the longest): row 0's third token does not pay (4.439 / 3.1 < 3.71 / 2.4 per
    # row), which closes row 0 only; row 1's tokens, below the longest row, are free and still taken (the optimum)
    assert sv.schedule([[0.9, 0.9, 0.9], [0.3, 0.3]], lambda c: len(c) * (1 + 0.35 * max(c))) == [2, 2]


def test_engine_never_starves_a_row_and_the_cost_decides_what_is_verified():
    """Every live row commits at least one token per step, whatever the cost; free verification verifies every
    drafted token, prohibitive verification none (and then nothing is drafted at all: no draft could pay, so the
    draft model and the companion never run, not even on the prompts: admission feeds them nothing)."""
    target, draft, companion = trio()
    table = built_profile(V, 1.0)[0].table("adaptive")
    for cost, expect in ((1e9, "none"), (0.0, "all"), (VERIFY_COST, "some")):
        inner = ModelRowsDrafter(ModelRunner(draft.model, vocab_size=V, rows=0), V, keep_raw=True)
        drafter = CompanionRowsDrafter(inner, ModelRunner(companion.model, vocab_size=V, rows=0), V)
        engine = Engine(ModelRunner(target.model, vocab_size=V, rows=0), drafter, ExactRule(), gamma=GAMMA,
                        max_batch_size=4, selector=GoodputSelector(table, linear_latency(cost)))
        ids = [engine.submit(Request(tuple(p), PLAIN, max_new_tokens=n, seed=s))
               for s, (p, n) in enumerate([((1,), 9), ((2, 3, 4), 12), ((5, 6), 7), ((7,) * 6, 10), ((0,), 5)])]
        while engine.has_work:
            live = {row.id for row in engine.live}  # (a request admitted now decodes once its prompt is fed)
            events = engine.step()
            assert live <= {e.request_id for e in events} and all(len(e.token_ids) >= 1 for e in events)
        stats = [engine.result(i).stats for i in ids]
        drafted, proposed = sum(s["drafted"] for s in stats), sum(s["proposed"] for s in stats)
        if expect == "none":
            assert proposed == 0 and drafted == 0 and all(s["steps"] == s["new_tokens"] for s in stats)
            assert inner.runner.tokens_processed == 0 and inner.runner.calls == 0  # not even the prompts
            assert drafter.companion.tokens_processed == 0  # nor the companion
        elif expect == "all":
            assert drafted == proposed > 0
        else:
            assert 0 < drafted < proposed


def test_linear_latency_model_is_rows_plus_cost_per_token():
    latency = linear_latency(0.4)
    rng = random.Random(1)
    for _ in range(50):
        counts = [rng.randint(1, GAMMA + 3) for _ in range(rng.randint(1, 40))]  # past the tables, both ways
        assert math.isclose(latency.verify_ms(counts), len(counts) + 0.4 * sum(c - 1 for c in counts))
    again = sv.LatencyModel.from_dict(json.loads(json.dumps(latency.to_dict())))
    assert again == latency
    padded = sv.LatencyModel(rows=latency.rows, verify=latency.verify, draft=latency.draft,
                             companion=latency.companion)  # unpacked: every row pays for the longest
    assert math.isclose(padded.verify_ms([1, 4, 2]), 3 * (1 + 0.4 * 3))


# ---------------------------------------------------------------- profiles


def test_profile_samples_record_the_exact_acceptance_probability():
    """X is min(1, p/q), the probability the rule accepts the token: at the positions the rule decided, the
    accepted fraction matches the mean of X (normal approximation, two-sided, at ALPHA)."""
    profile, samples = built_profile(V, 1.0)
    s, a, x = (torch.tensor(samples[k], dtype=torch.float64) for k in ("s", "a", "x"))
    assert len(x) > 200 and all(0.0 <= float(t.min()) and float(t.max()) <= 1.0 for t in (s, a, x))
    decided = torch.tensor(samples["accepted"]) >= 0
    outcome = torch.tensor(samples["accepted"])[decided].double()
    z = float((outcome.sum() - x[decided].sum()) / (x[decided] * (1 - x[decided])).sum().sqrt())
    assert abs(z) < 3.29, z  # |z| > 3.29 with probability 1e-3
    assert profile.report["resolutions"]["adaptive"]["I"] > 0.1  # the companion says a lot about acceptance


def test_profile_save_is_atomic(tmp_path, monkeypatch):
    profile = built_profile(V, 1.0)[0]
    path = tmp_path / "p.json"
    profile.save(path)
    assert sv.SVProfile.load(path).to_dict() == json.loads(json.dumps(profile.to_dict()))
    before = path.read_bytes()
    other = sv.SVProfile(dict(profile.setting, draft="another"), profile.tables, profile.latency, {})

    def half_written(obj, f, **kwargs):
        f.write('{"version": 1, "setting": {')  # a crash part-way through the write
        raise OSError("disk full")

    monkeypatch.setattr(atomic.json, "dump", half_written)
    with pytest.raises(OSError, match="disk full"):
        other.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["p.json"]  # no temporary file left

    def no_rename(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(atomic.os, "replace", no_rename)
    with pytest.raises(OSError, match="rename failed"):
        other.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["p.json"]
    other.save(path)
    assert sv.SVProfile.load(path).setting["draft"] == "another"


def _generate_sv(method="sv", **overrides):
    target, draft, companion = trio()
    target = overrides.pop("target", target)
    kwargs = dict(draft=draft, method=method, max_new_tokens=4, gamma=GAMMA, seed=0, ignore_eos=True,
                  temperature=1.0)  # the profile's setting
    if method == "sv":
        kwargs["companion"] = companion
    kwargs.update(overrides)
    return draftwise.generate(target, [1, 2, 3], **kwargs)


def _refused(match: str, **kwargs) -> str:
    with pytest.raises(DraftwiseError, match=match) as info:
        _generate_sv(**kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message  # one clear line
    return message


def test_a_profile_for_another_setting_is_refused(profile_path):
    target, draft, companion = trio()
    path = str(profile_path)
    assert len(_generate_sv(profile=path).token_ids) == 4  # the matching setting runs
    _refused("draft='tiny-draft', not 'other-draft'", profile=path, draft=LoadedModel(model=draft.model, name="other-draft"))
    _refused("companion='tiny-companion', not 'other'", profile=path,
             companion=LoadedModel(model=companion.model, name="other"))
    _refused("target='tiny-target', not 'other-target'", profile=path,
             target=LoadedModel(model=target.model, name="other-target"))
    _refused("temperature=1.0, not 0.7", profile=path, temperature=0.7)
    _refused("temperature=1.0, not 0.0", profile=path, temperature=0.0)
    _refused("top_k=0, not 5", profile=path, top_k=5)
    _refused("top_p=1.0, not 0.9", profile=path, top_p=0.9)
    # the baselines read only the latency model: another companion or sampling setting is fine, another draft not
    assert len(_generate_sv("adaptive-verify", profile=path, temperature=0.7).token_ids) == 4
    _refused("draft=", method="adaptive-verify", profile=path, draft=LoadedModel(model=draft.model, name="x"))


def test_a_missing_or_damaged_profile_is_refused(tmp_path, profile_path):
    _refused("does not exist", profile=str(tmp_path / "nowhere.json"))
    text = profile_path.read_text()
    cases = {"garbage": "\x00not json", "truncated": text[: len(text) // 2], "list": "[1, 2]",
             "version": json.dumps({"version": 99}), "incomplete": json.dumps({"version": 1, "setting": {}})}
    for name, content in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(content)
        message = _refused("SV profile|not a draftwise SV profile", profile=str(path))
        assert str(path) in message, message


# ---------------------------------------------------------------- the companion and the drafters


class Row:
    def __init__(self, sequence, sampling, seed):
        self.sequence = list(sequence)
        self.request = Request(tuple(sequence), sampling)
        self.generator = make_generator(seed)
        self.seed, self.gumbel = seed, False  # keyed draws (engine.keyed), as the engine's rows carry


@torch.inference_mode()
def _next_logits(model, sequence) -> torch.Tensor:
    return model(torch.tensor([list(sequence)])).logits[0, -1]


@pytest.mark.parametrize("settings", [(PLAIN, WARPED, GREEDY), (PLAIN, PLAIN, PLAIN)], ids=["mixed", "all-plain"])
def test_the_companion_never_changes_the_drafted_tokens_and_reads_every_position(settings):
    """CompanionRowsDrafter proposes exactly what its inner drafter proposes alone with the same seeds, and its
    companion distributions are the companion's after the sequence plus each drafted prefix (cache-free
    forwards), over rounds of random acceptance and rewinds. When no row warps anything, the unwarped distributions
    are the warped ones (one softmax), for the companion and the draft alike."""
    _, draft, companion = trio()
    rng = random.Random(2)
    prompts = [[1], [2, 3, 4], [5, 6]]
    bare = ModelRowsDrafter(ModelRunner(draft.model, vocab_size=V, rows=0), V, keep_raw=True)
    paired = CompanionRowsDrafter(ModelRowsDrafter(ModelRunner(draft.model, vocab_size=V, rows=0), V, keep_raw=True),
                                  ModelRunner(companion.model, vocab_size=V, rows=0), V)
    rows_a = [Row(p, s, seed) for seed, (p, s) in enumerate(zip(prompts, settings))]
    rows_b = [Row(p, s, seed) for seed, (p, s) in enumerate(zip(prompts, settings))]
    for b, row in enumerate(rows_a):
        bare.admit(b, row.sequence)
        paired.admit(b, row.sequence)
    for step in range(10):
        limits = [0, 0, 0] if step in (2, 3) else [rng.randint(0, GAMMA) for _ in rows_a]  # two steps draft nothing
        a, c = bare.propose(rows_a, limits), paired.propose(rows_b, limits)
        assert a.counts == c.counts and torch.equal(a.tokens, c.tokens) and torch.equal(a.probs, c.probs)
        if not c.width:  # nothing drafted, nothing scored: the companion catches up in the next step that drafts
            assert c.companion_probs is None and c.companion_raw is None
        else:
            assert c.companion_probs.shape == (3, c.width + 1, V) == c.companion_raw.shape
        if settings == (PLAIN, PLAIN, PLAIN) and c.width:
            assert c.companion_raw is c.companion_probs
            assert c.draft_raw is None or torch.equal(c.draft_raw, c.probs)
        for b, row in enumerate(rows_b):
            for i in range(c.counts[b] + 1 if c.width else 0):
                logits = _next_logits(companion.model, row.sequence + c.tokens[b, :i].tolist())
                assert torch.allclose(c.companion_raw[b, i], unwarped(logits), atol=1e-5)
                assert torch.allclose(c.companion_probs[b, i], warp(logits, row.request.sampling), atol=1e-5)
        for b in range(3):  # keep a random prefix, then a random "recovered" token
            keep = rng.randint(0, a.counts[b])
            extra = a.tokens[b, :keep].tolist() + [rng.randrange(V)]
            for rows, drafter in ((rows_a, bare), (rows_b, paired)):
                rows[b].sequence += extra
                drafter.rewind(b, len(rows[b].sequence) - 1)


def test_the_companion_leaves_the_engine_output_unchanged():
    """An engine verifying every drafted token gives the same tokens with and without the companion (T=1, ragged)."""
    target, draft, companion = trio()

    def run(with_companion):
        inner = ModelRowsDrafter(ModelRunner(draft.model, vocab_size=V, rows=0), V, keep_raw=True)
        drafter = CompanionRowsDrafter(inner, ModelRunner(companion.model, vocab_size=V, rows=0), V) \
            if with_companion else inner
        engine = Engine(ModelRunner(target.model, vocab_size=V, rows=0), drafter, ExactRule(), gamma=GAMMA,
                        max_batch_size=3)
        ids = [engine.submit(Request(p, s, max_new_tokens=n, seed=7 + i))
               for i, (p, s, n) in enumerate([((1,), PLAIN, 12), ((2, 3, 4), WARPED, 9), ((5, 6), PLAIN, 15),
                                              ((7, 7), GREEDY, 6)])]
        engine.run()
        return [engine.result(i).token_ids for i in ids]

    assert run(True) == run(False)


def test_staged_drafter_keeps_the_draft_and_companion_caches_on_the_committed_tokens():
    """Regression: when the companion replaced a drafted token, both caches kept the replaced one at that position,
    so the next drafts were conditioned on tokens that are not in the sequence. Every proposal's draft and
    companion distributions must equal cache-free forwards on the row's sequence (T=1 and greedy rows)."""
    target, draft, companion = trio64()
    checked = {"draft": 0, "companion": 0}

    class CheckedInner(ModelRowsDrafter):
        def propose(self, rows, limits):
            out = super().propose(rows, limits)
            for b, row in enumerate(rows):
                for i in range(out.counts[b]):
                    logits = _next_logits(draft.model, row.sequence + out.tokens[b, :i].tolist())
                    assert torch.allclose(out.probs[b, i], warp(logits, row.request.sampling), atol=1e-5)
                    checked["draft"] += 1
            return out

    class CheckedStaged(StagedRowsDrafter):
        def propose(self, rows, limits):
            out = super().propose(rows, limits)
            for b, row in enumerate(rows):
                for i in range(out.counts[b]):  # the proposal the target verifies: the companion's, on staged tokens
                    logits = _next_logits(companion.model, row.sequence + out.tokens[b, :i].tolist())
                    assert torch.allclose(out.probs[b, i], warp(logits, row.request.sampling), atol=1e-5)
                    checked["companion"] += 1
            return out

    drafter = CheckedStaged(CheckedInner(ModelRunner(draft.model, vocab_size=64, rows=0), 64),
                            ModelRunner(companion.model, vocab_size=64, rows=0), 64)
    engine = Engine(ModelRunner(target.model, vocab_size=64, rows=0), drafter, ExactRule(), gamma=4, max_batch_size=4)
    for i, (prompt, sampling) in enumerate(zip(PROMPTS64, [PLAIN, GREEDY, WARPED, PLAIN])):
        engine.submit(Request(tuple(prompt), sampling, max_new_tokens=16, seed=i))
    engine.run()
    assert checked["draft"] > 20 and checked["companion"] > 20


def test_rows_draft_prefix_keeps_consistent_shapes():
    rows, k = 3, 4
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(rows, k, V, generator=generator)
    draft = RowsDraft(torch.randint(0, V, (rows, k), generator=generator), probs, [4, 2, 0], probs + 1,
                      torch.rand(rows, k, generator=generator) > 0.5, torch.rand(rows, k + 1, V, generator=generator),
                      torch.rand(rows, k + 1, V, generator=generator))
    for chosen, counts in (([2, 1, 0], [2, 1, 0]), ([9, 9, 9], [4, 2, 0]), ([0, 0, 0], [0, 0, 0]), ([1, 2, 3], [1, 2, 0])):
        cut = draft.prefix(chosen)
        width = max(counts)
        assert cut.counts == counts and cut.width == width
        assert cut.tokens.shape == (rows, width) and cut.probs.shape == (rows, width, V)
        assert cut.draft_raw.shape == (rows, width, V) and cut.verdicts.shape == (rows, width)
        assert cut.companion_probs.shape == (rows, width + 1, V) == cut.companion_raw.shape
        for b in range(rows):  # the kept part is the original's prefix
            n = counts[b]
            assert torch.equal(cut.tokens[b, :n], draft.tokens[b, :n]) and torch.equal(cut.probs[b, :n], draft.probs[b, :n])
            assert torch.equal(cut.companion_probs[b, : n + 1], draft.companion_probs[b, : n + 1])
    bare = RowsDraft(draft.tokens, draft.probs, draft.counts).prefix([1, 1, 1])
    assert bare.draft_raw is None and bare.companion_probs is None and bare.counts == [1, 1, 0]


def test_lookahead_drafts_only_past_what_the_request_verified_lately():
    """A request drafts the full gamma until it has a history, then at most lookahead past the most it verified in
    its last `memory` steps; finished requests are forgotten."""
    latency = linear_latency(0.4)
    selector = GoodputSelector(None, latency, lookahead=1, memory=3, probe=0)  # quiet requests: the next test
    rows = [Row([1], PLAIN, 0), Row([2], PLAIN, 1)]
    rows[0].id, rows[1].id = 10, 11
    assert selector.limits(rows, [4, 4]) == [4, 4]
    for chosen in ([0, 2], [0, 0], [1, 0]):
        selector._remember(rows, chosen)
    assert selector.limits(rows, [4, 4]) == [2, 3]  # max(0, 0, 1) + 1 and max(2, 0, 0) + 1
    selector._remember(rows, [0, 0])
    assert selector.limits(rows, [4, 1]) == [2, 1]  # the engine's own limit still caps
    selector._remember(rows[:1], [0])  # request 11 finished
    assert 11 not in selector.selected and selector.limits(rows[:1], [4]) == [2]
    assert GoodputSelector(None, latency, lookahead=None).limits(rows, [4, 3]) == [4, 3]


def test_a_request_that_verified_nothing_lately_drafts_only_to_probe():
    """Last `memory` selections all 0: no draft, except a probe of `lookahead` tokens in every `probe`-th step (all
    quiet requests in the same steps) and at once when the batch shrank since its last selection; a selection above
    0 ends the quiet."""
    selector = GoodputSelector(None, linear_latency(0.4), lookahead=1, memory=2, probe=4)
    rows = [Row([1], PLAIN, 0), Row([2], PLAIN, 1)]
    rows[0].id, rows[1].id = 10, 11
    for _ in range(2):
        selector._remember(rows, [0, 1])
    got = [selector.limits(rows, [4, 4]) for _ in range(9)]
    assert got == [[0, 2]] * 3 + [[1, 2]] + [[0, 2]] * 3 + [[1, 2]] + [[0, 2]], got
    assert selector.limits(rows[:1], [4]) == [1]  # request 11 finished: verifying one row costs less, probe now
    assert 11 not in selector.selected and 11 not in selector.batch_at
    selector._remember(rows[:1], [1])  # the probe was verified: drafting resumes
    assert selector.limits(rows[:1], [4]) == [2]


def test_quiet_requests_probe_in_the_same_steps():
    """Two requests that went quiet at different steps probe together (the draft model then runs once for both)."""
    selector = GoodputSelector(None, linear_latency(0.4), lookahead=1, memory=2, probe=4)
    rows = [Row([1], PLAIN, 0), Row([2], PLAIN, 1)]
    rows[0].id, rows[1].id = 10, 11
    for _ in range(2):
        selector._remember(rows, [0, 1])  # 10 quiet, 11 verifying a token a step
    assert [selector.limits(rows, [4, 4]) for _ in range(2)] == [[0, 2], [0, 2]]  # steps 1, 2
    for _ in range(2):
        selector._remember(rows, [0, 0])  # 11 goes quiet two steps after 10
    assert [selector.limits(rows, [4, 4]) for _ in range(6)] == [[0, 0], [1, 1], [0, 0], [0, 0], [0, 0], [1, 1]]


def test_could_pay_follows_the_latency_model():
    """A whole accepted draft of k tokens pays iff (1 + k) / (k draft + companion + verify(1 + k)) > 1 / verify(1)."""
    cheap = GoodputSelector(None, linear_latency(0.4), lookahead=1)  # 2 rows, k = 1: 2 / 2.8 > 1 / 2
    assert cheap.could_pay(2, 1) and cheap.could_pay(1, 4) and not cheap.could_pay(2, 0)
    dear = GoodputSelector(None, linear_latency(1.0), lookahead=1)  # (1 + k) / (1 + k) per row: a tie never pays
    assert not any(dear.could_pay(n, k) for n in (1, 2, 16) for k in range(5))
    slow_draft = sv.LatencyModel(rows=[1, 2], verify=[[1.0] * 5, [2.0] * 5], draft=[0.5, 3.0], companion=[0.0, 0.0])
    assert GoodputSelector(None, slow_draft).could_pay(1, 1)  # 2 / 1.5 > 1
    assert not GoodputSelector(None, slow_draft).could_pay(2, 4)  # (1 + k) / (3k + 2) < 1 / 2 for every k
    selector = GoodputSelector(None, slow_draft, lookahead=1, memory=2, probe=2)  # quiet at 2 rows: no probe
    rows = [Row([1], PLAIN, 0), Row([2], PLAIN, 1)]
    rows[0].id, rows[1].id = 10, 11
    for _ in range(2):
        selector._remember(rows, [0, 0])
    assert [selector.limits(rows, [4, 4]) for _ in range(4)] == [[0, 0]] * 4
    assert selector.limits(rows[:1], [4]) == [1]  # one row: a probe pays again, and the batch shrank


def test_a_new_request_starts_quiet_where_the_mean_acceptance_would_not_pay():
    """A new request drafts its full limit where drafting at the selector's mean acceptance pays ((1 + a + ..) /
    (1 + 0.5 k) > 1 at one row), and starts quiet (probing with the quiet ones) where only a whole accepted draft
    would; SV's mean is the profile's (recovered from its shrunk cells), adaptive-verify's the pooled history."""
    table = built_profile(V, 1.0)[0].table("adaptive")
    rows = [Row([1], PLAIN, 0), Row([2], PLAIN, 1)]
    rows[0].id, rows[1].id = 10, 11
    for rate, starts in ((0.9, [GAMMA, GAMMA]), (0.1, [0, 0])):
        flat = dataclasses.replace(table, mean=[[rate] * len(row) for row in table.mean])
        selector = GoodputSelector(flat, linear_latency(0.5), lookahead=1, memory=2, probe=3)
        assert selector.mean_rate() == pytest.approx(rate)
        got = [selector.limits(rows, [GAMMA, GAMMA]) for _ in range(4)]
        assert got[0] == starts
        if not any(starts):  # quiet from the start: both probe in step 3 only
            assert got == [[0, 0], [0, 0], [1, 1], [0, 0]], got
    _, samples = built_profile(V, 1.0)
    mean_x = float(torch.tensor(samples["x"], dtype=torch.float64).mean())  # the shrunk cells give back the mean
    assert GoodputSelector(table, linear_latency(0.5)).mean_rate() == pytest.approx(mean_x)
    history = HistorySelector(linear_latency(0.5), GAMMA, lookahead=1, probe=3)
    assert history.mean_rate() == 0.5 and history.limits(rows, [GAMMA, GAMMA]) == [0, 0]  # 1.5 / 1.5: a tie
    cheaper = HistorySelector(linear_latency(0.4), GAMMA, lookahead=1, probe=3)
    assert cheaper.limits(rows, [GAMMA, GAMMA]) == [GAMMA, GAMMA]  # 1.5 / 1.4 > 1


@pytest.mark.parametrize("probe", [0, 8])
def test_prohibitive_verification_stops_drafting_and_the_companion(probe):
    """Where verifying never pays (not even a draft accepted whole: `could_pay`), a request drafts nothing from its
    first step: no history to fill, no probe, and the companion never runs. probe=0 drafts gamma, then a token a
    step (the control)."""
    target, draft, companion = trio()
    table = built_profile(V, 1.0)[0].table("adaptive")
    inner = ModelRowsDrafter(ModelRunner(draft.model, vocab_size=V, rows=0), V, keep_raw=True)
    drafter = CompanionRowsDrafter(inner, ModelRunner(companion.model, vocab_size=V, rows=0), V)
    new_tokens = 41
    engine = Engine(ModelRunner(target.model, vocab_size=V, rows=0), drafter, ExactRule(), gamma=GAMMA,
                    max_batch_size=4, selector=GoodputSelector(table, linear_latency(1e9), probe=probe))
    rid = engine.submit(Request((1, 2, 3), PLAIN, max_new_tokens=new_tokens, seed=3))
    engine.run()
    stats = engine.result(rid).stats
    assert stats["drafted"] == 0 and stats["steps"] == stats["new_tokens"] == new_tokens
    steps = stats["steps"] - 1  # the last step's limit is 0: its budget leaves nothing to draft
    if probe:  # nothing drafted: even a draft accepted whole costs more than it brings here (`could_pay`)
        drafting_steps = 0
        assert stats["proposed"] == 0
    else:
        drafting_steps = steps
        assert stats["proposed"] == GAMMA + steps - 1
    assert drafter.companion_calls == drafting_steps


@pytest.mark.parametrize("probe", [4, 5])
def test_a_quiet_request_probes_in_the_engine_every_probe_steps(probe):
    """In the engine: where a draft accepted whole would pay (`could_pay`) but every estimate says verifying a
    token does not (acceptance 0.1 against a token's verification at half a step), a request starts quiet (the
    profile's mean acceptance would not pay either: `expected_pays`) and drafts only a 1-token probe in the steps
    numbered a multiple of `probe`; the companion runs exactly in the steps that drafted. Counted from the rule, so
    a probe schedule that drifts, stops or runs every step fails."""
    target, draft, companion = trio()
    table = built_profile(V, 1.0)[0].table("adaptive")
    table = dataclasses.replace(table, mean=[[0.1] * len(row) for row in table.mean])
    inner = ModelRowsDrafter(ModelRunner(draft.model, vocab_size=V, rows=0), V, keep_raw=True)
    drafter = CompanionRowsDrafter(inner, ModelRunner(companion.model, vocab_size=V, rows=0), V)
    selector = GoodputSelector(table, linear_latency(0.5), probe=probe)
    assert selector.could_pay(1, 1)  # (1 + 1) / (1 + 0.5) > 1: a probe can pay at one row
    assert not selector.expected_pays(1, GAMMA)  # (1 + 0.1) / (1 + 0.5) < 1: the mean says start quiet
    new_tokens = 41
    engine = Engine(ModelRunner(target.model, vocab_size=V, rows=0), drafter, ExactRule(), gamma=GAMMA,
                    max_batch_size=4, selector=selector)
    rid = engine.submit(Request((1, 2, 3), PLAIN, max_new_tokens=new_tokens, seed=3))
    engine.run()
    stats = engine.result(rid).stats
    assert stats["drafted"] == 0 and stats["steps"] == stats["new_tokens"] == new_tokens
    # quiet from the first step: a probe in every probe-th step; the last step drafts nothing
    probes = [s for s in range(1, new_tokens) if s % probe == 0]
    assert probes and stats["proposed"] == len(probes)
    assert drafter.companion_calls == len(probes)
