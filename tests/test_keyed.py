"""Keyed randomness (engine/keyed.py): a seeded answer depends on its seed, prompt and options only.

- The hash is splitmix64, bit for bit against a pure-Python reference; the lazy Gumbel-max equals the full one
  (every vocabulary entry's draw computed) on random, flat, peaked and truncated distributions.
- `gumbel_argmax` draws from p (Pearson chi-square at ALPHA = 1e-3 over 4,000 keys), and two distributions
  coupled by the same noise agree at least (1 - TV) / (1 + TV) of the time (Daliri et al.); negative control: a
  block minimum drawn as Exp(1) instead of Exp(BLOCK) (a biased Gumbel) is rejected by the same test.
- Drafter-invariant mode (the exact rule's default, Gumbel coupling): `sd` reproduces the target's joint
  distribution of 3 tokens (N_FIT seeded runs, chi-square at ALPHA); control: keys that ignore the position (the
  reseeding pitfall) are rejected. At T=1 a seeded answer equals `ar`'s with the same seed for every drafter
  (draft model chains and trees, a restricted-vocabulary draft, an EAGLE head, prompt lookup, suffix, hybrid),
  alone and in a ragged batch on the server's schedule.
- Load independence: 16 requests with one seed at concurrency 1, 8 and 16 (a closed loop on one engine, the
  server's schedule: requests join while others decode), at T=0 and T=1, for sd, prompt-lookup, suffix, hybrid,
  trees, lossy and cascade: 48/48 answers equal to the concurrency-1 answer. Control: draws from one stream for
  the engine (a torch.Generator, numbers taken row by row in batch order) fail it for sd at T=1.
- Acceptance of the two couplings on the tiny pair, reported (Gumbel accepts less than rejection sampling).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import draftwise
from draftwise.builder import build_engine
from draftwise.engine import keyed
from draftwise.plan import make_plan, request_for

from conftest import near_copy, tiny_llama
from test_exactness import ALPHA, WARPED, exact_joint, pooled_chisquare, target_and_draft, SD_PROMPTS

_MASK = (1 << 64) - 1


def _mix_ref(z: int) -> int:
    z &= _MASK
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _uniform_ref(seed: int, position: int, purpose: int) -> float:
    base = _mix_ref(seed + 0x9E3779B97F4A7C15)
    key = _mix_ref(base + _mix_ref(position * 16 + purpose + 0x9E3779B97F4A7C15))
    return ((_mix_ref(key) >> 11) + 0.5) * 2.0 ** -53


def test_the_hash_is_splitmix64_bit_for_bit():
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 12345678901234567890]
    positions = [0, 1, 7, 4095, 10**9]
    got = keyed.uniforms(keyed.seeds_tensor(seeds, "cpu"), torch.tensor([positions] * len(seeds)), keyed.RESIDUAL)
    want = torch.tensor([[_uniform_ref(s, p, keyed.RESIDUAL) for p in positions] for s in seeds], dtype=torch.float64)
    assert torch.equal(got, want)
    assert bool(((got > 0) & (got < 1)).all())
    # purposes and positions give different numbers
    other = keyed.uniforms(keyed.seeds_tensor(seeds, "cpu"), torch.tensor([positions] * len(seeds)), keyed.ACCEPT)
    assert not bool((got == other).any())


@pytest.mark.parametrize("vocab", [6, 12, 64, 100, 1000, 4099])
def test_the_lazy_gumbel_max_equals_the_full_one(vocab):
    generator = torch.Generator().manual_seed(vocab)
    mismatches = 0
    for trial in range(40):
        rows, n = 3, 4
        scale = [0.1, 1.0, 3.0, 10.0][trial % 4]
        probs = torch.softmax(scale * torch.randn(rows, n, vocab, generator=generator), -1)
        if trial % 5 == 0:  # top-k: most entries zero
            kth = torch.topk(probs, min(3, vocab), -1).values[..., -1:]
            probs = probs.masked_fill(probs < kth, 0.0)
        seeds = keyed.seeds_tensor([trial, 7 * trial + 1, 2**64 - 1 - trial], "cpu")
        positions = torch.randint(0, 10_000, (rows, n), generator=generator)
        lazy = keyed.gumbel_argmax(probs, seeds, positions)
        full = (probs.double() / keyed.exponentials(seeds, positions, vocab)).argmax(-1)
        mismatches += int((lazy != full).sum())
    assert mismatches == 0


P_FIT = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.06, 0.04, 0.02, 0.01, 0.0])
Q_FIT = torch.tensor([0.10, 0.25, 0.05, 0.20, 0.10, 0.10, 0.10, 0.05, 0.05, 0.0])
N_KEYS = 4000


def _draws(probs: torch.Tensor, n: int = N_KEYS, offset: int = 0) -> np.ndarray:
    seeds = keyed.seeds_tensor(list(range(offset, offset + n)), "cpu")
    out = keyed.gumbel_argmax(probs.expand(n, 1, -1), seeds, torch.full((n, 1), 17))
    return np.bincount(out[:, 0].numpy(), minlength=probs.shape[-1])


def test_gumbel_argmax_draws_from_p_and_couples_two_distributions():
    counts = _draws(P_FIT)
    assert counts[-1] == 0  # a zero-probability entry is never drawn
    p_value = pooled_chisquare(counts, P_FIT.numpy())
    print(f"gumbel_argmax vs p: chi-square p = {p_value:.3g}")
    assert p_value > ALPHA
    # the same noise on q: the agreement rate is at least (1 - TV) / (1 + TV), below 1 - TV
    seeds = keyed.seeds_tensor(list(range(N_KEYS)), "cpu")
    positions = torch.full((N_KEYS, 1), 17)
    from_p = keyed.gumbel_argmax(P_FIT.expand(N_KEYS, 1, -1), seeds, positions)
    from_q = keyed.gumbel_argmax(Q_FIT.expand(N_KEYS, 1, -1), seeds, positions)
    agree = float((from_p == from_q).double().mean())
    tv = 0.5 * float((P_FIT - Q_FIT).abs().sum())
    bound = (1 - tv) / (1 + tv)
    sd = math.sqrt(bound * (1 - bound) / N_KEYS)
    print(f"coupled agreement {agree:.3f}; (1 - TV) / (1 + TV) = {bound:.3f}, 1 - TV = {1 - tv:.3f}")
    assert agree > bound - 4 * sd
    # independent keys agree only sum p q of the time
    other = keyed.gumbel_argmax(Q_FIT.expand(N_KEYS, 1, -1), seeds, positions + 1)
    assert float((from_p == other).double().mean()) < bound - 4 * sd


def test_control_a_biased_gumbel_is_rejected(monkeypatch):
    """The block minimum drawn as Exp(1) (as if the block held one entry) instead of Exp(BLOCK)."""
    real = keyed._block_noise

    def biased(seeds, positions, blocks):
        block_keys, least, at = real(seeds, positions, blocks)
        return block_keys, least * keyed.BLOCK, at

    monkeypatch.setattr(keyed, "_block_noise", biased)
    p_value = pooled_chisquare(_draws(P_FIT), P_FIT.numpy())
    print(f"control, biased Gumbel: p = {p_value:.3g}")
    assert p_value < ALPHA


# ----------------------------------------------------------------------------- drafter-invariant mode, end to end

N_FIT = 3000
SD_GUMBEL = dict(prompt=SD_PROMPTS[6], method="sd", gamma=3, max_new_tokens=4, temperature=WARPED.temperature,
                 top_k=WARPED.top_k, top_p=WARPED.top_p)


def _sd_joint(n: int) -> tuple[np.ndarray, dict[str, int]]:
    target, draft = target_and_draft(6)
    counts = np.zeros((6,) * 3, dtype=np.int64)
    totals = {"drafted": 0, "accepted": 0}
    for seed in range(n):
        out = draftwise.generate(target, draft=draft, seed=seed, ignore_eos=True, **SD_GUMBEL)
        counts[tuple(out.token_ids[:3])] += 1
        for key in totals:
            totals[key] += out.stats[key]
    return counts, totals


def test_gumbel_coupled_sd_reproduces_the_target_joint_distribution():
    target, _ = target_and_draft(6)
    expected = exact_joint(target, SD_GUMBEL["prompt"], WARPED, 3)
    counts, totals = _sd_joint(N_FIT)
    assert 0 < totals["accepted"] < totals["drafted"], totals
    assert counts[expected == 0].sum() == 0
    p_value = pooled_chisquare(counts, expected)
    print(f"sd, Gumbel coupling: chi-square p = {p_value:.3g}, acceptance {totals['accepted'] / totals['drafted']:.3f}")
    assert p_value > ALPHA


def test_control_keys_that_ignore_the_position_are_rejected(monkeypatch):
    real = keyed.keys
    monkeypatch.setattr(keyed, "keys", lambda seeds, positions, purpose: real(seeds, positions * 0, purpose))
    target, _ = target_and_draft(6)
    counts, _ = _sd_joint(1500)
    p_value = pooled_chisquare(counts, exact_joint(target, SD_GUMBEL["prompt"], WARPED, 3))
    print(f"control, position-blind keys: p = {p_value:.3g}")
    assert p_value < ALPHA


VOCAB = 48
RAGGED = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 7, 1, 2], [7], [9, 9, 9, 9, 10, 11, 9, 9, 9]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(21, vocab=VOCAB, layers=1, width=32, init=0.3)
    return target, near_copy(target, 0.15)


def _eagle_head(target):
    from draftwise.heads.eagle import EagleConfig, EagleHead

    torch.manual_seed(3)
    head = EagleHead(EagleConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=32,
                                 target_vocab_size=VOCAB), torch.arange(0, VOCAB, 2))
    return head.attach(target)


def _restricted(draft):
    from draftwise.models.loading import LoadedModel

    return LoadedModel(model=draft, name="restricted", output_ids=torch.arange(0, VOCAB, 3))


DRAFTERS = {
    "sd": lambda t, d: dict(method="sd", draft=d),
    "sd-tree": lambda t, d: dict(method="sd", draft=d, tree_nodes=6),
    "sd-restricted-vocab": lambda t, d: dict(method="sd", draft=_restricted(d)),
    "sd-eagle": lambda t, d: dict(method="sd", draft=_eagle_head(t)),
    "prompt-lookup": lambda t, d: dict(method="prompt-lookup"),
    "suffix": lambda t, d: dict(method="suffix"),
    "suffix-tree": lambda t, d: dict(method="suffix", tree_nodes=6),
    "hybrid": lambda t, d: dict(method="hybrid", draft=d, threshold=1.0),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_a_seeded_t1_answer_is_ars_whatever_the_drafter_alone_and_batched(drafter, pair, monkeypatch):
    from draftwise import api

    real = api.build_engine  # the server's schedule: rows join while others decode
    monkeypatch.setattr(api, "build_engine", lambda *a, **k: real(*a, **{**k, "prefill_first": False}))
    target, draft = pair
    common = dict(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    accepted, drafted = 0, 0
    for seed in (0, 1):
        ar = [draftwise.generate(target, p, method="ar", seed=seed, **common).token_ids for p in RAGGED]
        alone = [draftwise.generate(target, p, seed=seed, gamma=4, **common, **DRAFTERS[drafter](target, draft))
                 for p in RAGGED]
        batched = draftwise.generate(target, RAGGED, seed=seed, gamma=4, max_batch_size=len(RAGGED), **common,
                                     **DRAFTERS[drafter](target, draft))
        assert [o.token_ids for o in alone] == ar, seed
        assert [o.token_ids for o in batched] == ar, seed
        accepted += sum(o.stats["accepted"] for o in alone + batched)
        drafted += sum(o.stats["drafted"] for o in alone + batched)
    assert drafted > 0
    if "sd" in drafter or drafter == "hybrid":  # model drafts were accepted: the equality is not ar's by default
        assert accepted > 0


# ----------------------------------------------------------------------------- 48/48 at concurrency 1, 8, 16

LOAD_METHODS = {
    "sd": dict(method="sd"),
    "prompt-lookup": dict(method="prompt-lookup"),
    "suffix": dict(method="suffix"),
    "hybrid": dict(method="hybrid", threshold=1.0),
    "trees": dict(method="sd", tree_nodes=6),
    "lossy": dict(method="lossy", alpha=0.3),
    "cascade": dict(method="cascade"),
}
LOAD_PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
REQUESTS = 16


def _closed_loop(plan, concurrency: int) -> list[list[int]]:
    """REQUESTS copies of the plan's request on one engine, `concurrency` in flight (a new one joins as one ends,
    while the others decode: the server's schedule)."""
    engine = build_engine(plan, concurrency)
    request = request_for(plan, plan.prompt_ids)
    ids = [engine.submit(request) for _ in range(min(concurrency, REQUESTS))]
    submitted = len(ids)
    while engine.has_work:
        for event in engine.step():
            if event.finished and submitted < REQUESTS:
                ids.append(engine.submit(request))
                submitted += 1
    return [engine.result(i).token_ids for i in ids]


def _plan(target, draft, method: str, temperature: float, seed: int = 3, **options):
    kwargs = dict(LOAD_METHODS[method])
    name = kwargs.pop("method")
    kwargs.update(options)
    return make_plan(target=target, prompt=LOAD_PROMPT, draft=draft if name != "prompt-lookup" and name != "suffix"
                     else None, method=name, max_new_tokens=24, temperature=temperature, top_k=0, top_p=1.0,
                     seed=seed, gamma=4, stop=None, ignore_eos=True, method_options=kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", list(LOAD_METHODS))
def test_sixteen_seeded_requests_give_48_of_48_at_concurrency_1_8_16(method, temperature, pair):
    target, draft = pair
    plan = _plan(target, draft, method, temperature)
    reference = _closed_loop(plan, 1)
    assert all(answer == reference[0] for answer in reference), "concurrency 1: one after another differ"
    same = sum(answer == reference[0] for c in (1, 8, 16) for answer in _closed_loop(plan, c))
    print(f"{method} T={temperature:g}: {same}/48")
    assert same == 3 * REQUESTS


def test_control_batch_stream_draws_fail_the_load_check(pair, monkeypatch):
    """The draws before keying with one stream for the engine (a torch.Generator seeded once, numbers taken row by
    row as a step's batch lists them: the usual batched sampler) under rejection sampling: at T=1 a row's numbers
    follow its batch-mates, so its answer changes with load. The same check must catch it. (Per-request streams
    no longer fail it for sd: every row drafts from its first step, so a row takes the same numbers at any load.)"""
    import draftwise.engine.step as step_module
    import draftwise.engine.keyed as keyed_module

    target, draft = pair
    stream = torch.Generator()

    def stream_draws(rows, device):
        seeds = [int(torch.randint(0, 2**62, (1,), generator=stream)) for _ in rows]
        return keyed_module.Draws(seeds, [0] * len(rows), [r.gumbel for r in rows], device)

    monkeypatch.setattr(step_module, "row_draws", stream_draws)
    import draftwise.drafters.base as base
    monkeypatch.setattr(base, "row_draws", stream_draws)
    plan = _plan(target, draft, "sd", 1.0, coupling="rejection")
    stream.manual_seed(plan.seed)
    reference = _closed_loop(plan, 1)[0]
    same = 0
    for concurrency in (8, 16):
        stream.manual_seed(plan.seed)
        same += sum(answer == reference for answer in _closed_loop(plan, concurrency))
    print(f"control, one stream for the batch: {same}/32")
    assert same < 2 * REQUESTS


def test_acceptance_of_the_two_couplings_is_reported(pair):
    """Both couplings decode the same distribution; Gumbel accepts less. Reported, with a loose check."""
    target, draft = pair
    rates = {}
    for coupling in ("gumbel", "rejection"):
        outs = draftwise.generate(target, RAGGED, draft=draft, method="sd", gamma=4, temperature=1.0, seed=11,
                                  max_new_tokens=48, ignore_eos=True, coupling=coupling)
        drafted = sum(o.stats["drafted"] for o in outs)
        rates[coupling] = sum(o.stats["accepted"] for o in outs) / drafted
    print(f"acceptance at T=1: gumbel {rates['gumbel']:.3f}, rejection {rates['rejection']:.3f}")
    assert 0 < rates["gumbel"] and 0 < rates["rejection"]


def test_a_bad_coupling_is_one_clear_error(pair):
    target, draft = pair
    with pytest.raises(draftwise.DraftwiseError, match="coupling must be one of gumbel, rejection"):
        draftwise.generate(target, [1, 2, 3], draft=draft, method="sd", coupling="maximal")
