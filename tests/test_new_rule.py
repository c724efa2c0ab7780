"""A new acceptance rule is two edits (issue 56): its class (a `rules.acceptance.Rule` with `__call__` giving pi
from the step's distributions) and its Method entry (methods.py). The one sampler then runs it over chains, ragged
batches and mixed settings. The toy rule here trusts the draft (pi = the draft's distribution): the sampler keeps
every drafted token and the target only adds the bonus token, which the test checks from the stats and the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import draftwise
from draftwise.methods import METHODS, Method
from draftwise.models.loading import load_model
from draftwise.models.tiny import tiny_llama
from draftwise.rules.acceptance import Rule


@dataclass(frozen=True)
class TrustDraft(Rule):  # edit 1: the rule
    """pi = q: a drafted token is always accepted (u q(x) < q(x)), the bonus comes from the target."""

    name: str = "trust-draft"

    def __call__(self, step):
        return step.draft_probs


PROMPTS = [[3, 17, 42, 8, 25, 3, 17], [5, 6, 5, 6, 5, 5, 5], [9]]


@pytest.fixture(scope="module")
def pair():
    return load_model(tiny_llama(0, init=0.05, vocab=64)), load_model(tiny_llama(1, layers=1, init=0.05, vocab=64))


@pytest.fixture
def trust(monkeypatch):
    monkeypatch.setitem(METHODS, "trust", Method("trust", "keeps every drafted token", drafter="model",  # edit 2
                                                 make_rule=lambda options: TrustDraft(), exact=False))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_new_rule_is_a_class_and_a_method_entry(pair, trust, temperature):
    target, draft = pair
    common = dict(max_new_tokens=14, ignore_eos=True, gamma=3, seed=5, temperature=temperature)
    ours = draftwise.generate(target, PROMPTS, method="trust", draft=draft, max_batch_size=3, **common)  # ragged
    for g in ours:  # every drafted token kept; each target call adds one token of its own (the bonus)
        assert g.stats["drafted"] > 0 and g.stats["accepted"] == g.stats["drafted"]
        assert g.stats["accepted"] + g.stats["target_calls"] >= len(g.token_ids)
    alone = draftwise.generate(target, PROMPTS[1], method="trust", draft=draft, **common)
    assert alone.token_ids == ours[1].token_ids
    if temperature == 0.0:  # greedy: the draft's own greedy tokens first
        drafted = draftwise.generate(draft, PROMPTS[0], method="ar", temperature=0.0, max_new_tokens=3,
                                     ignore_eos=True)
        assert ours[0].token_ids[:3] == drafted.token_ids
        exact = draftwise.generate(target, PROMPTS, method="sd", draft=draft, **common)
        assert [g.token_ids for g in ours] != [g.token_ids for g in exact]  # the toy rule is in effect
