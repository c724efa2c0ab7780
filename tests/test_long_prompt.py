"""Long prompts keep speculation (issue 55, item 6): a draft admitted with a prompt longer than its per-step
catch-up (drafters' CATCH_UP) drafts from its first step when no batch-mate's step would be held up, and every
answer stays the target's greedy answer token for token."""

from __future__ import annotations

import pytest
import torch

import draftwise
from conftest import near_copy, tiny_llama
from draftwise.drafters import base as drafters_base
from draftwise.drafters.base import ModelRowsDrafter, NoRowsDrafter
from draftwise.engine.core import Engine
from draftwise.engine.rows import Request
from draftwise.engine.sampling import SamplingConfig
from draftwise.models.runner import ModelRunner
from draftwise.rules.acceptance import ExactRule

WINDOW = 4096
LONG = 12 * drafters_base.CATCH_UP  # 3,072 tokens: fed CATCH_UP a step, the draft needed 12 steps to catch up
NEW = 8  # fewer new tokens than those 12 steps: before the fix, such a request drafted nothing at all
GREEDY = SamplingConfig(temperature=0)


def _prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(1 + (i * 7 + salt) % 60 for i in range(n))


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, window=WINDOW)
    return target, near_copy(target)  # a draft that agrees often: accepted tokens show it drafted with the context


def _engine(target, drafter=None, *, gamma=4, tree_nodes=0):
    runner = ModelRunner(target, rows=0)
    drafter = drafter if drafter is not None else NoRowsDrafter(64, runner.device)
    return Engine(runner, drafter, ExactRule(), gamma=gamma, max_batch_size=8, tree_nodes=tree_nodes)


def _ar(target, prompt, new=NEW) -> list[int]:
    engine = _engine(target)
    rid = engine.submit(Request(prompt, GREEDY, max_new_tokens=new))
    engine.run()
    return engine.result(rid).token_ids


def test_a_long_prompt_drafts_with_sd_and_answers_as_ar(pair):
    target, draft = pair
    prompt = list(_prompt(LONG))
    ar = draftwise.generate(target, prompt, method="ar", temperature=0, max_new_tokens=NEW)
    sd = draftwise.generate(target, prompt, draft=draft, method="sd", temperature=0, max_new_tokens=NEW, gamma=4)
    assert sd.token_ids == ar.token_ids and len(sd.token_ids) == NEW
    assert sd.stats["drafted"] > 0 and sd.stats["accepted"] > 0
    assert sd.stats["target_calls"] < NEW  # speculation paid: fewer target calls than tokens


@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_the_first_step_after_long_prompts_drafts(pair, tree_nodes):
    """Two long prompts that join together (every row catching up): the draft's cache takes the whole prompts
    in prefill chunks, and their first decoding step drafts (chains and token trees)."""
    target, draft = pair
    prompts = [_prompt(LONG), _prompt(LONG, salt=3)]
    drafter = ModelRowsDrafter(ModelRunner(draft, rows=0), 64)
    engine = _engine(target, drafter, tree_nodes=tree_nodes)
    ids = [engine.submit(Request(p, GREEDY, max_new_tokens=NEW)) for p in prompts]
    for _ in range(200):  # prefill; the step in which the rows join decodes them too
        engine.step()
        if engine.live:
            break
    assert len(engine.live) == 2 and all(row.counters.steps == 1 for row in engine.live)
    assert all(row.counters.drafted > 0 for row in engine.live), "a row drafted nothing in its first step"
    assert drafter.prefill_calls > 0
    engine.run()
    for rid, prompt in zip(ids, prompts):
        assert engine.result(rid).token_ids == _ar(target, prompt)


def test_a_long_prompt_beside_a_decoding_row_catches_up_and_drafts(pair):
    """Beside a row that decodes, the long prompt's draft catches up CATCH_UP a step (the decoding row's
    steps are not held up by the whole prompt), then drafts; both answers are ar's."""
    target, draft = pair
    short, long = _prompt(5), _prompt(4 * drafters_base.CATCH_UP + 10, salt=1)
    drafter = ModelRowsDrafter(ModelRunner(draft, rows=0), 64)
    engine = _engine(target, drafter)
    a = engine.submit(Request(short, GREEDY, max_new_tokens=60))
    engine.step()
    b = engine.submit(Request(long, GREEDY, max_new_tokens=20))
    engine.run()
    assert engine.result(b).stats["drafted"] > 0
    assert engine.result(a).token_ids == _ar(target, short, 60)
    assert engine.result(b).token_ids == _ar(target, long, 20)


def test_an_eagle_head_after_a_long_prompt_drafts_from_its_first_step(pair):
    from draftwise.drafters.eagle import EagleRowsDrafter
    from draftwise.heads.eagle import EagleConfig, EagleHead

    target, _ = pair
    torch.manual_seed(7)
    head = EagleHead(EagleConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                 target_vocab_size=64), torch.arange(64)).attach(target).eval()
    drafter = EagleRowsDrafter(head, 64, torch.device("cpu"))
    engine = _engine(target, drafter)
    prompt = _prompt(LONG)
    rid = engine.submit(Request(prompt, GREEDY, max_new_tokens=NEW))
    for _ in range(200):
        engine.step()
        if engine.live:
            break
    assert engine.live[0].counters.steps == 1 and engine.live[0].counters.drafted > 0
    assert drafter.prefill_calls > 0 and drafter.cached[0] >= len(prompt) - 1 - drafters_base.CATCH_UP
    engine.run()
    assert engine.result(rid).token_ids == _ar(target, prompt)
