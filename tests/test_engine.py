"""The batched engine: the position-indexed cache under per-row rollback, batch invariance with
requests joining and leaving, the scheduler's bookkeeping, the row drafter against a cache-free
rollout under forced acceptance patterns, and batched exactness at mixed sampling settings."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import draftwise
from conftest import sweep, tiny_gpt2, tiny_llama, tiny_tokenizer
from draftwise.rules.acceptance import ExactRule
from draftwise.drafters.base import ModelRowsDrafter, NoRowsDrafter
from draftwise.engine.core import Engine
from draftwise.engine.rows import Request
from draftwise.errors import DraftwiseError
from draftwise.models.kvcache import PositionCache, check_supported
from draftwise.models.loading import load_model
from draftwise.models.runner import ModelRunner
from draftwise.engine.sampling import SamplingConfig, make_generator, warp

def _tiny(config_class, model_class, **extra):
    def build():
        torch.manual_seed(0)
        config = config_class(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                              initializer_range=0.5, tie_word_embeddings=False, **extra)
        return model_class(config).eval()
    return build


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _tiny(Qwen2Config, Qwen2ForCausalLM)()


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return _tiny(MistralConfig, MistralForCausalLM, sliding_window=6)()  # a window shorter than the rows


MODELS = {"llama": lambda: tiny_llama(0), "gpt2": lambda: tiny_gpt2(0), "qwen2": _qwen2, "mistral-window6": _mistral}
PROMPTS = [[3, 17, 42, 8, 25], [5, 6], [9, 10, 11, 12, 13, 14, 15, 16], [1, 2, 3], [40, 41, 7]]
GREEDY = SamplingConfig(temperature=0)


def _full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


# ---------------------------------------------------------------- the cache

@pytest.mark.parametrize("name", sorted(MODELS))
def test_random_per_row_rollbacks_then_replay_match_a_cache_free_forward(name):
    """Rows of different lengths roll back by different amounts; replaying gives cache-free logits."""
    model = MODELS[name]()
    rng = random.Random(0)
    runner = ModelRunner(model, rows=0)
    sequences = [list(p) for p in PROMPTS[:4]]
    counts = [len(s) for s in sequences]
    feed = torch.zeros(4, max(counts), dtype=torch.long)
    for b, s in enumerate(sequences):
        feed[b, : len(s)] = torch.tensor(s)
    runner.forward_rows(feed, counts)
    for _ in range(6):
        # each row appends 1-4 random tokens, then rolls back a random amount
        new = [[rng.randrange(64) for _ in range(rng.randint(1, 4))] for _ in sequences]
        width = max(len(n) for n in new)
        feed = torch.zeros(4, width, dtype=torch.long)
        for b, n in enumerate(new):
            feed[b, : len(n)] = torch.tensor(n)
        out = runner.forward_rows(feed, [len(n) for n in new])
        for b, n in enumerate(new):
            reference = _full_logits(model, sequences[b] + n)[len(sequences[b]):]
            # 5e-4: the fast forward's norms and products sum in other orders than transformers' modules, each
            # within float32 rounding, and these tiny models' weights (std 0.5) carry that to 1.2e-4 in the logits
            # (mistral); a cache that kept or lost a wrong position moves them by far more than that
            assert torch.allclose(out.logits[b, : len(n)], reference, atol=5e-4), (name, b)
            sequences[b] += n
            keep = rng.randint(1, len(sequences[b]))
            runner.trim_row(b, keep)
            del sequences[b][keep:]
        assert runner.lengths == [len(s) for s in sequences]


def test_rollback_is_a_length_write_and_growth_keeps_contents():
    model = tiny_llama(0)
    runner = ModelRunner(model)
    runner.forward_rows(torch.tensor([list(range(1, 40))]), [39])
    runner.cache._grow(4 * runner.cache.capacity)  # force growth: contents survive
    runner.trim_row(0, 10)
    assert runner.lengths[0] == 10
    logits = runner.forward_rows(torch.tensor([[5, 6]]), [2]).logits[0]
    assert torch.allclose(logits, _full_logits(model, list(range(1, 11)) + [5, 6])[-2:], atol=1e-4)
    with pytest.raises(ValueError):
        runner.trim_row(0, 50)


def test_attention_reads_only_up_to_the_longest_row():
    cache = PositionCache(rows=2, capacity=512)
    cache.lengths = [3, 7]
    positions, kv = cache.begin_forward([2, 1])
    # the longest row after the write is 8; row 1's padding slot (position 8) widens the read to 9
    assert kv == 8 and positions.tolist() == [[3, 4], [7, 8]]
    mask = cache.attention_mask(positions, torch.float32, additive=False)
    assert mask.shape == (2, 1, 2, 9)
    assert mask[0, 0, 0].tolist() == [True] * 4 + [False] * 5
    cache.abort()


def test_sliding_window_models_mixing_layer_types_are_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["sliding_attention", "full_attention"]
    config.sliding_window = 16
    with pytest.raises(DraftwiseError, match="mixes attention layer types"):
        check_supported(config)


def test_a_uniform_sliding_window_is_applied_in_the_mask():
    cache = PositionCache(rows=1, capacity=256, window=3)
    positions, _ = cache.begin_forward([6])
    mask = cache.attention_mask(positions, torch.float32, additive=False)[0, 0]
    assert mask[5].tolist() == [False, False, False, True, True, True]
    cache.abort()


# ---------------------------------------------------------------- batch invariance

def _engine(target, draft=None, *, gamma=3, max_batch_size=8):
    runner = ModelRunner(target, rows=0)
    drafter = (ModelRowsDrafter(ModelRunner(draft, rows=0), 64) if draft is not None else NoRowsDrafter(64, runner.device))
    return Engine(runner, drafter, ExactRule(), gamma=gamma, max_batch_size=max_batch_size)


def _alone(target, draft, request):
    engine = _engine(target, draft)
    rid = engine.submit(request)
    engine.run()
    return engine.result(rid).token_ids


@pytest.mark.parametrize("with_draft", [False, True])
def test_batched_requests_equal_requests_decoded_alone_with_joins_and_leaves(llama_pair, with_draft):
    """Mixed settings per row (greedy, T=1, top-k + top-p), different budgets and prompt lengths; requests
    join mid-run (submitted between steps) and leave early; every one equals its solo run."""
    target, draft = llama_pair
    draft = draft if with_draft else None
    settings = [GREEDY, SamplingConfig(1.0), SamplingConfig(0.8, top_k=10, top_p=0.9), GREEDY, SamplingConfig(1.0)]
    requests = [Request(tuple(p), s, max_new_tokens=n, seed=seed)
                for p, s, n, seed in zip(PROMPTS, settings, (12, 3, 20, 7, 15), (0, 1, 2, 3, 4))]
    engine = _engine(target, draft, max_batch_size=3)
    ids = [engine.submit(r) for r in requests[:3]]
    engine.step()
    engine.step()
    ids += [engine.submit(r) for r in requests[3:]]  # join while others decode; batch size 3 queues them
    engine.run()
    for rid, request in zip(ids, requests):
        assert engine.result(rid).token_ids == _alone(target, draft, request), request


# ---------------------------------------------------------------- the scheduler

def test_a_burst_is_prefilled_together_and_decodes_as_alone(llama_pair):
    """Requests waiting together are prefilled in one forward (not one prompt at a time), the shortest prompts
    first within the token budget; a prompt longer than its share finishes in the next forward, beside the
    rows already decoding; each request decodes token for token as it does alone."""
    from draftwise.engine import scheduler as engine_module
    target, draft = llama_pair
    prompts = [tuple(1 + i % 60 for i in range(n)) for n in (5, 40, 12, 90)]
    requests = [Request(p, GREEDY, max_new_tokens=6) for p in prompts]
    chunk, tokens = engine_module.PREFILL_CHUNK, engine_module.PREFILL_TOKENS
    engine_module.PREFILL_CHUNK, engine_module.PREFILL_TOKENS = 64, 128
    try:
        engine = _engine(target, draft, max_batch_size=8)
        ids = [engine.submit(r) for r in requests]
        # nothing decoding: one wide prefill forward (4 + 11 + 39 tokens to the short prompts, which finish, and
        # one to the long one, so the short ones start now), then the first verification
        first = engine.step()
        assert engine.target.calls == 2 and sorted(e.request_id for e in first) == [ids[0], ids[1], ids[2]]
        assert [r.fed for r in engine.prefilling] == [1]  # the long prompt goes on beside the decoding rows
        engine.run()
    finally:
        engine_module.PREFILL_CHUNK, engine_module.PREFILL_TOKENS = chunk, tokens
    for rid, request in zip(ids, requests):
        result = engine.result(rid)
        assert (result.stats["prefill_calls"] > 2) if len(request.prompt_ids) > 65 else \
            (result.stats["prefill_calls"] == 1)
        assert result.token_ids == _alone(target, draft, request)


def test_a_long_prompt_never_stalls_the_decoding_rows(llama_pair):
    """A long prompt arriving while a request decodes is fed a budget of tokens per step in the decoding rows'
    own forward: the decoding request gets tokens at every step, a short request arriving later overtakes the
    long prompt, rows finishing or cancelled meanwhile keep every row's cache in place, and every request
    decodes token for token as alone. Once idle, the cache's memory is released."""
    from draftwise.engine import scheduler as engine_module
    target, draft = llama_pair
    first = Request((3, 4, 5), GREEDY, max_new_tokens=40)
    long = Request(tuple(1 + i % 50 for i in range(300)), GREEDY, max_new_tokens=5)
    doomed = Request(tuple(2 + i % 40 for i in range(200)), GREEDY, max_new_tokens=5)
    short = Request((7, 8, 9, 10), GREEDY, max_new_tokens=3)
    budget = engine_module.PREFILL_FIRST
    engine_module.PREFILL_FIRST = 16
    try:
        engine = _engine(target, draft, max_batch_size=8)
        engine._prompt_budget = lambda: 16  # tokens per step beside decoding rows (the timed budget, pinned)
        a = engine.submit(first)
        engine.step()
        engine.step()
        b, c = engine.submit(long), engine.submit(doomed)
        for _ in range(3):
            events = engine.step()
            assert [e.request_id for e in events if e.token_ids] == [a]  # decoding goes on
        d = engine.submit(short)
        engine.step()
        assert engine.cancel(c)
        steps = 0
        while engine.result(d) is None:
            engine.step()
            steps += 1
        assert engine.result(b) is None  # the short request overtook the long prompt
        engine.run()
    finally:
        engine_module.PREFILL_FIRST = budget
    for rid, request in ((a, first), (b, long), (d, short)):
        assert engine.result(rid).token_ids == _alone(target, draft, request), request
    assert engine.result(b).stats["prefill_calls"] >= 300 // 16
    assert engine.result(c).finish_reason == "cancelled"
    assert engine.target.cache.keys == [] and engine.target.cache.num_rows == 0  # idle: memory released


def _slots(cache) -> int:
    """Positions a layer's keys buffer holds as allocated: rows x capacity, or a paged cache's pages x page."""
    return cache.keys[0].shape[0] * cache.keys[0].shape[2] if cache.keys else 0


def test_a_long_rows_memory_goes_back_when_it_ends_though_others_go_on():
    """The cache's buffers follow the longest row: when a long request ends while a short one decodes on, the
    target's and the draft model's buffers are cut to what the short row needs (the engine never goes idle), and
    both requests decode token for token as alone."""
    from draftwise.models import kvcache
    from tests.conftest import tiny_llama

    target, draft = tiny_llama(0, window=2048), tiny_llama(1, layers=1, window=2048)
    engine = _engine(target, draft, max_batch_size=4)
    engine._prompt_budget = lambda: 128  # prompt tokens per step beside the decoding row (pinned)
    short = Request((3, 4, 5), GREEDY, max_new_tokens=80)
    long = Request(tuple(1 + i % 50 for i in range(1100)), GREEDY, max_new_tokens=12)
    s = engine.submit(short)
    engine.step()
    g = engine.submit(long)
    caches = (engine.target.cache, engine.drafter.runner.cache)
    peak = [0, 0]
    while engine.result(g) is None:
        engine.step()
        peak = [max(p, _slots(c)) for p, c in zip(peak, caches)]
    assert engine.result(s) is None  # the short request decodes on
    for cache, most in zip(caches, peak):
        assert most >= 1100
        assert _slots(cache) * kvcache.SHRINK <= most  # cut
        if isinstance(cache, kvcache.PagedCache):  # the pages left are the short row's
            assert cache.pages_used == -(-cache.lengths[0] // cache.page) and cache.num_rows == 1
        else:
            assert cache.keys[0].shape[2] == cache.capacity
            assert cache.keys[0].shape[0] * kvcache.SHRINK > cache.num_rows  # rows kept for the rows held
    engine.run()
    assert engine.result(s).token_ids == _alone(target, draft, short)
    assert engine.result(g).token_ids == _alone(target, draft, long)


def test_a_batch_engine_prefills_first_and_decodes_as_alone(llama_pair):
    """`prefill_first` (generate with a list of prompts): every waiting prompt is fed each step, a chunk a row, beside
    the decoding rows and in forwards of prompts alone that are not cut short; every request still decodes token for
    token as alone."""
    from draftwise.engine import scheduler as engine_module
    target, draft = llama_pair
    engine = _engine(target, draft, max_batch_size=8)
    engine.prefill_first = True
    engine._idle_token_s = engine_module.PREFILL_FORWARD_S  # would cut a forward of prompts alone to one piece
    chunk = engine_module.PREFILL_CHUNK
    requests = [Request(tuple(1 + (i * 7 + j) % 50 for j in range(n)), GREEDY, max_new_tokens=6)
                for i, n in enumerate([1, 5, chunk + 40, 2 * chunk + 3, 30])]
    ids = [engine.submit(r) for r in requests]
    engine.step()  # nothing decodes: one forward feeds every prompt a chunk
    assert sorted(row.unfed for row in engine.prefilling) == [39, chunk + 2]
    engine.step()  # beside the decoding rows: every prompt again a chunk, not a time budget
    assert [row.unfed for row in engine.prefilling] == [2]
    engine.run()
    for rid, request in zip(ids, requests):
        assert engine.result(rid).token_ids == _alone(target, draft, request), request


def test_the_prompt_budget_feeds_a_short_prompt_at_once_and_a_long_one_within_its_share(llama_pair):
    """The budget beside decoding rows is keyed on what waits: a prompt costing at most SHORT_PROMPT_STEPS
    decoding steps is fed whole in the next step; a long prompt gets prefill_share of a decoding step per step,
    and more when more long prompts wait than rows decode (timings pinned: a step 1.0 s, a prompt token 0.1 s)."""
    from types import SimpleNamespace

    from draftwise.engine import scheduler as engine_module
    target, draft = llama_pair
    engine = _engine(target, draft, max_batch_size=8)
    engine._decode_s, engine._prompt_token_s = 1.0, 0.1
    ending = SimpleNamespace(unfed=0, budget=4, token_ids=[1] * 60, counters=SimpleNamespace(steps=60))
    engine.live = [ending]  # a row about to end: the allowance is SHORT_PROMPT_STEPS

    def budgets(steps: int) -> list[int]:
        out = []
        for _ in range(steps):
            n = engine._prompt_budget()
            if engine._steps % engine_module.DECODE_SAMPLE:  # the timing steps feed nothing by design
                out.append(n)
        return out

    engine.prefilling = [SimpleNamespace(unfed=5000)]
    alone = budgets(40)
    per_step = engine.prefill_share * 1.0 / 0.1  # tokens of credit a step earns
    piece = engine_module.LONG_PIECE
    assert abs(sum(alone) - per_step * len(alone)) <= per_step + piece  # the long prompt's share, no more
    assert all(n == 0 or piece <= n <= piece + per_step + 1 for n in alone)  # spent in pieces
    short_tokens = int(engine_module.SHORT_PROMPT_STEPS * 1.0 / 0.1)  # the most a short prompt may hold
    engine.prefilling = [SimpleNamespace(unfed=short_tokens), SimpleNamespace(unfed=5000)]
    while engine._steps % engine_module.DECODE_SAMPLE == engine_module.DECODE_SAMPLE - 1:
        engine._steps += 1
    assert engine._prompt_budget() >= short_tokens + 1  # the short prompt whole, the long one at least a token
    engine.prefilling = [SimpleNamespace(unfed=short_tokens + 1), SimpleNamespace(unfed=5000)]  # both long
    engine._credit = 0.0
    both = budgets(40)
    assert abs(sum(both) - 2 * per_step * len(both)) <= 2 * (per_step + piece)  # two wait, one decodes: twice


def test_the_prompt_budget_lets_rows_with_long_to_go_afford_a_wave_of_prompts(llama_pair):
    """Rows with long to go afford SHORT_SHARE of their remaining steps (each counted up to SHORT_HORIZON, at its
    own tokens a step) for prompts fed at once, fewest unfed first while they fit; a prompt costing more is long
    and gets the credit; rows about to end keep the SHORT_PROMPT_STEPS allowance (timings pinned: a step 1.0 s,
    a prompt token such that the allowance buys one prefill chunk)."""
    from types import SimpleNamespace

    from draftwise.engine import scheduler as engine_module
    target, draft = llama_pair
    engine = _engine(target, draft, max_batch_size=8)
    allowance = engine_module.SHORT_SHARE * engine_module.SHORT_HORIZON  # decoding steps
    token_s = allowance / engine_module.PREFILL_CHUNK  # the allowance buys one chunk's tokens
    engine._decode_s, engine._prompt_token_s = 1.0, token_s

    def row(budget: int, made: int, steps: int) -> SimpleNamespace:
        return SimpleNamespace(unfed=0, budget=budget, token_ids=[1] * made, counters=SimpleNamespace(steps=steps))

    def first_budget() -> int:
        engine._credit = 0.0
        while (engine._steps + 1) % engine_module.DECODE_SAMPLE == 0:
            engine._steps += 1
        return engine._prompt_budget()

    fresh = row(1000, 0, 0)  # counted up to the horizon
    engine.live = [fresh, fresh]
    assert engine._short_allowance() == allowance * 1.0
    fits = round(allowance / token_s)  # prompt tokens the allowance buys
    assert fits > engine_module.SHORT_PROMPT_STEPS / token_s  # more than a row about to end allows
    chunk = engine_module.PREFILL_CHUNK
    engine.prefilling = [SimpleNamespace(unfed=min(fits, chunk))]
    assert first_budget() == min(fits, chunk)  # fed whole at once
    half = fits // 2 + 1  # two of these do not fit together: the fewer-token one goes now, the other waits
    engine.prefilling = [SimpleNamespace(unfed=half + 1), SimpleNamespace(unfed=half)]
    assert first_budget() == min(half, chunk)
    engine.prefilling = [SimpleNamespace(unfed=fits + 1)]  # long: only the credit, nothing at once
    assert first_budget() == 0
    # at three tokens a step, a row's remaining steps are a third of its remaining tokens
    engine.live = [row(60, 90, 30)]
    assert abs(engine._short_allowance() - max(engine_module.SHORT_PROMPT_STEPS,
                                               engine_module.SHORT_SHARE * 20)) < 1e-9
    engine.live = [row(2, 90, 90)]  # about to end: the floor
    assert engine._short_allowance() == engine_module.SHORT_PROMPT_STEPS


def test_a_forward_of_prompts_alone_is_cut_to_its_time_bound(llama_pair):
    """With nothing decoding, a long prompt is fed in chunks that last about PREFILL_FORWARD_S at the measured cost
    of a prompt token (a request arriving meanwhile waits no longer), never below LONG_PIECE tokens, while a short
    prompt arriving beside it finishes in one forward; both decode as alone."""
    from draftwise.engine import scheduler as engine_module
    target, draft = llama_pair
    engine = _engine(target, draft, max_batch_size=4)
    request = Request(tuple(1 + i % 50 for i in range(engine_module.PREFILL_CHUNK + 100)), GREEDY, max_new_tokens=4)
    rid = engine.submit(request)
    engine._idle_token_s = engine_module.PREFILL_FORWARD_S / 10  # pinned: 10 tokens fill a forward's time
    engine.step()
    assert [row.fed for row in engine.prefilling] == [10]
    engine._idle_token_s = engine_module.PREFILL_FORWARD_S  # one token would fill it: a piece still goes
    engine.step()
    assert [row.fed for row in engine.prefilling] == [10 + engine_module.LONG_PIECE]
    short = Request((7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18), GREEDY, max_new_tokens=3)
    sid = engine.submit(short)
    engine._idle_token_s = engine_module.PREFILL_FORWARD_S  # the short prompt still finishes in one forward
    engine.step()
    assert engine.result(sid) is not None or any(row.id == sid for row in engine.live)
    engine.run()
    assert engine.result(rid).token_ids == _alone(target, draft, request)
    assert engine.result(sid).token_ids == _alone(target, draft, short)


def test_scheduler_frees_rows_cancels_cleanly_and_counts_per_request(llama_pair):
    target, draft = llama_pair
    engine = _engine(target, draft, max_batch_size=2)
    short = engine.submit(Request((1, 2, 3), GREEDY, max_new_tokens=2))
    long = engine.submit(Request((4, 5, 6, 7), GREEDY, max_new_tokens=30))
    waiting = engine.submit(Request((8, 9), GREEDY, max_new_tokens=10))
    engine.step()
    assert len(engine.live) == 2 and len(engine.waiting) == 1
    while engine.result(short) is None:
        engine.step()
    engine.step()  # the freed row goes to the waiting request
    assert {r.id for r in engine.live} == {long, waiting}
    assert engine.cancel(long)
    assert [r.id for r in engine.live] == [waiting]
    engine.run()
    assert engine.result(long).finish_reason == "cancelled"
    assert engine.result(waiting).token_ids == _alone(target, draft, Request((8, 9), GREEDY, max_new_tokens=10))
    for rid in (short, waiting):
        stats = engine.result(rid).stats
        assert stats["new_tokens"] == stats["accepted"] + stats["steps"]  # one recovered/bonus token per step
        assert stats["accepted"] <= stats["drafted"]
        assert 1 <= stats["draft_calls"] <= engine.drafter.calls  # drafting forwards the request took part in
    assert not engine.cancel(short)  # finished: nothing to cancel


def test_counters_never_count_accepted_tokens_past_eos():
    """EOS at draft position 0: the step commits 1 token and records at most 0 accepted past it."""
    target = tiny_llama(0, eos=7)
    runner = ModelRunner(target, rows=0)

    class EosDrafter(NoRowsDrafter):
        def propose(self, rows, limits):
            from draftwise.engine.protocols import RowsDraft

            tokens = torch.tensor([[7, 7, 7]] * len(rows))
            probs = torch.zeros(len(rows), 3, 64).scatter_(-1, tokens[..., None], 1.0)
            return RowsDraft(tokens, probs, [3] * len(rows))

    from draftwise.rules.acceptance import Rule

    class AcceptAll(Rule):
        def __call__(self, step):
            return step.draft_probs

    engine = Engine(runner, EosDrafter(64, runner.device), AcceptAll(), gamma=3)
    rid = engine.submit(Request((1, 2), GREEDY, max_new_tokens=10, eos_token_ids=frozenset({7})))
    engine.run()
    result = engine.result(rid)
    assert result.token_ids == [7] and result.finish_reason == "eos"
    assert result.stats["accepted"] <= result.stats["new_tokens"]


# ---------------------------------------------------------------- the row drafter, checked directly

def test_row_drafter_equals_a_cache_free_rollout_under_forced_acceptance(llama_pair):
    """Random accepted counts per row each round: every proposal equals a greedy cache-free rollout
    of the draft model from that row's current sequence."""
    _, draft = llama_pair
    rng = random.Random(1)
    drafter = ModelRowsDrafter(ModelRunner(draft, rows=0), 64)

    class Row:
        def __init__(self, sequence):
            self.sequence = sequence
            self.request = Request(tuple(sequence), GREEDY)
            self.generator = make_generator(0)

    rows = [Row(list(p)) for p in PROMPTS[:3]]
    for b, row in enumerate(rows):
        drafter.admit(b, row.sequence)
    for _ in range(8):
        limits = [rng.randint(0, 4) for _ in rows]
        proposal = drafter.propose(rows, limits)
        for b, row in enumerate(rows):
            expected, seq = [], list(row.sequence)
            for _ in range(limits[b]):
                token = int(_full_logits(draft, seq)[-1].argmax())
                expected.append(token)
                seq.append(token)
            assert proposal.tokens[b, : proposal.counts[b]].tolist() == expected
            # force a random acceptance: keep a prefix, then a random "recovered" token
            keep = rng.randint(0, proposal.counts[b])
            row.sequence += proposal.tokens[b, :keep].tolist() + [rng.randrange(64)]
            drafter.rewind(b, len(row.sequence) - 1)


# ---------------------------------------------------------------- batched exactness

N = 3000
ALPHA = 1e-3


def _joint(target, sampling, prompt, length=2):
    """Exact distribution of the first `length` tokens under the warped target, enumerated."""
    vocab = 64
    out = np.zeros([vocab] * length)
    first = warp(_full_logits(target, prompt)[-1], sampling)
    for a in range(vocab):
        if first[a] == 0:
            continue
        second = warp(_full_logits(target, prompt + [a])[-1], sampling)
        out[a] = first[a].item() * second.numpy()
    return out


@pytest.mark.parametrize("method", sweep(["sd", "prompt-lookup", "eagle"], {0}))
def test_batched_rows_follow_the_target_distribution_at_mixed_settings(method):
    """Batch of 4 rows with different prompt lengths and settings (T=1, top-k + top-p, greedy, T=0.7):
    the first two tokens of each row follow the exact warped target joint (chi-square at 1e-3)."""
    for b, p_value in enumerate(_batched_p_values(method, N)):
        assert p_value > ALPHA, (method, b, p_value)


def test_control_batched_residual_bug_is_rejected(monkeypatch):
    """Recovering from pi instead of max(0, pi - draft) in the batched sampler fails the same test."""
    import draftwise.engine.sampler as batched

    monkeypatch.setattr(batched, "residual_rows", lambda pi, draft_probs: pi)
    assert min(_batched_p_values("sd", N, coupling="rejection")) < ALPHA  # the residual is rejection sampling's


def _batched_p_values(method: str, n: int, coupling: str = "gumbel") -> list[float]:
    target = tiny_llama(0, init=0.05, vocab=64)
    draft = tiny_llama(1, layers=1, init=0.05, vocab=64)
    t = load_model(target)
    kwargs = {"draft": load_model(draft)} if method == "sd" else {}
    settings = [SamplingConfig(1.0), SamplingConfig(1.0, top_k=8, top_p=0.8), GREEDY, SamplingConfig(0.7, top_k=5)]
    prompts = [[3, 17, 42, 8, 25], [5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [1, 2, 3]]
    runner = ModelRunner(t.model, vocab_size=64, rows=0)
    if method == "sd":
        drafter = ModelRowsDrafter(ModelRunner(kwargs["draft"].model, vocab_size=64, rows=0), 64)
    elif method == "eagle":
        from draftwise.heads.eagle import EagleConfig, EagleHead
        from draftwise.drafters.eagle import EagleRowsDrafter

        torch.manual_seed(7)
        head = EagleHead(EagleConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                     target_vocab_size=64), torch.arange(0, 64, 2))  # half the vocabulary
        with torch.no_grad():
            for p in head.parameters():
                p.mul_(3.0)
        head.attach(t.model)
        drafter = EagleRowsDrafter(head, 64, runner.device)
    else:
        from draftwise.drafters.base import LookupRowsDrafter
        drafter = LookupRowsDrafter(64, runner.device, max_ngram=3, min_ngram=1)
    engine = Engine(runner, drafter, ExactRule(coupling=coupling), gamma=2, max_batch_size=4)
    counts = [np.zeros((64, 64)) for _ in prompts]
    ids = []
    for i in range(n):
        for b, (p, s) in enumerate(zip(prompts, settings)):
            ids.append((b, engine.submit(Request(tuple(p), s, max_new_tokens=2, seed=i * 4 + b))))
    engine.run()
    drafted = 0
    for b, rid in ids:
        result = engine.result(rid)
        counts[b][tuple(result.token_ids)] += 1
        drafted += result.stats["drafted"]
    assert drafted > 0
    p_values = []
    for b, (p, s) in enumerate(zip(prompts, settings)):
        expected = _joint(target, s, p)
        if counts[b][expected == 0].sum():
            p_values.append(0.0)  # a token outside the warped support
            continue
        support = expected > 1e-12
        if support.sum() == 1:
            p_values.append(1.0 if counts[b][support].sum() == n else 0.0)
            continue
        e = expected[support] * n
        o = counts[b][support]
        # pool rare cells so every expected count is >= 5
        order = np.argsort(e)
        e, o = e[order], o[order]
        small = np.cumsum(e) < 5 * 4
        e = np.concatenate([[e[small].sum()], e[~small]]) if small.any() else e
        o = np.concatenate([[o[small].sum()], o[~small]]) if small.any() else o
        p_values.append(float(chisquare(o, e * o.sum() / e.sum()).pvalue))
    return p_values


def test_batched_generate_api_returns_one_generation_per_prompt(llama_pair):
    target, draft = llama_pair
    tok = tiny_tokenizer(64)
    t = load_model(target, tokenizer=tok)
    out = draftwise.generate(t, ["the cat", "a small draft"], method="ar", temperature=0, max_new_tokens=5,
                             ignore_eos=True, max_batch_size=2)
    assert isinstance(out, list) and len(out) == 2
    for text, g in zip(["the cat", "a small draft"], out):
        assert g.token_ids == draftwise.generate(t, text, method="ar", temperature=0, max_new_tokens=5,
                                                 ignore_eos=True).token_ids
    with pytest.raises(DraftwiseError, match="max_batch_size"):
        draftwise.generate(t, ["a", "b"], method="ar", max_batch_size=0)
    batched = draftwise.generate(t, ["the cat", "a small draft"], method="mtjd", temperature=0, max_new_tokens=5,
                                 ignore_eos=True, max_batch_size=2)  # every method batches, mtjd too
    assert [g.token_ids for g in batched] == [
        draftwise.generate(t, text, method="mtjd", temperature=0, max_new_tokens=5, ignore_eos=True).token_ids
        for text in ["the cat", "a small draft"]]


def test_eagle_row_drafter_equals_a_cache_free_rollout_under_forced_acceptance():
    """The EAGLE row drafter over 3 rows, random accepted counts each round: every proposal equals a
    cache-free rollout of the head (true target features, then its own predicted ones)."""
    from draftwise.heads.eagle import EagleConfig, EagleHead
    from draftwise.drafters.eagle import EagleRowsDrafter

    target = tiny_llama(0, width=16, vocab=64)
    torch.manual_seed(3)
    head = EagleHead(EagleConfig(hidden_size=16, num_heads=4, num_kv_heads=2, intermediate_size=32,
                                 target_vocab_size=64), torch.arange(0, 64, 2))  # a reduced draft vocabulary
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)
    head.attach(target)
    drafter = EagleRowsDrafter(head, 64, torch.device("cpu"))

    def features(seq):
        with torch.no_grad():
            return target(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]

    def rollout(seq, limit):
        feats = list(features(seq)[: len(seq) - 1])
        nexts = list(seq[1:])
        out = []
        for _ in range(limit):
            with torch.no_grad():
                predicted = head(torch.stack(feats)[None], torch.tensor([nexts]))[0, -1]
                token = int(head.vocab_ids[head.logits(predicted).argmax()])
            out.append(token)
            feats.append(predicted)
            nexts.append(token)
        return out

    class Row:
        def __init__(self, sequence):
            self.sequence = sequence
            self.request = Request(tuple(sequence), GREEDY)
            self.generator = make_generator(0)

    rng = random.Random(2)
    rows = [Row(list(p)) for p in PROMPTS[:3]]
    for b, row in enumerate(rows):
        drafter.admit(b, row.sequence)
        drafter.observe(b, 0, features(row.sequence)[: len(row.sequence) - 1])
    for _ in range(6):
        limits = [rng.randint(1, 4) for _ in rows]
        proposal = drafter.propose(rows, limits)
        for b, row in enumerate(rows):
            drafted = proposal.tokens[b, : proposal.counts[b]].tolist()
            assert drafted == rollout(row.sequence, limits[b]), b
            # the verify forward's features for the pending token and the drafts, then a forced outcome
            fed = row.sequence + drafted
            drafter.observe(b, len(row.sequence) - 1, features(fed)[len(row.sequence) - 1 :])
            keep = rng.randint(0, len(drafted))
            row.sequence += drafted[:keep] + [rng.randrange(64)]
            drafter.rewind(b, len(row.sequence) - 1)


def test_a_kv_budget_limits_the_live_rows_without_changing_outputs(llama_pair):
    from draftwise.models.runner import kv_bytes_per_token

    target, _ = llama_pair
    t = load_model(target)
    prompts = [p for p in PROMPTS]
    free = draftwise.generate(t, prompts, method="ar", temperature=0, max_new_tokens=6, ignore_eos=True)
    per_token = kv_bytes_per_token(target)
    assert per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads of 16, fp32
    budget_mb = 20 * per_token / 2**20  # room for about one request of 5-8 + 6 tokens at a time
    tight = draftwise.generate(t, prompts, method="ar", temperature=0, max_new_tokens=6, ignore_eos=True,
                               kv_budget_mb=budget_mb)
    assert [g.token_ids for g in tight] == [g.token_ids for g in free]
    with pytest.raises(DraftwiseError, match="kv_budget_mb"):
        draftwise.generate(t, prompts, method="ar", kv_budget_mb=0)


def test_the_kv_budget_admits_only_what_fits(llama_pair):
    target, _ = llama_pair
    engine = _engine(target)
    engine.kv_budget_tokens = 25
    for p in PROMPTS[:3]:  # needs 5+10, 2+10, 8+10 tokens
        engine.submit(Request(tuple(p), GREEDY, max_new_tokens=10))
    engine.step()
    assert len(engine.live) == 1 and len(engine.waiting) == 2  # 15 + 12 > 25
    engine.run()
    assert len(engine.results()) == 3


def test_rows_near_the_window_never_feed_positions_past_it():
    """GPT-2's learned positions: a request cut by the window beside a short one (padding and a
    stopped draft row would reach past position 31) decodes as it does alone."""
    from conftest import tiny_gpt2

    target, draft = load_model(tiny_gpt2(0, window=32)), load_model(tiny_gpt2(1, window=32))
    long = list(range(1, 30))
    with pytest.warns(draftwise.errors.DraftwiseWarning):
        alone = draftwise.generate(target, long, draft=draft, method="sd", temperature=0, max_new_tokens=20,
                                   ignore_eos=True).token_ids
    both = draftwise.generate(target, [long, [5, 6]], draft=draft, method="sd", temperature=0, max_new_tokens=20,
                              ignore_eos=True)
    assert both[0].token_ids == alone and len(both[1].token_ids) == 20


def test_a_stop_string_cut_records_no_accepted_token_past_it(llama_pair):
    target, _ = llama_pair
    tok = tiny_tokenizer(64)
    t, d = load_model(target, tokenizer=tok), load_model(target, tokenizer=tok)  # draft == target: all accepted
    free = draftwise.generate(t, "the cat", draft=d, method="sd", temperature=0, max_new_tokens=12, ignore_eos=True)
    stop = next(c for c in free.text if c != "\ufffd")  # reached within the first step's 5 tokens
    cut = draftwise.generate(t, "the cat", draft=d, method="sd", temperature=0, max_new_tokens=12, ignore_eos=True,
                             stop=[stop])
    assert cut.stats["finish_reason"] == "stop" and cut.stats["steps"] == 1
    assert cut.stats["new_tokens"] < 5 and cut.stats["accepted"] <= cut.stats["new_tokens"]


def test_prompt_lookup_rows_stop_drafting_at_eos():
    from draftwise.drafters.base import LookupRowsDrafter

    class Row:
        sequence = [1, 2, 7, 3, 4, 5, 1, 2]

    drafter = LookupRowsDrafter(64, torch.device("cpu"), max_ngram=3, min_ngram=1, eos_token_ids=frozenset({7}))
    proposal = drafter.propose([Row()], [4])
    assert proposal.tokens[0, : proposal.counts[0]].tolist() == [7]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "buffers"])
def test_the_kv_budget_counts_the_buffers_as_allocated(llama_pair, monkeypatch, paged):
    """Buffers: every row holds the first 256-position block, so a budget of two blocks admits two rows. Pages: each
    short request needs one 64-position page, and the pool starts at 4 pages (256 slots): a budget of 256 slots
    admits four, and a fifth would double the pool past it."""
    from draftwise.models import kvcache

    monkeypatch.setenv("DRAFTWISE_PAGED", "1" if paged else "0")
    target, _ = llama_pair
    engine = _engine(target)
    assert isinstance(engine.target.cache, kvcache.PagedCache) == paged
    budget, admitted = (256, 4) if paged else (2 * 256, 2)
    engine.kv_budget_tokens = budget
    for p in PROMPTS:
        engine.submit(Request(tuple(p), GREEDY, max_new_tokens=10))
    engine.step()
    assert len(engine.live) == admitted
    cache = engine.target.cache
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, _slots(cache))
    assert 0 < most <= budget and len(engine.results()) == len(PROMPTS)


def test_batched_requests_cut_by_the_window_finish_with_context():
    target = load_model(tiny_llama(0, window=16))
    with pytest.warns(draftwise.errors.DraftwiseWarning):
        out = draftwise.generate(target, [[1, 2], list(range(1, 14))], method="ar", temperature=0,
                                 max_new_tokens=10, ignore_eos=True)
    assert [g.stats["finish_reason"] for g in out] == ["length", "context"]
    assert len(out[1].token_ids) == 3


def test_release_heap_never_forks(monkeypatch):
    """Issue 39's probe: every idle engine looked libc up with ctypes.util.find_library, which runs `ldconfig -p` in
    a subprocess (a fork of a multi-GB server). Now it is looked up once, in the process's own symbols."""
    import ctypes.util
    import subprocess

    from draftwise.models import kvcache

    def refuse(*args, **kwargs):
        raise AssertionError("release_heap started a subprocess")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(ctypes.util, "find_library", refuse)
    kvcache._malloc_trim.cache_clear()
    for _ in range(3):
        kvcache.release_heap()
    assert kvcache._malloc_trim() is not None  # glibc: the trim is found and runs


class _RepeatDrafter(NoRowsDrafter):
    """A drafter kind added the way a contributor would: it drafts each row's last token `limit` times."""

    def propose(self, rows, limits):
        from draftwise.engine.protocols import one_hot_draft

        return one_hot_draft([[r.sequence[-1]] * limit for r, limit in zip(rows, limits)], self.vocab_size,
                             self.device)


def _build_repeat(plan, rule):
    return _RepeatDrafter(plan.vocab_size, plan.target.device)


def test_a_new_drafter_kind_is_its_module_and_one_entry(llama_pair, monkeypatch):
    """A drafter kind needs its class and builder (here, this module) and its entries in methods.py, nothing in the
    builder or the engine; it then runs exactly (greedy: ar's tokens) and its drafts are verified."""
    from draftwise.methods import DRAFTERS, METHODS, DrafterKind, Method

    monkeypatch.setitem(DRAFTERS, "repeat", DrafterKind("repeat", "no draft model",
                                                        builder=f"{__name__}:_build_repeat"))
    monkeypatch.setitem(METHODS, "repeat", Method("repeat", "repeats the last token", drafter="repeat",
                                                  make_rule=lambda options: ExactRule()))
    target, _ = llama_pair
    t = load_model(target, tokenizer=tiny_tokenizer(64))
    prompts = ["the cat sat on", "a a a a"]
    kwargs = dict(temperature=0, max_new_tokens=12, ignore_eos=True, max_batch_size=2)
    ours = draftwise.generate(t, prompts, method="repeat", gamma=3, **kwargs)
    ar = draftwise.generate(t, prompts, method="ar", **kwargs)
    assert [g.token_ids for g in ours] == [g.token_ids for g in ar]
    assert sum(g.stats["drafted"] for g in ours) > 0
