"""Prefix reuse: a prompt's stored prefix is copied into its row instead of prefilled.

- Greedy: requests that hit the store decode the same tokens as without it, alone and batched, and
  feed the target fewer prompt tokens.
- Exactness: sd at T=1 with every request hitting the store reproduces the target's joint distribution
  of two tokens (Pearson chi-square at ALPHA, as tests/test_exactness.py); negative control: a store whose
  blocks hold another prompt's keys and values is rejected.
- The store: hash-chained blocks, least recently used evicted within the byte budget, the chain's root
  outliving its branches.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import torch
import pytest

from draftwise.rules.acceptance import ExactRule
from draftwise.drafters.base import ModelRowsDrafter, NoRowsDrafter
from draftwise.engine.core import Engine
from draftwise.engine.rows import Request
from draftwise.models.runner import ModelRunner
from draftwise.engine.prefix import PrefixStore
from draftwise.engine.sampling import SamplingConfig
from test_exactness import ALPHA, exact_joint, pooled_chisquare, target_and_draft

GREEDY = SamplingConfig(0.0)


def _engine(target, draft=None, store=None, **kwargs):
    runner = ModelRunner(target, rows=0)
    vocab = target.config.vocab_size
    drafter = ModelRowsDrafter(ModelRunner(draft, rows=0), vocab) if draft is not None else \
        NoRowsDrafter(vocab, runner.device)
    return Engine(runner, drafter, ExactRule(), gamma=3, prefixes=store, **kwargs)


def _decode(engine, prompts, sampling=GREEDY, seeds=None, max_new_tokens=12):
    ids = [engine.submit(Request(tuple(p), sampling, max_new_tokens=max_new_tokens,
                                 seed=None if seeds is None else seeds[i])) for i, p in enumerate(prompts)]
    engine.run()
    return [engine.result(i) for i in ids]


SHARED = [3, 17, 42, 8, 25, 3, 17, 9, 11, 40, 2, 5, 60, 33, 21, 7, 19]  # 17 tokens: 4 blocks of 4


@pytest.mark.parametrize("with_draft", [False, True])
def test_prefix_hits_decode_the_same_tokens_and_skip_prefill(llama_pair, with_draft):
    target, draft = llama_pair
    draft = draft if with_draft else None
    store = PrefixStore(1 << 26, block=4)
    engine = _engine(target, draft, store)
    first = _decode(engine, [SHARED + [1]])[0]
    assert first.stats["cached_tokens"] == 0
    prompts = [SHARED + [4, 5], SHARED[:9] + [6], SHARED + [1], [50, 51, 52, 53, 54, 55]]
    hit = _decode(engine, prompts)
    plain = _decode(_engine(target, draft), prompts)
    assert [r.token_ids for r in hit] == [r.token_ids for r in plain]
    assert [r.stats["cached_tokens"] for r in hit] == [16, 8, 16, 0]
    assert [p.stats["target_tokens"] - h.stats["target_tokens"] for h, p in zip(hit, plain)] == [16, 8, 16, 0]
    alone = [_decode(_engine(target, draft, store), [p])[0] for p in prompts]  # a fresh engine, the same store
    assert [r.token_ids for r in alone] == [r.token_ids for r in plain]


def test_the_store_evicts_least_recently_used_and_keeps_roots(llama_pair):
    target, _ = llama_pair
    store = PrefixStore(1 << 30, block=4)
    engine = _engine(target, None, store)
    _decode(engine, [SHARED + [1]], max_new_tokens=1)
    per_block = store.bytes // len(store.blocks)
    assert len(store.blocks) == 4 and store.bytes == 4 * per_block
    store.budget_bytes = 5 * per_block
    _decode(engine, [SHARED[:8] + [60, 61, 62, 63, 1]], max_new_tokens=1)  # shares 2 blocks, adds 1
    assert len(store.blocks) == 5
    _decode(engine, [[9, 9, 9, 9, 8, 8, 8, 8, 1]], max_new_tokens=1)  # 2 new blocks: 2 old ones go
    assert len(store.blocks) == 5 and store.bytes <= store.budget_bytes
    # the evicted ones are the first prompt's leaves, not the shared root
    assert _decode(engine, [SHARED[:8] + [1]], max_new_tokens=1)[0].stats["cached_tokens"] == 8
    assert _decode(engine, [SHARED + [1]], max_new_tokens=1)[0].stats["cached_tokens"] == 8


N_RUNS = 2000


def _sampled(engine, prompt, n):
    joint = np.zeros((6, 6))
    results = _decode(engine, [prompt] * n, SamplingConfig(1.0), seeds=list(range(n)), max_new_tokens=2)
    for r in results:
        assert r.stats["cached_tokens"] == 8
        joint[tuple(r.token_ids)] += 1
    return joint


def test_sd_with_prefix_hits_samples_the_target_distribution():
    target, draft = target_and_draft(6)
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 3]  # 8 positions before the last token: two blocks of 4
    store = PrefixStore(1 << 26, block=4)
    engine = _engine(target, draft, store, max_batch_size=16)
    _decode(engine, [prompt], max_new_tokens=1)  # fills the store
    joint = _sampled(engine, prompt, N_RUNS)
    assert pooled_chisquare(joint, exact_joint(target, prompt, SamplingConfig(1.0), 2)) > ALPHA


def test_negative_control_a_store_holding_another_prompts_keys_is_caught():
    target, draft = target_and_draft(6)
    prompt, other = [1, 2, 3, 4, 5, 0, 1, 2, 3], [5, 5, 4, 4, 3, 3, 2, 2, 3]
    store = PrefixStore(1 << 26, block=4)
    engine = _engine(target, draft, store, max_batch_size=16)
    _decode(engine, [other], max_new_tokens=1)
    keys, wrong = store._keys(prompt[:-1]), list(store.blocks.values())
    store.blocks.clear()
    for key, block in zip(keys, wrong):  # the prompt's keys now name the other prompt's blocks
        store.blocks[key] = block
    joint = _sampled(engine, prompt, N_RUNS // 2)
    assert pooled_chisquare(joint, exact_joint(target, prompt, SamplingConfig(1.0), 2)) < ALPHA


# ---------------------------------------------------------------- the server

def test_server_reports_cached_tokens_and_counts_them(tmp_path):
    from conftest import save_pair
    from draftwise.heads.loading import load_draft
    from draftwise.models.loading import load_model
    from draftwise.server import ServerConfig, Service, ThreadedServer, create_app

    target_dir, draft_dir = save_pair(tmp_path)
    target = load_model(target_dir)
    service = Service(ServerConfig(model_name="tiny", method="sd"), target, load_draft(draft_dir, target))
    server = ThreadedServer(create_app(service)).start()
    try:
        prompt = " ".join(["the cat sat on the mat and the dog sat on the log"] * 4)
        answers = []
        for _ in range(2):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
            request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                answers.append(json.loads(response.read()))
        cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
        prompt_tokens = answers[0]["usage"]["prompt_tokens"]
        assert cached[0] == 0 and cached[1] == (prompt_tokens - 1) // 64 * 64 > 0
        assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert f'draftwise:prefix_cache_hits_total{{method="sd",model_name="tiny"}} {cached[1]:.1f}' in metrics
    finally:
        server.stop()


def test_an_eagle_head_drafts_from_restored_features_as_from_prefilled_ones(monkeypatch):
    import draftwise
    from test_eagle3 import _features, _head, _target

    restored = []
    original = PrefixStore.restore

    def spy(self, *args, **kwargs):
        n, features = original(self, *args, **kwargs)
        restored.append(features)
        return n, features

    monkeypatch.setattr(PrefixStore, "restore", spy)

    target = _target()
    head = _head(target, torch.arange(64), scale=1.0)
    shared = [(7 * i + 3) % 60 + 1 for i in range(70)]
    prompts = [shared + [5], shared + [9, 2], shared[:66] + [4]]
    kwargs = dict(temperature=0, max_new_tokens=16, ignore_eos=True, max_batch_size=1)
    ar = draftwise.generate(target, prompts, method="ar", **kwargs)
    plain = draftwise.generate(target, prompts, method="sd", draft=head, **kwargs)
    hit = draftwise.generate(target, prompts, method="sd", draft=head, prefix_cache_mb=16, **kwargs)
    assert [h.token_ids for h in hit] == [a.token_ids for a in ar]
    assert [h.stats["cached_tokens"] for h in hit] == [0, 64, 64]
    assert [h.stats["accepted"] for h in hit] == [p.stats["accepted"] for p in plain]
    # the restored features are the target's at those positions (a cache-free forward)
    found = [f for f in restored if f is not None]
    assert len(found) == 2
    for features in found:
        expected = _features(target, shared[:64]).float()  # fp32 sums in another order: within 1e-3 of the scale
        assert float((features.float() - expected).abs().max()) <= 1e-3 * float(expected.abs().max())


@pytest.mark.parametrize("with_draft", [False, True])
def test_the_block_a_prompts_last_token_completes_is_stored(llama_pair, with_draft):
    """Issue 39's probe: a prompt of exactly a block (or two) and then its one-token extension. The first step
    feeds the prompt's last token; its block is stored after that step, so the extension reuses the whole prompt
    (before the fix: 0 of 4 and 4 of 8 positions)."""
    target, draft = llama_pair
    draft = draft if with_draft else None
    for length in (4, 8):
        store = PrefixStore(1 << 26, block=4)
        engine = _engine(target, draft, store)
        prompt = SHARED[:length]
        assert _decode(engine, [prompt])[0].stats["cached_tokens"] == 0
        hit, plain = _decode(engine, [prompt + [1]])[0], _decode(_engine(target, draft), [prompt + [1]])[0]
        assert hit.stats["cached_tokens"] == length
        assert hit.token_ids == plain.token_ids
    # a stop string that keeps nothing of the first step's tokens leaves the cache short of the last token
    store = PrefixStore(1 << 26, block=4)
    engine = _engine(target, draft, store)
    assert _decode(engine, [SHARED[:8]], max_new_tokens=1)[0].stats["cached_tokens"] == 0
    assert _decode(engine, [SHARED[:8] + [1]])[0].stats["cached_tokens"] == 8


def test_an_eagle_heads_last_block_carries_the_last_tokens_features():
    """The block completed by the prompt's last token holds that token's features from the first step: a head
    drafting from it accepts what it accepts from a full prefill."""
    import draftwise
    from test_eagle3 import _features, _head, _target

    target = _target()
    head = _head(target, torch.arange(64), scale=1.0)
    shared = [(7 * i + 3) % 60 + 1 for i in range(64)]
    kwargs = dict(temperature=0, max_new_tokens=16, ignore_eos=True, max_batch_size=1)
    prompts = [shared, shared + [9], shared + [4, 7]]
    plain = draftwise.generate(target, prompts, method="sd", draft=head, **kwargs)
    hit = draftwise.generate(target, prompts, method="sd", draft=head, prefix_cache_mb=16, **kwargs)
    assert [h.stats["cached_tokens"] for h in hit] == [0, 64, 64]
    assert [h.token_ids for h in hit] == [p.token_ids for p in plain]
    assert [h.stats["accepted"] for h in hit] == [p.stats["accepted"] for p in plain]
    assert _features(target, shared).shape[0] == 64
