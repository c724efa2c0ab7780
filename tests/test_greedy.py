"""Greedy equivalence: at temperature 0 every exact method (and the lossy ones at their
exact settings) reproduces transformers' own greedy `generate`, token for token.

fp32 throughout (exactness is proven in fp32). Drafts come in two kinds: a
*different* tiny model (rejects almost everything) and a *near* copy of the target
(perturbed weights: accepts some, rejects some), so both the accept and the
recover/rewind paths run.
"""

from __future__ import annotations


import pytest
import torch

import draftwise
from conftest import near_copy, tiny_gpt2, tiny_llama



N = 20  # new tokens per generation
PROMPTS = [
    [3, 17, 42, 8, 25],
    [1, 2, 3],
    [9, 9, 40, 41, 50, 2, 7, 33, 12],
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8],  # repetitive: prompt lookup finds n-grams
    [60],
]
GAMMAS = [1, 3, 5, 8]


_near_copy = near_copy


ARCHS = {
    "llama": lambda: (tiny_llama(0), tiny_llama(1, layers=1)),
    "gpt2": lambda: (tiny_gpt2(0), tiny_gpt2(1, layers=1)),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request):
    """(target, {draft kind: draft model}, {prompt index: transformers' greedy tokens})."""
    target, other = ARCHS[request.param]()
    drafts = {"other": other, "near": _near_copy(target)}
    reference = {}
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = target.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N, min_new_tokens=N,
            )
        reference[i] = out[0, len(prompt) :].tolist()
        assert len(reference[i]) == N
    return target, drafts, reference


def test_ar_greedy_matches_transformers(arch):
    target, _, reference = arch
    for i, prompt in enumerate(PROMPTS):
        result = draftwise.generate(target, prompt, method="ar", temperature=0, max_new_tokens=N)
        assert result.token_ids == reference[i], f"prompt {i}"
        assert result.stats["target_calls"] == N
        assert result.stats["drafted"] == 0


@pytest.mark.parametrize("draft_kind", ["other", "near"])
def test_sd_greedy_matches_transformers(arch, draft_kind):
    target, drafts, reference = arch
    accepted = rejected = 0
    # the "other" draft is rejected almost always: every step costs gamma draft calls for one token
    for gamma in GAMMAS if draft_kind == "near" else (2, 5):
        for i, prompt in enumerate(PROMPTS):
            result = draftwise.generate(
                target, prompt, draft=drafts[draft_kind], method="sd", temperature=0, max_new_tokens=N, gamma=gamma,
            )
            assert result.token_ids == reference[i], f"gamma {gamma}, prompt {i}"
            accepted += result.stats["accepted"]
            rejected += result.stats["drafted"] - result.stats["accepted"]
    assert rejected > 0  # the recover path ran
    if draft_kind == "near":
        assert accepted > 0  # the accept (and bonus) path ran too


def test_prompt_lookup_greedy_matches_transformers(arch):
    target, _, reference = arch
    drafted = 0
    for gamma, max_ngram, min_ngram in [(g, 3, 1) for g in GAMMAS] + [(4, 2, 2)]:
        for i, prompt in enumerate(PROMPTS):
            result = draftwise.generate(
                target, prompt, method="prompt-lookup", temperature=0, max_new_tokens=N, gamma=gamma,
                max_ngram=max_ngram, min_ngram=min_ngram,
            )
            assert result.token_ids == reference[i], f"gamma {gamma}, ngram {max_ngram}/{min_ngram}, prompt {i}"
            drafted += result.stats["drafted"]
    assert drafted > 0  # lookups found something to verify


def test_lossy_greedy_alpha0_is_target_greedy(arch):
    target, drafts, reference = arch
    for gamma in (2, 5):
        for i, prompt in enumerate(PROMPTS):
            result = draftwise.generate(
                target, prompt, draft=drafts["near"], method="lossy-greedy", alpha=0.0, temperature=0,
                max_new_tokens=N, gamma=gamma,
            )
            assert result.token_ids == reference[i], f"gamma {gamma}, prompt {i}"


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.9])
def test_lossy_at_temperature0_is_target_greedy(arch, alpha):
    """Seed 003 Lemma 6: with one-hot target and draft distributions, lossy SS commits the target's argmax."""
    target, drafts, reference = arch
    for i, prompt in enumerate(PROMPTS[:3]):
        result = draftwise.generate(
            target, prompt, draft=drafts["near"], method="lossy", alpha=alpha, temperature=0, max_new_tokens=N,
            gamma=3, seed=i,
        )
        assert result.token_ids == reference[i], f"alpha {alpha}, prompt {i}"


def test_lossy_greedy_alpha1_keeps_every_drafted_token(arch):
    """alpha = 1: the top set is the whole vocabulary, so no drafted token is ever replaced."""
    target, drafts, _ = arch
    result = draftwise.generate(
        target, PROMPTS[0], draft=drafts["other"], method="lossy-greedy", alpha=1.0, temperature=0,
        max_new_tokens=N, gamma=4,
    )
    assert result.stats["drafted"] > 0
    assert result.stats["accepted"] == result.stats["drafted"]


SAMPLINGS = {
    "t0": dict(temperature=0.0),
    "t1": dict(temperature=1.0),
    "t0.7-topk8-topp0.9": dict(temperature=0.7, top_k=8, top_p=0.9),
}


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("method", ["sd", "lossy"])
def test_self_drafting_accepts_everything(arch, sampling, method):
    """draft = target (the same object): every drafted token is accepted, at any temperature."""
    target, _, reference = arch
    gamma = 4
    for i, prompt in enumerate(PROMPTS[:3]):
        result = draftwise.generate(
            target, prompt, draft=target, method=method, max_new_tokens=N, gamma=gamma, seed=i, **SAMPLINGS[sampling],
        )
        stats = result.stats
        assert stats["drafted"] > 0
        assert stats["accepted"] == stats["drafted"], f"prompt {i}: {stats}"
        assert len(result.token_ids) == N
        # every step drafts min(gamma, budget - 1) tokens and commits all of them + a bonus token
        assert stats["target_calls"] == -(-N // (gamma + 1))
        assert stats["accepted_per_position"] == stats["drafted_per_position"]
        if sampling == "t0":
            assert result.token_ids == reference[i]


@pytest.mark.parametrize("method", ["sd", "ar", "prompt-lookup", "lossy"])
def test_same_seed_same_output_at_temperature1(arch, method):
    target, drafts, _ = arch
    draft = drafts["near"] if method in ("sd", "lossy") else None
    for i, prompt in enumerate(PROMPTS[:3]):
        runs = [
            draftwise.generate(target, prompt, draft=draft, method=method, temperature=1.0, max_new_tokens=N, seed=123)
            for _ in range(2)
        ]
        assert runs[0].token_ids == runs[1].token_ids, f"prompt {i}"
        assert runs[0].stats["accepted"] == runs[1].stats["accepted"]
        assert runs[0].stats["seed"] == 123


@pytest.mark.parametrize("method", ["sd", "ar"])
def test_different_seeds_differ_at_temperature1(arch, method):
    target, drafts, _ = arch
    draft = drafts["near"] if method == "sd" else None
    differing = 0
    for prompt in PROMPTS[:3]:
        outputs = {
            tuple(draftwise.generate(
                target, prompt, draft=draft, method=method, temperature=1.0, max_new_tokens=N, seed=seed,
            ).token_ids)
            for seed in (1, 2, 3)
        }
        differing += len(outputs) > 1
    assert differing == 3  # 20 tokens sampled from 64-way distributions: a collision is vanishingly unlikely


def test_seed_none_draws_a_fresh_seed_and_reports_it(arch):
    target, _, _ = arch
    first = draftwise.generate(target, PROMPTS[0], method="ar", temperature=1.0, max_new_tokens=N)
    second = draftwise.generate(target, PROMPTS[0], method="ar", temperature=1.0, max_new_tokens=N)
    assert first.stats["seed"] != second.stats["seed"]
    replay = draftwise.generate(
        target, PROMPTS[0], method="ar", temperature=1.0, max_new_tokens=N, seed=first.stats["seed"]
    )
    assert replay.token_ids == first.token_ids  # the reported seed reproduces the run
