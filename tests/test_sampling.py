"""Warping (temperature -> top-k -> top-p) and SamplingConfig validation.

`warp` is checked on hand-computed examples and against transformers' own logits
processors, which define what `generate(do_sample=True)` samples from.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from draftwise.errors import DraftwiseError
from draftwise.engine.sampling import (GREEDY_BELOW, SamplingConfig, is_greedy, make_generator, one_hot_argmax, sample,
                                      unwarped, warp)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# ----------------------------------------------------------------------------- temperature 0


def test_temperature_zero_is_one_hot_at_argmax():
    logits = torch.randn(5, 17, generator=torch.Generator().manual_seed(0))
    probs = warp(logits, SamplingConfig(temperature=0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs.sum(-1), torch.ones(5))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal((probs == 1).sum(-1), torch.ones(5, dtype=torch.long))
    assert torch.equal((probs == 0).sum(-1), torch.full((5,), 16))


def test_temperature_zero_ignores_top_k_and_top_p():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5])
    for config in (SamplingConfig(0, top_k=2), SamplingConfig(0, top_p=0.3), SamplingConfig(0, top_k=1, top_p=0.5)):
        assert torch.equal(warp(logits, config), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_temperature_zero_ties_pick_the_first_index():
    logits = torch.tensor([0.5, 3.0, 1.0, 3.0])
    assert torch.equal(warp(logits, SamplingConfig(temperature=0)), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.equal(one_hot_argmax(logits), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_greedy_flag():
    assert SamplingConfig(temperature=0).greedy
    assert SamplingConfig(temperature=0.0).greedy
    assert not SamplingConfig(temperature=1e-3).greedy


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-39, 1e-38, 1e-20, 1e-6, 9.99e-6])
def test_temperatures_below_1e_5_are_greedy(temperature):
    """As vLLM: below 1e-5 is greedy, decided in one place (`is_greedy`) and stored as 0, so the warp is the argmax's
    one-hot (dividing by 1e-300 made every logit +-inf: NaN probabilities, a garbage token) and every reader of
    the config (plans, profiles, the registry's trained files and heads) sees temperature 0."""
    config = SamplingConfig(temperature=temperature, top_k=3, top_p=0.5)
    assert config.greedy and is_greedy(temperature)
    assert config.temperature == 0.0 and config == SamplingConfig(0.0, top_k=3, top_p=0.5)
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 30
    assert torch.equal(warp(logits, config), warp(logits, SamplingConfig(0.0)))
    assert torch.equal(warp(logits.half(), config).argmax(-1), logits.half().float().argmax(-1))


@pytest.mark.parametrize("temperature", [GREEDY_BELOW, 1e-5, 1.0000001e-5, 1e-3])
def test_temperatures_from_1e_5_sample(temperature):
    config = SamplingConfig(temperature=temperature)
    assert not config.greedy and not is_greedy(temperature) and config.temperature == temperature


def test_the_registry_picks_the_greedy_head_below_1e_5(monkeypatch):
    """The plan's choice of the registry's draft (the sampled-answer head at T > 0) follows the same threshold."""
    from draftwise import plan
    from draftwise.models import registry

    class Ready:
        role = "eagle"

        def cached(self):
            return "ready"

    monkeypatch.setitem(registry._ENTRIES, "greedy-head", Ready())
    monkeypatch.setitem(registry._ENTRIES, "sampled-head", Ready())
    monkeypatch.setitem(registry._DEFAULT_DRAFTS, "some-target", ("greedy-head",))
    monkeypatch.setitem(registry._SAMPLED_HEADS, "some-target", "sampled-head")
    monkeypatch.setattr(registry, "names", lambda: ["some-target"])
    pick = lambda t: plan.default_draft("some-target", "sd", t)  # noqa: E731
    assert [pick(t) for t in (0.0, 1e-300, 9e-6, 1e-5, 1.0)] == ["greedy-head"] * 3 + ["sampled-head"] * 2


# ----------------------------------------------------------------------------- temperature, top-k, top-p


def test_temperature_one_no_truncation_is_softmax():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(warp(logits, SamplingConfig()), torch.softmax(logits, -1))
    assert torch.allclose(unwarped(logits), torch.softmax(logits, -1))


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 4.0])
    for temperature in (0.5, 2.0):
        expected = torch.softmax(logits / temperature, -1)
        assert torch.allclose(warp(logits, SamplingConfig(temperature=temperature)), expected)


def test_half_precision_logits_give_float32_probabilities():
    logits = torch.tensor([1.0, 2.0, 4.0], dtype=torch.bfloat16)
    probs = warp(logits, SamplingConfig(top_k=2))
    assert probs.dtype == torch.float32
    assert torch.allclose(probs, torch.softmax(torch.tensor([-math.inf, 2.0, 4.0]), -1))


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_k(k: int):
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(2))  # continuous: no ties
    probs = warp(logits, SamplingConfig(top_k=k))
    assert torch.equal((probs > 0).sum(-1), torch.full((4,), k))
    # the kept ones are the k largest logits, in softmax proportion
    top = torch.topk(logits, k, dim=-1)
    kept = torch.zeros_like(probs).scatter(-1, top.indices, torch.softmax(top.values, -1))
    assert torch.allclose(probs, kept)


def test_top_k_of_vocab_size_or_more_is_off():
    logits = torch.randn(10, generator=torch.Generator().manual_seed(3))
    for k in (10, 50):
        assert torch.allclose(warp(logits, SamplingConfig(top_k=k)), torch.softmax(logits, -1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05 (scrambled order); cumulative 0.5, 0.8, 0.95, 1.0
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    cases = {
        0.4: [0.0, 1.0, 0.0, 0.0],  # 0.5 already reaches 0.4
        0.6: [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8],  # 0.5 < 0.6 <= 0.8
        0.75: [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8],
        0.9: [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95],  # 0.8 < 0.9 <= 0.95
        0.97: [0.15, 0.5, 0.05, 0.3],  # needs everything
        1.0: [0.15, 0.5, 0.05, 0.3],  # off
    }
    for top_p, expected in cases.items():
        probs = warp(logits, SamplingConfig(top_p=top_p))
        assert torch.allclose(probs, torch.tensor(expected), atol=1e-6), (top_p, probs)


def test_top_p_always_keeps_the_most_likely_token():
    logits = logits_of([0.2, 0.7, 0.1])
    assert torch.equal(warp(logits, SamplingConfig(top_p=1e-6)), torch.tensor([0.0, 1.0, 0.0]))


def test_top_p_applies_after_temperature_and_top_k():
    # temperature 1, top-k 3 -> [0.5, 0.3, 0.15] / 0.95 = [0.526, 0.316, 0.158]; top-p 0.8 keeps the first two
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    probs = warp(logits, SamplingConfig(top_k=3, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), atol=1e-6)
    # top-p reads the distribution renormalised after top-k: at p = 0.82 the two orders differ
    with_k = warp(logits, SamplingConfig(top_k=3, top_p=0.82))  # 0.842 >= 0.82 after top-k: two tokens
    without_k = warp(logits, SamplingConfig(top_p=0.82))  # 0.8 < 0.82: three tokens
    assert int((with_k > 0).sum()) == 2
    assert int((without_k > 0).sum()) == 3


def hf_warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' sampling distribution: the same processors, in the same order, as `generate`."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    input_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return torch.softmax(processors(input_ids, logits.clone()), dim=-1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.3, 0, 1.0),
        (1.0, 5, 1.0),
        (1.0, 0, 0.9),
        (0.8, 5, 0.9),
        (0.6, 20, 0.5),
        (1.5, 40, 0.95),
        (0.3, 1, 0.9),
        (2.0, 0, 0.3),
    ],
)
def test_warp_matches_transformers_logits_processors(temperature: float, top_k: int, top_p: float):
    logits = 3.0 * torch.randn(64, 50, generator=torch.Generator().manual_seed(4))
    ours = warp(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    theirs = hf_warp(logits, temperature, top_k, top_p)
    assert torch.equal(ours > 0, theirs > 0), "different supports"
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.allclose(ours.sum(-1), torch.ones(64))


# ----------------------------------------------------------------------------- top-p on candidates


def old_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The full-sort top-p that `_top_p` replaced, kept here as its reference."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_cases(vocab: int, rows: int, seed: int) -> list[torch.Tensor]:
    """Random and adversarial [rows, vocab] distributions: peaked, flat, top-k-masked, tied."""
    gen = torch.Generator().manual_seed(seed)
    cases = [torch.softmax(scale * torch.randn(rows, vocab, generator=gen), -1) for scale in (0.5, 2.0, 4.0, 8.0)]
    logits = 3.0 * torch.randn(rows, vocab, generator=gen)
    kth = torch.topk(logits, 7, dim=-1).values[:, -1:]
    cases.append(torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1))  # top-k 7: zeros past it
    # ties everywhere: logits on a coarse grid (groups of equal values, also across the candidate boundary)
    cases.append(torch.softmax(torch.randint(0, 6, (rows, vocab), generator=gen).float(), -1))
    cases.append(torch.softmax(torch.randint(0, 3, (rows, vocab), generator=gen).float() * 4, -1))
    cases.append(torch.full((rows, vocab), 1.0 / vocab))  # uniform: one tie group over the whole row
    two = torch.zeros(rows, vocab)  # two equal tokens and zeros
    two[:, 3] = two[:, vocab - 2] = 0.5
    cases.append(two)
    # a cut falling inside a tied group: 0.2 then many tokens of 0.8 / n
    tied = torch.zeros(rows, vocab)
    tied[:, 0] = 0.2
    tied[:, 1:41] = 0.8 / 40
    cases.append(tied)
    return cases


TOP_PS = (1e-6, 0.1, 0.3, 0.5, 0.9, 0.95, 0.999, 0.9999999)


@pytest.mark.parametrize("candidates", [(1,), (2,), (8,), (33,), (4, 40), (2, 8, 96)])
def test_top_p_on_candidates_equals_the_full_sort(candidates: tuple[int, ...]):
    from draftwise.engine.sampling import _top_p

    for seed in range(3):
        for probs in top_p_cases(vocab=97, rows=6, seed=seed):
            for top_p in TOP_PS:
                expected = old_top_p(probs, top_p)
                assert torch.equal(_top_p(probs, top_p, candidates), expected), (candidates, top_p)
                assert torch.equal(_top_p(probs[None], top_p, candidates)[0], expected)  # [..., rows, vocab]


def test_top_p_equals_the_full_sort_at_a_49k_vocabulary():
    """The default candidate count on the real vocabulary size, through `warp` (top-k on and off)."""
    from draftwise.engine.sampling import _top_p

    vocab = 49152
    gen = torch.Generator().manual_seed(7)
    logits = torch.cat([scale * torch.randn(2, vocab, generator=gen) for scale in (1.0, 3.0, 6.0, 12.0)])
    logits[0, :5000] = 9.0  # a tie group straddling the candidates
    for top_p in (0.5, 0.9, 0.99):
        probs = torch.softmax(logits, -1)
        assert torch.equal(_top_p(probs, top_p), old_top_p(probs, top_p)), top_p
        for top_k in (1, 50, 2000):
            config = SamplingConfig(top_k=top_k, top_p=top_p, temperature=0.8)
            kth = torch.topk(logits / 0.8, top_k, dim=-1).values[:, -1:]
            masked = torch.softmax((logits / 0.8).masked_fill(logits / 0.8 < kth, float("-inf")), -1)
            assert torch.equal(warp(logits, config), old_top_p(masked, top_p)), (top_k, top_p)


def test_top_p_candidate_path_is_taken(monkeypatch):
    """Peaked rows never reach the full sort (else the speed-up would be gone without any test noticing)."""
    import draftwise.engine.sampling as sampling

    calls = []
    full = sampling._top_p_kept_full
    monkeypatch.setattr(sampling, "_top_p_kept_full", lambda probs, top_p: calls.append(probs.shape) or full(probs, top_p))
    peaked = torch.softmax(8.0 * torch.randn(4, 5000, generator=torch.Generator().manual_seed(0)), -1)
    sampling._top_p(peaked, 0.9)
    wider = torch.softmax(2.5 * torch.randn(4, 5000, generator=torch.Generator().manual_seed(0)), -1)
    nucleus = (torch.sort(wider, -1, descending=True).values.cumsum(-1) < 0.9).sum(-1) + 1
    assert bool(((128 < nucleus) & (nucleus < 2048)).all())  # the second candidate count answers these rows
    sampling._top_p(wider, 0.9)
    warp(torch.randn(4, 5000), SamplingConfig(top_k=20, top_p=0.9))
    assert calls == []
    sampling._top_p(torch.full((2, 5000), 1 / 5000), 0.9)  # one tie group: only the full sort knows its order
    assert calls == [(2, 5000)]


# ----------------------------------------------------------------------------- sample / generator


def test_sample_is_reproducible_with_a_seeded_generator_and_respects_support():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    a = [sample(probs, g).tolist() for g in [make_generator(7)] for _ in range(50)]
    b = [sample(probs, g).tolist() for g in [make_generator(7)] for _ in range(50)]
    assert a == b
    assert all(row[0] in (1, 2) and row[1] == 0 for row in a)
    assert {row[0] for row in a} == {1, 2}  # the generator advances between draws


def test_make_generator_without_seed_draws_a_fresh_seed():
    assert make_generator(None).initial_seed() != make_generator(None).initial_seed()
    assert make_generator(123).initial_seed() == 123


# ----------------------------------------------------------------------------- SamplingConfig validation


@pytest.mark.parametrize("temperature", [-1.0, -1e-9, -5])
def test_config_rejects_negative_temperature(temperature):
    with pytest.raises(DraftwiseError, match="temperature"):
        SamplingConfig(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.0001, 2, float("nan")])
def test_config_rejects_top_p_outside_unit_interval(top_p):
    with pytest.raises(DraftwiseError, match="top_p"):
        SamplingConfig(top_p=top_p)


@pytest.mark.parametrize("top_k", [-1, -10, 2.5, True])
def test_config_rejects_bad_top_k(top_k):
    with pytest.raises(DraftwiseError, match="top_k"):
        SamplingConfig(top_k=top_k)


def test_config_rejects_non_numbers():
    with pytest.raises(DraftwiseError):
        SamplingConfig(temperature="1")
    with pytest.raises(DraftwiseError):
        SamplingConfig(top_p="0.9")


def test_config_accepts_boundaries():
    SamplingConfig(temperature=0, top_k=0, top_p=1.0)
    SamplingConfig(temperature=0.0, top_k=1, top_p=1e-9)
    SamplingConfig(temperature=100.0, top_k=10**6, top_p=1)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_config_rejects_non_finite_temperature(temperature):
    # NaN is not < 0, so a plain range check lets it through; warp would then divide every logit by NaN
    # and multinomial would crash mid-decoding instead of failing before any model runs.
    with pytest.raises(DraftwiseError, match="temperature"):
        SamplingConfig(temperature=temperature)


@pytest.mark.parametrize("shape", [(1, 49152), (3, 5, 49152), (2, 151936), (4, 1000), (2, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_last_is_torch_argmax_ties_and_nan_included(shape, dtype):
    """The blocked argmax gives torch.argmax's indices: random rows, rows whose maximum repeats (the first
    wins, in the same block and across blocks), a constant row, and a NaN (taken as the largest)."""
    from draftwise.engine.sampling import argmax_last

    torch.manual_seed(0)
    x = torch.randn(*shape).to(dtype)
    assert torch.equal(argmax_last(x), x.argmax(-1))
    size = shape[-1]
    tied = x.clone()
    for j in (size - 1, size // 2, 5, 3):  # the maximum at several places, the first is 3
        tied[..., j] = 50.0
    assert torch.equal(argmax_last(tied), tied.argmax(-1)) and bool((argmax_last(tied) == 3).all())
    assert torch.equal(argmax_last(torch.zeros(*shape, dtype=dtype)), torch.zeros(shape[:-1], dtype=torch.long))
    nan = x.clone()
    nan[..., size - 2] = float("nan")
    assert torch.equal(argmax_last(nan), nan.argmax(-1))
    strided = torch.randn(*shape[:-1], 2 * size).to(dtype)[..., ::2]  # not contiguous
    assert torch.equal(argmax_last(strided), strided.argmax(-1))
