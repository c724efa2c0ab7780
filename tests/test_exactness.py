"""Statistical exactness of the decoding methods, run through the public `draftwise.generate`.

Lossless methods (`sd`, `prompt-lookup`) must reproduce the target's distribution
exactly (the correctness contract of lossless methods). For each configuration we run
`generate(..., seed=i)` for i = 0 .. N-1 and compare the empirical JOINT
distribution of the first `length` generated tokens with the exact one, computed
independently of the package's decoding loop: the target model is run directly
(no cache, plain `model(input_ids).logits`) on prompt + prefix for every prefix,
warped with `draftwise.engine.sampling.warp` and the same `SamplingConfig`, and the
conditionals are multiplied.

Models: tiny random Llamas (1 layer, width 16, `init` 0.3) over 6 and 12 tokens;
target and draft differ (their first-token total-variation distance is asserted
to exceed `MIN_TV`, so drafts are both accepted and rejected).

Goodness of fit: Pearson chi-square (`scipy.stats.chisquare`); cells of expected
count < 5 are pooled into one cell (grown with the next-smallest cells until it
reaches 5 itself). Significance level `ALPHA` = 1e-3: a correct method fails a
given test with probability 1e-3. Separately, a token outside the warped support
(expected probability exactly 0) must never appear.

Sample counts (runs of `generate`, seed=i for run i, per configuration):
  - `sd`: N_EXACT = 3000 per configuration; 4 configurations in a half-fraction
    design over vocabulary {6, 12} x gamma {1, 3} x warping {T=1 untruncated,
    T=0.8 / top-k 5 / top-p 0.9}, so every pair of factor levels appears; joint of
    2 tokens (36 or 144 cells), and of 3 tokens (216 cells) for (vocab 6, gamma 3,
    warped).
  - `prompt-lookup`: N_EXACT = 3000 per configuration, 2 configurations
    (vocab 6 / gamma 3 / warped / 3 tokens; vocab 12 / gamma 1 / untruncated /
    2 tokens), prompts with repeated n-grams; the drafter is asserted to draft.
  - negative controls: N_CONTROL = 1500 runs each; a deliberately wrong
    acceptance step (recover from norm(pi) instead of the residual; accept every
    drafted token) must be REJECTED, p < ALPHA. Observed when written: residual
    bug p ~ 1e-69 (sd) and ~ 3e-17 (prompt lookup); accept-everything p ~ 0.
  - `lossy` (alpha 0.3; beta 1, beta 2, beta 1 warped, and the beta that
    normalises pi): N_LOSSY = 3000 per configuration, first token only, against
    Narasimhan et al. Lemma 2's pi pushed through Algorithm 4's output distribution; the
    same samples must reject the plain target distribution (p ~ 1e-21 or less).

With 10 goodness-of-fit tests at ALPHA = 1e-3 each, a correct package would fail
this module by chance with probability about 1% for a fresh set of seeds; the
seeds are fixed (and CPU forwards deterministic), so every run gives the same
verdict.

Runtime: about 1-3 ms per `generate` call (one intra-op thread), roughly 2
minutes for the module on 2 CPU cores.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import draftwise
import draftwise.rules.acceptance as acceptance
import draftwise.engine.sampler as batched
from draftwise.engine.protocols import StepDistributions
from draftwise.rules.acceptance import Rule, output_distribution
from draftwise.engine.sampling import SamplingConfig, warp

from conftest import sweep, tiny_llama

ALPHA = 1e-3  # significance level of every goodness-of-fit test in this module
N_EXACT = 3000  # generate() runs per lossless configuration
N_CONTROL = 1500  # runs per negative control
N_LOSSY = 3000  # runs per lossy configuration
MIN_TV = 0.2  # target and draft first-token distributions must differ at least this much
MIN_EXPECTED = 5.0  # Pearson's rule of thumb: cells expected below this are pooled

PLAIN = SamplingConfig(temperature=1.0)
WARPED = SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)

# (target seed, draft seed) per vocabulary size, picked so that first-token TV is 0.4-0.6.
PAIRS = {6: (0, 11), 12: (2, 12)}
SD_PROMPTS = {6: [1, 2, 3], 12: [3, 1, 4, 1, 5]}
# Repeated n-grams, so the n-gram drafter always finds a continuation to propose.
LOOKUP_PROMPTS = {6: [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], 12: [5, 7, 9, 2, 5, 7, 9, 2, 5, 7]}




@lru_cache(maxsize=None)
def model(seed: int, vocab: int):
    return tiny_llama(seed, vocab=vocab, layers=1, width=16, init=0.3)


def target_and_draft(vocab: int):
    target_seed, draft_seed = PAIRS[vocab]
    return model(target_seed, vocab), model(draft_seed, vocab)


# ----------------------------------------------------------------------------- exact reference


@torch.inference_mode()
def next_token_probs(lm, prompt: list[int], prefixes: list[tuple[int, ...]], sampling: SamplingConfig) -> np.ndarray:
    """Warped next-token distributions after prompt + prefix, one row per prefix (no cache, one batch)."""
    input_ids = torch.tensor([list(prompt) + list(prefix) for prefix in prefixes])
    logits = lm(input_ids).logits[:, -1, :]  # [prefixes, vocab]
    return warp(logits, sampling).double().numpy()


def exact_joint(lm, prompt: list[int], sampling: SamplingConfig, length: int) -> np.ndarray:
    """P(first `length` tokens) as an array of shape [vocab] * length, from plain forward passes."""
    vocab = lm.config.vocab_size
    joint = np.ones(())
    for position in range(length):
        prefixes = list(itertools.product(range(vocab), repeat=position))
        probs = next_token_probs(lm, prompt, prefixes, sampling)  # [vocab ** position, vocab]
        joint = joint.reshape(-1, 1) * probs
    joint = joint.reshape((vocab,) * length)
    assert np.isclose(joint.sum(), 1.0)
    return joint


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float)).sum())


# ----------------------------------------------------------------------------- empirical side


def sample_joint(n: int, length: int, vocab: int, **generate_kwargs) -> tuple[np.ndarray, dict[str, int]]:
    """Counts of the first `length` tokens over `n` runs of generate(seed=i); summed stats."""
    counts = np.zeros((vocab,) * length, dtype=np.int64)
    totals = {"drafted": 0, "accepted": 0, "steps": 0}
    for i in range(n):
        result = draftwise.generate(seed=i, ignore_eos=True, **generate_kwargs)
        counts[tuple(result.token_ids[:length])] += 1
        for key in totals:
            totals[key] += result.stats[key]
    return counts, totals


def pooled_chisquare(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value; cells expected < MIN_EXPECTED pooled into one cell.

    A count in a cell of expected probability 0 (outside the support) gives p = 0.
    """
    observed = np.asarray(counts, dtype=float).ravel()
    probs = np.asarray(probs, dtype=float).ravel()
    n = observed.sum()
    if observed[probs <= 0].sum() > 0:
        return 0.0
    expected = n * probs / probs.sum()
    order = np.argsort(expected)
    small = expected[order] < MIN_EXPECTED
    cut = int(small.sum())  # order[:cut] are pooled
    # The pool must itself reach MIN_EXPECTED: grow it with the next-smallest cells.
    while cut and cut < len(order) and expected[order[:cut]].sum() < MIN_EXPECTED:
        cut += 1
    pooled_obs = observed[order[:cut]].sum()
    pooled_exp = expected[order[:cut]].sum()
    obs = observed[order[cut:]]
    exp = expected[order[cut:]]
    if cut and pooled_exp > 0:
        obs = np.append(obs, pooled_obs)
        exp = np.append(exp, pooled_exp)
    assert len(obs) >= 2, "too few cells for a chi-square test"
    return float(chisquare(obs, exp).pvalue)


@dataclass(frozen=True)
class Case:
    method: str
    vocab: int
    gamma: int
    sampling: SamplingConfig
    length: int  # joint of the first `length` generated tokens
    coupling: str = ""  # sd: "rejection" (Algorithm 1 with keyed uniforms) or "" (the default, Gumbel; test_keyed)

    @property
    def id(self) -> str:
        warping = "plain" if self.sampling == PLAIN else "warped"
        return f"{self.method}-v{self.vocab}-g{self.gamma}-{warping}-len{self.length}{'-' + self.coupling if self.coupling else ''}"

    @property
    def prompt(self) -> list[int]:
        return (SD_PROMPTS if self.method == "sd" else LOOKUP_PROMPTS)[self.vocab]

    def generate_kwargs(self) -> dict:
        target, draft = target_and_draft(self.vocab)
        kwargs = dict(
            target=target, prompt=self.prompt, method=self.method, gamma=self.gamma,
            # gamma + 1 lets the first step draft gamma tokens (a step drafts at most budget - 1).
            max_new_tokens=max(self.length, self.gamma + 1),
            temperature=self.sampling.temperature, top_k=self.sampling.top_k, top_p=self.sampling.top_p,
        )
        if self.method == "sd":
            kwargs["draft"] = draft
        if self.coupling:
            kwargs["coupling"] = self.coupling
        return kwargs

    def exact(self) -> np.ndarray:
        return exact_joint(target_and_draft(self.vocab)[0], self.prompt, self.sampling, self.length)

    def draft_first_token(self) -> np.ndarray:
        """The first-token draft distribution: the draft model's, or the n-gram drafter's one-hot."""
        target, draft = target_and_draft(self.vocab)
        if self.method == "sd":
            return next_token_probs(draft, self.prompt, [()], self.sampling)[0]
        proposal = ngram_proposal(self.prompt)
        return np.eye(self.vocab)[proposal]


def ngram_proposal(prompt: list[int]) -> int:
    """The continuation of the most recent earlier occurrence of the prompt's last token(s)."""
    for n in range(min(3, len(prompt) - 1), 0, -1):
        tail = prompt[-n:]
        for start in range(len(prompt) - n - 1, -1, -1):
            if prompt[start : start + n] == tail:
                return prompt[start + n]
    raise AssertionError("prompt has no repeated n-gram")


SD_CASES = [  # rejection sampling (Algorithm 1, keyed uniforms); the default Gumbel coupling is tested in test_keyed
    Case("sd", 6, 1, PLAIN, 2, "rejection"),
    Case("sd", 6, 3, WARPED, 3, "rejection"),
    Case("sd", 12, 1, WARPED, 2, "rejection"),
    Case("sd", 12, 3, PLAIN, 2, "rejection"),
]
LOOKUP_CASES = [
    Case("prompt-lookup", 6, 3, WARPED, 3),
    Case("prompt-lookup", 12, 1, PLAIN, 2),
    # the suffix drafter on the same repeating prompts: its first proposal is the n-gram continuation too
    Case("suffix", 6, 3, WARPED, 3),
    Case("suffix", 12, 1, PLAIN, 2),
]


def check_meaningful(case: Case) -> None:
    """The draft must really differ from the target, or exactness would be trivial."""
    target_first = case.exact().sum(axis=tuple(range(1, case.length)))
    assert tv(target_first, case.draft_first_token()) > MIN_TV


@pytest.mark.parametrize("case", sweep(SD_CASES + LOOKUP_CASES, {2, 5, 7}, ids=lambda c: c.id))
def test_lossless_methods_reproduce_target_joint_distribution(case: Case):
    check_meaningful(case)
    expected = case.exact()
    counts, totals = sample_joint(N_EXACT, case.length, case.vocab, **case.generate_kwargs())
    # The drafter drafted, and drafts were both accepted and rejected.
    assert totals["drafted"] > 0
    assert 0 < totals["accepted"] < totals["drafted"]
    assert counts[expected == 0].sum() == 0, "a token outside the warped support was generated"
    p_value = pooled_chisquare(counts, expected)
    print(f"{case.id}: chi-square p = {p_value:.3g}")
    assert p_value > ALPHA, f"{case.id}: chi-square p = {p_value:.3g}"


# ----------------------------------------------------------------------------- negative controls


def _recover_from_pi(pi: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The classic bug: after a rejection, resample from the target instead of the residual."""
    return pi / pi.sum()


@dataclass(frozen=True)
class AcceptEverything(Rule):
    """A broken rule: pi = draft, so every drafted token is accepted."""

    name: str = "accept-everything"

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        return step.draft_probs


CONTROL_CASES = {
    "sd": Case("sd", 12, 3, PLAIN, 2, "rejection"),
    "prompt-lookup": Case("prompt-lookup", 12, 1, PLAIN, 2),
    "suffix": Case("suffix", 12, 1, PLAIN, 2),
}


def test_control_residual_bug_is_rejected(monkeypatch):
    """Recovering from norm(pi) instead of norm(max(0, pi - draft)) must fail the same test (sd: prompt lookup and
    suffix have no residual any more, see the next test)."""
    case = CONTROL_CASES["sd"]
    monkeypatch.setattr(acceptance, "residual", _recover_from_pi)
    monkeypatch.setattr(batched, "residual_rows", lambda pi, draft_probs: pi)  # the engine's batched sampler
    counts, totals = sample_joint(N_CONTROL, case.length, case.vocab, **case.generate_kwargs())
    assert totals["accepted"] < totals["drafted"]  # rejections happened, so the bug was exercised
    p_value = pooled_chisquare(counts, case.exact())
    print(f"control p = {p_value:.3g}")
    assert p_value < ALPHA, f"the residual bug was not detected: p = {p_value:.3g}"


@pytest.mark.parametrize("method", ["prompt-lookup", "suffix"])
def test_control_reseeded_walk_is_rejected_for_deterministic_drafts(method: str, monkeypatch):
    """Prompt lookup and suffix drafts are verified by drawing the target's own token at each position
    (sampler.accept_own_draws, keyed by (seed, position)). Drawing every position with the same key (the reference
    codes' reseeding pitfall) must fail the same test. (A slot off by one is caught by test_tree and
    test_ragged_corners; with gamma 1 these cases accept too rarely for it to show here.)"""
    import draftwise.engine.keyed as keyed

    case = CONTROL_CASES[method]
    bug = "reseeded-uniform"
    real = keyed.keys
    monkeypatch.setattr(keyed, "keys", lambda seeds, positions, purpose: real(seeds, positions * 0, purpose))
    counts, totals = sample_joint(N_CONTROL, case.length, case.vocab, **case.generate_kwargs())
    assert totals["drafted"] > 0  # drafts were verified, so the walk was exercised
    p_value = pooled_chisquare(counts, case.exact())
    print(f"control {bug} p = {p_value:.3g}")
    assert p_value < ALPHA, f"the {bug} bug was not detected: p = {p_value:.3g}"


def test_control_accept_everything_is_rejected(monkeypatch):
    """A rule that keeps every drafted token (pi = draft) in place of sd's must fail the same test. (The engine
    takes pi = the target for a rule that declares `exact` without calling it, so the broken rule is sd's rule.)"""
    import dataclasses

    from draftwise.methods import METHODS

    case = CONTROL_CASES["sd"]
    monkeypatch.setitem(METHODS, "sd", dataclasses.replace(METHODS["sd"], make_rule=lambda options: AcceptEverything()))
    counts, totals = sample_joint(N_CONTROL, case.length, case.vocab, **case.generate_kwargs())
    assert totals["accepted"] == totals["drafted"] > 0
    p_value = pooled_chisquare(counts, case.exact())
    print(f"control p = {p_value:.3g}")
    assert p_value < ALPHA, f"accepting every draft token was not detected: p = {p_value:.3g}"


def test_control_accept_everything_via_method_registry(monkeypatch):
    """The same broken rule plugged in through the method registry is rejected too (prompt lookup)."""
    import dataclasses

    from draftwise.methods import METHODS

    case = CONTROL_CASES["prompt-lookup"]
    broken = dataclasses.replace(METHODS["prompt-lookup"], make_rule=lambda options: AcceptEverything())
    monkeypatch.setitem(METHODS, "prompt-lookup", broken)
    counts, totals = sample_joint(N_CONTROL, case.length, case.vocab, **case.generate_kwargs())
    assert totals["accepted"] == totals["drafted"] > 0
    p_value = pooled_chisquare(counts, case.exact())
    print(f"control p = {p_value:.3g}")
    assert p_value < ALPHA, f"accepting every draft token was not detected: p = {p_value:.3g}"


# ----------------------------------------------------------------------------- lossy


LOSSY_VOCAB = 12
LOSSY_ALPHA = 0.3
LOSSY_PROMPT = SD_PROMPTS[LOSSY_VOCAB]


def lossy_pi(draft: np.ndarray, target: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """Narasimhan et al. Lemma 2: pi(v) = max{ min{ q(v), p(v) / (1 - alpha) }, p(v) / beta }."""
    return np.maximum(np.minimum(draft, target / (1.0 - alpha)), target / beta)


def algorithm4_output(draft: np.ndarray, pi: np.ndarray) -> np.ndarray:
    """The token Algorithm 4 commits at one position: accepted x ~ q with min(1, pi/q), else residual.

    P(v) = q(v) min(1, pi(v)/q(v)) + P(reject) norm(max(0, pi - q))(v),
    P(reject) = 1 - sum_v min(q(v), pi(v)).
    """
    kept = np.minimum(draft, pi)
    excess = np.maximum(0.0, pi - draft)
    assert excess.sum() > 1e-6
    return kept + (1.0 - kept.sum()) * excess / excess.sum()


def normalising_beta(draft: np.ndarray, target: np.ndarray, alpha: float) -> float:
    """The beta for which Lemma 2's pi sums to 1 (sum pi decreases in beta), by bisection."""
    low, high = 1.0, 1e6  # sum pi >= 1 at beta = 1; at beta -> inf it tends to sum min(q, p/(1-alpha)) < 1
    assert lossy_pi(draft, target, alpha, high).sum() < 1.0 <= lossy_pi(draft, target, alpha, low).sum()
    for _ in range(200):
        middle = 0.5 * (low + high)
        if lossy_pi(draft, target, alpha, middle).sum() > 1.0:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def lossy_first_token(sampling: SamplingConfig):
    target_lm, draft_lm = target_and_draft(LOSSY_VOCAB)
    target = next_token_probs(target_lm, LOSSY_PROMPT, [()], sampling)[0]
    draft = next_token_probs(draft_lm, LOSSY_PROMPT, [()], sampling)[0]
    return draft, target


def lossy_counts(beta: float, sampling: SamplingConfig, n: int = N_LOSSY) -> np.ndarray:
    target_lm, draft_lm = target_and_draft(LOSSY_VOCAB)
    counts, totals = sample_joint(
        n, 1, LOSSY_VOCAB, target=target_lm, draft=draft_lm, prompt=LOSSY_PROMPT, method="lossy",
        alpha=LOSSY_ALPHA, beta=beta, gamma=1, max_new_tokens=2,
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
    )
    assert 0 < totals["accepted"] < totals["drafted"]
    return counts


@pytest.mark.parametrize(
    "beta, sampling", sweep([(1.0, PLAIN), (2.0, PLAIN), (1.0, WARPED)], {2},
                            ids=lambda c: f"beta{c[0]:g}-{'plain' if c[1] is PLAIN else 'warped'}")
)
def test_lossy_first_token_follows_its_own_distribution(beta: float, sampling: SamplingConfig):
    draft, target = lossy_first_token(sampling)
    assert tv(draft, target) > MIN_TV
    pi = lossy_pi(draft, target, LOSSY_ALPHA, beta)
    expected = algorithm4_output(draft, pi)
    # The package's closed form agrees with the formula written out here.
    package = output_distribution(torch.tensor(draft), torch.tensor(pi)).numpy()
    np.testing.assert_allclose(package, expected, atol=1e-9)
    # Lossy is really lossy here: its distribution is far from the target's, so the test can tell them apart.
    assert tv(expected, target) > 0.05

    counts = lossy_counts(beta, sampling)
    assert counts[expected == 0].sum() == 0
    p_value = pooled_chisquare(counts, expected)
    print(f"lossy beta={beta}: p = {p_value:.3g}; against the target p = {pooled_chisquare(counts, target):.3g}")
    assert p_value > ALPHA, f"lossy beta={beta}: chi-square p = {p_value:.3g}"
    # The same samples reject the target distribution: the test distinguishes lossy from exact.
    assert pooled_chisquare(counts, target) < ALPHA


def test_lossy_with_normalised_pi_samples_pi_itself():
    """When beta makes Lemma 2's pi a distribution, Algorithm 4 outputs exactly pi."""
    draft, target = lossy_first_token(PLAIN)
    beta = normalising_beta(draft, target, LOSSY_ALPHA)
    assert beta > 1.0
    pi = lossy_pi(draft, target, LOSSY_ALPHA, beta)
    assert np.isclose(pi.sum(), 1.0, atol=1e-9)
    np.testing.assert_allclose(algorithm4_output(draft, pi), pi, atol=1e-9)
    assert tv(pi, target) > 0.05 and tv(pi, draft) > 0.05  # pi is neither model's distribution

    counts = lossy_counts(beta, PLAIN)
    p_value = pooled_chisquare(counts, pi)
    print(f"lossy normalised beta={beta:.4f}: p = {p_value:.3g}")
    assert p_value > ALPHA, f"lossy with normalised pi (beta={beta:.4f}): chi-square p = {p_value:.3g}"


# ----------------------------------------------------------------------------- EAGLE draft head


def _feature_head(kind: str, target):
    """A feature head over a reduced draft vocabulary (8 of 12 tokens: zero draft probability elsewhere),
    sharper than random init and unlike the target."""
    vocab_ids = torch.tensor([0, 2, 3, 5, 6, 8, 9, 11])
    torch.manual_seed(7)
    if kind == "eagle":
        from draftwise.heads.eagle import EagleConfig, EagleHead

        head = EagleHead(EagleConfig(hidden_size=16, num_heads=4, num_kv_heads=2, intermediate_size=32,
                                     target_vocab_size=12), vocab_ids)
        with torch.no_grad():
            for p in head.parameters():
                p.mul_(3.0)
        return head.attach(target)
    from draftwise.heads.eagle3 import Eagle3Head  # fused layer inputs, its own LM head

    head = Eagle3Head.new(target, vocab_ids=vocab_ids, intermediate_size=32, feature_layers=(0, 0, 0))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return head.eval()


def _restricted_draft(draft):
    """The draft with its LM head restricted to 7 of 12 tokens (what output-vocab.json does)."""
    from draftwise.models.loading import LoadedModel

    return LoadedModel(model=draft, name="restricted", output_ids=torch.tensor([0, 1, 3, 4, 6, 7, 10]))


@pytest.mark.parametrize("kind", sweep(["eagle", "eagle3", "restricted-vocab"], {1}))
def test_sd_with_a_feature_head_reproduces_target_joint_distribution(kind):
    """sd drafting with an EAGLE-1 or EAGLE-3-style head, or with a draft model whose output vocabulary is cut
    (probability zero elsewhere), is exact: joint of 2 tokens, T=0.8/top-k/top-p."""
    target, draft = target_and_draft(12)
    head = _restricted_draft(draft) if kind == "restricted-vocab" else _feature_head(kind, target)
    prompt = SD_PROMPTS[12]
    expected = exact_joint(target, prompt, WARPED, 2)
    counts, totals = sample_joint(N_EXACT, 2, 12, target=target, prompt=prompt, draft=head, method="sd", gamma=2,
                                  max_new_tokens=3, temperature=WARPED.temperature, top_k=WARPED.top_k,
                                  top_p=WARPED.top_p)
    assert 0 < totals["accepted"] < totals["drafted"]
    assert counts[expected == 0].sum() == 0
    p_value = pooled_chisquare(counts, expected)
    print(f"{kind}: chi-square p = {p_value:.3g}")
    assert p_value > ALPHA, f"{kind}: chi-square p = {p_value:.3g}"


def test_hybrid_reproduces_target_joint_distribution():
    """hybrid (suffix speculation where it expects >= 1.5 tokens, the draft model elsewhere) on a repeating prompt:
    the joint of 3 tokens is still the target's (T=0.8/top-k/top-p). test_suffix checks both drafters are used."""
    case = Case("prompt-lookup", 6, 3, WARPED, 3)  # its repeating prompt, so the suffix tries have matches
    target, draft = target_and_draft(6)
    expected = case.exact()
    counts, totals = sample_joint(N_EXACT, 3, 6, target=target, prompt=case.prompt, draft=draft, method="hybrid",
                                  gamma=3, max_new_tokens=4, temperature=WARPED.temperature, top_k=WARPED.top_k,
                                  top_p=WARPED.top_p, threshold=1.5)
    assert 0 < totals["accepted"] < totals["drafted"]
    assert counts[expected == 0].sum() == 0
    p_value = pooled_chisquare(counts, expected)
    print(f"hybrid: chi-square p = {p_value:.3g}")
    assert p_value > ALPHA, f"hybrid: chi-square p = {p_value:.3g}"
