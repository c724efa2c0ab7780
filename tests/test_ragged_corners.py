"""A row never depends on its batch-mates, in the corner issue 34 found: a ragged batch that holds a one-token
prompt (it decodes a step before its batch-mates' prompts are in, so the batch's size follows its random outcome)
and rows with no draft this step (an empty tree, a chain with nothing found, a last token).

- Token trees (draft model, EAGLE head, suffix, hybrid) with the default, batch-dependent node budget:
  - T=1, goodness of fit: each row's joint of its first two tokens against the target's, Pearson chi-square
    (cells expected below 5 pooled) at ALPHA = 1e-3 per test, Bonferroni over the batch's rows. Negative control:
    the previous acceptance (SpecInfer's walk, one uniform per candidate tried, correct step by step), which
    every row seeded alike turned into a bias, is rejected by the same test.
  - T=1, token for token: a tree method writes `ar`'s tokens for the same seed (one uniform per committed token).
  - T=0, token for token against `ar`; negative control: reading the distribution one slot off is caught.
- Chains (draft model, prompt lookup, suffix), grammars and prefix-cache hits: at T=1 each row of the batch writes
  the tokens it writes alone with the same seed (alone is exact by test_exactness, so the batch is too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import draftwise
import draftwise.engine.step as engine_module
import draftwise.engine.tree as tree_module
from draftwise.engine.sampling import SamplingConfig
from draftwise.engine.tree import TreeAcceptance

from conftest import json_tokenizer, near_copy, tiny_llama
from test_exactness import ALPHA, exact_joint, pooled_chisquare

N_FIT = 300  # seeded generate() runs (of the whole batch) per goodness-of-fit test
VOCAB = 8
# a repeating prompt (suffix matches), one with nothing to match, a one-token prompt
RAGGED = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 7, 1, 2], [7]]
T1 = SamplingConfig(temperature=1.0)


def _sharp_llama(seed: int):
    """The issue's tiny Llama: near-uniform weights, its LM head scaled by 4 (distributions far from uniform)."""
    model = tiny_llama(seed, vocab=VOCAB, layers=1, width=32, init=0.02)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(autouse=True)
def _server_schedule(monkeypatch):
    """`generate` prefills a list of prompts first, so its rows start decoding together. These tests want the
    server's schedule, where ragged rows start at different steps beside each other: the corner the controls
    below must catch."""
    from draftwise import api

    real = api.build_engine
    monkeypatch.setattr(api, "build_engine", lambda *args, **kwargs: real(*args, **{**kwargs, "prefill_first": False}))


@pytest.fixture(scope="module")
def issue_pair():
    return _sharp_llama(41), _sharp_llama(42)


def _eagle_head(target):
    from draftwise.heads.eagle import EagleConfig, EagleHead

    torch.manual_seed(3)
    head = EagleHead(EagleConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=32,
                                 target_vocab_size=VOCAB), torch.arange(VOCAB))
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)
    return head.attach(target)


def _tree_kwargs(drafter: str, target, draft) -> dict:
    if drafter == "suffix":
        return dict(method="suffix")
    if drafter == "eagle":
        return dict(method="sd", draft=_eagle_head(target))
    return dict(method=drafter, draft=draft)  # sd (the draft model), hybrid


def _batch_joint(n: int, length: int, **kwargs) -> tuple[list[np.ndarray], dict[str, int]]:
    counts = [np.zeros((VOCAB,) * length, dtype=np.int64) for _ in RAGGED]
    totals = {"drafted": 0, "accepted": 0}
    for seed in range(n):
        outs = draftwise.generate(prompt=RAGGED, seed=seed, ignore_eos=True, max_batch_size=len(RAGGED),
                                  max_new_tokens=length, **kwargs)
        for b, out in enumerate(outs):
            counts[b][tuple(out.token_ids[:length])] += 1
            for key in totals:
                totals[key] += out.stats[key]
    return counts, totals


def _row_p_values(target, counts: list[np.ndarray]) -> list[float]:
    return [pooled_chisquare(c, exact_joint(target, prompt, T1, c.ndim)) for prompt, c in zip(RAGGED, counts)]


def sequential_accept(parents, tokens, target_probs, generators, greedy) -> TreeAcceptance:
    """The acceptance trees had before issue 34 (a reference for the negative control): at a node, its children
    are tried in turn, child x accepted with p(x) / (1 - mass of the siblings rejected so far), each try drawing a
    uniform; with none accepted, the next token comes from p without the rejected siblings. Exact for one row
    with its own seed; its uniforms per step depend on the tree's shape."""
    paths, nexts, finals = [], [], []
    for b, row in enumerate(parents):
        n = len(row)
        u = [0.5] * (n + 1) if greedy[b] else \
            torch.rand(n + 1, generator=generators[b], dtype=torch.float64).tolist()
        node, path, used, rejected = -1, [], 0, []
        while True:
            mass, rejected, taken = 0.0, [], None
            for child in [i for i, p in enumerate(row) if p == node]:
                token = tokens[b][child]
                if token in rejected:
                    continue
                p = float(target_probs[b, node + 1, token])
                used += 1
                if u[used - 1] < (p / (1.0 - mass) if mass < 1.0 else 0.0):
                    taken = child
                    break
                mass += p
                rejected.append(token)
            if taken is None:
                break
            path.append(taken)
            node = taken
        probs = target_probs[b, node + 1].double().clone()
        if rejected and probs.sum() - probs[rejected].sum() > 1e-12:
            probs[rejected] = 0.0
        next_token = int(probs.argmax()) if greedy[b] else \
            int(torch.searchsorted(probs.cumsum(0), u[n] * probs.sum(), right=True).clamp(max=len(probs) - 1))
        paths.append(path)
        nexts.append(next_token)
        finals.append(node + 1)
    return TreeAcceptance(paths, nexts, finals)


# ----------------------------------------------------------------------------- trees, T=1

@pytest.mark.parametrize("drafter", ["sd", "eagle", "suffix", "hybrid"])
def test_tree_rows_in_a_ragged_batch_reproduce_the_target_joint_distribution(drafter, issue_pair):
    target, draft = issue_pair
    counts, totals = _batch_joint(N_FIT, 2, target=target, temperature=1.0, gamma=3, tree_nodes=6,
                                  **_tree_kwargs(drafter, target, draft))
    assert 0 < totals["accepted"] < totals["drafted"], totals  # trees were grown, accepted and rejected
    p_values = _row_p_values(target, counts)
    print(f"{drafter} tree, ragged batch: chi-square p per row = {[f'{p:.3g}' for p in p_values]}")
    assert min(p_values) > ALPHA / len(RAGGED), p_values


def test_control_per_candidate_uniforms_bias_a_ragged_batch(issue_pair, monkeypatch):
    """The bug issue 34 reported: with one uniform per candidate tried, rows seeded alike get trees shaped by their
    batch-mates' outcomes, so correlated with their own uniforms; the same test must reject it."""
    target, draft = issue_pair
    monkeypatch.setattr(engine_module, "accept_tree", sequential_accept)
    # twice the runs: since draws are keyed (issue 55), a step without a tree takes no number from the stream, so
    # the control's streams drift apart less and its bias is weaker (p ~ 3e-4 - 2e-3 at N_FIT, timing-dependent)
    counts, _ = _batch_joint(2 * N_FIT, 2, target=target, temperature=1.0, gamma=3, tree_nodes=6, method="sd",
                             draft=draft)
    p_values = _row_p_values(target, counts)
    print(f"control, per-candidate uniforms: p per row = {[f'{p:.3g}' for p in p_values]}")
    assert min(p_values) < ALPHA / len(RAGGED), f"the per-candidate bug was not detected: {p_values}"


def test_the_reference_walk_alone_is_exact_so_the_control_fails_through_the_batch(issue_pair, monkeypatch):
    """The control's acceptance is right for a row decoded alone: what the control catches is the batch."""
    target, draft = issue_pair
    monkeypatch.setattr(engine_module, "accept_tree", sequential_accept)
    prompt = RAGGED[0]
    counts = np.zeros((VOCAB,) * 2, dtype=np.int64)
    for seed in range(N_FIT):
        out = draftwise.generate(target, prompt, draft=draft, method="sd", temperature=1.0, gamma=3, tree_nodes=6,
                                 max_new_tokens=2, seed=seed, ignore_eos=True)
        counts[tuple(out.token_ids)] += 1
    p_value = pooled_chisquare(counts, exact_joint(target, prompt, T1, 2))
    assert p_value > ALPHA, p_value


@pytest.mark.parametrize("drafter", ["sd", "eagle", "suffix", "hybrid"])
def test_tree_rows_write_ar_tokens_for_the_same_seed(drafter, issue_pair):
    target, draft = issue_pair
    common = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True, max_batch_size=2)
    accepted = 0
    for seed in range(3):
        ar = draftwise.generate(target, RAGGED, method="ar", seed=seed, **common)
        out = draftwise.generate(target, RAGGED, seed=seed, gamma=4, tree_nodes=6, **common,
                                 **_tree_kwargs(drafter, target, draft))
        assert [o.token_ids for o in out] == [a.token_ids for a in ar], seed
        accepted += sum(o.stats["accepted"] for o in out)
    assert accepted > 0


def test_control_per_candidate_uniforms_break_ar_equality(issue_pair, monkeypatch):
    target, draft = issue_pair
    monkeypatch.setattr(engine_module, "accept_tree", sequential_accept)
    common = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True, max_batch_size=2)
    differ = 0
    for seed in range(3):
        ar = draftwise.generate(target, RAGGED, method="ar", seed=seed, **common)
        out = draftwise.generate(target, RAGGED, seed=seed, gamma=4, tree_nodes=6, method="sd", draft=draft, **common)
        differ += sum(o.token_ids != a.token_ids for o, a in zip(out, ar))
    assert differ > 0


# ----------------------------------------------------------------------------- trees, T=0

def _greedy_trees_equal_ar(target, draft, drafter) -> bool:
    common = dict(temperature=0, max_new_tokens=16, ignore_eos=True, max_batch_size=2)
    ar = draftwise.generate(target, RAGGED, method="ar", **common)
    out = draftwise.generate(target, RAGGED, gamma=4, tree_nodes=6, **common, **_tree_kwargs(drafter, target, draft))
    return [o.token_ids for o in out] == [a.token_ids for a in ar]


@pytest.mark.parametrize("drafter", ["sd", "eagle", "suffix", "hybrid"])
def test_tree_rows_in_a_ragged_batch_equal_ar_at_temperature_0(drafter, issue_pair):
    target, draft = issue_pair
    assert _greedy_trees_equal_ar(target, draft, drafter)


def test_control_a_slot_off_by_one_is_caught_at_temperature_0(issue_pair, monkeypatch):
    target, draft = issue_pair
    monkeypatch.setattr(tree_module, "node_slot", lambda node: max(node, 0))
    assert not _greedy_trees_equal_ar(target, draft, "sd")


# ----------------------------------------------------------------------------- chains, grammars, prefix hits

def _batch_equals_alone(target, prompts, seeds=(0, 1, 2), **kwargs) -> None:
    kwargs = dict(temperature=1.0, **{"ignore_eos": True, **kwargs})
    for seed in seeds:
        batch = draftwise.generate(target, prompts, seed=seed, max_batch_size=len(prompts), **kwargs)
        alone = [draftwise.generate(target, p, seed=seed, **kwargs) for p in prompts]
        assert [b.token_ids for b in batch] == [a.token_ids for a in alone], seed


@pytest.mark.parametrize("method", ["sd", "prompt-lookup", "suffix"])
def test_chain_rows_in_a_ragged_batch_write_their_tokens_alone(method, issue_pair):
    target, draft = issue_pair
    _batch_equals_alone(target, RAGGED, method=method, draft=draft if method == "sd" else None, gamma=3,
                        max_new_tokens=10)


def test_control_suffix_chains_sampled_as_drafts_of_their_own_depend_on_the_batch(issue_pair, monkeypatch):
    """Suffix tries are shared across the batch, so a row's draft depends on its batch-mates' answers: verified as
    one-hot proposals (a uniform per drafted token, rejection sampling) rather than by the target's own draw, the
    row's tokens follow its batch-mates, and the same check catches it."""
    import draftwise.drafters.suffix as suffix_module
    from dataclasses import replace

    target, _ = issue_pair
    one_hot = suffix_module.one_hot_draft
    monkeypatch.setattr(suffix_module, "one_hot_draft", lambda *a: replace(one_hot(*a), deterministic=False))
    with pytest.raises(AssertionError):
        _batch_equals_alone(target, RAGGED, method="suffix", gamma=3, max_new_tokens=10, coupling="rejection")


def test_grammar_rows_in_a_ragged_batch_write_their_tokens_alone():
    from draftwise.models.loading import load_model

    tok = json_tokenizer(64)
    base = tiny_llama(0, init=0.3, eos=0)
    target, draft = load_model(base, tokenizer=tok), load_model(near_copy(base, scale=0.2), tokenizer=tok)
    prompts = [[34, 1], [34], [34, 1, 34, 1, 34, 1]]
    for method in ("sd", "prompt-lookup"):
        _batch_equals_alone(target, prompts, method=method, draft=draft if method == "sd" else None, gamma=3,
                            max_new_tokens=6, grammar={"regex": r"(cat|dog|fal)[0-9]+"}, ignore_eos=False)


def test_prefix_cache_hits_in_a_ragged_batch_write_their_tokens_alone():
    target = tiny_llama(0)
    draft = near_copy(target, 0.1)
    shared = [(7 * i + 3) % 60 + 1 for i in range(70)]
    prompts = [shared + [5], [9], shared + [9, 2], shared[:66] + [4]]
    kwargs = dict(temperature=1.0, ignore_eos=True, method="sd", draft=draft, gamma=3, max_new_tokens=8)
    for seed in (0, 1):
        hit = draftwise.generate(target, prompts, seed=seed, max_batch_size=2, prefix_cache_mb=16, **kwargs)
        alone = [draftwise.generate(target, p, seed=seed, **kwargs) for p in prompts]
        assert [h.token_ids for h in hit] == [a.token_ids for a in alone], seed
        # the later rows hit the cache (how many blocks depends on when the engine admits them: 64 under load)
        assert sum(h.stats["cached_tokens"] for h in hit) >= 64
