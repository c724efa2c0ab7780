"""The suffix drafter: its tries against brute-force matching, the global store's eviction, and exact decoding."""

from __future__ import annotations

import random

import pytest
import torch

import draftwise
from conftest import tiny_llama
from draftwise.errors import DraftwiseError
from draftwise.drafters.suffix import GlobalSuffix, RequestSuffix, SuffixTrie


def _occurrences(seq, pattern):
    n = len(pattern)
    return [i for i in range(len(seq) - n + 1) if list(seq[i : i + n]) == list(pattern)]


def _brute_count(seqs, pattern):
    return sum(len(_occurrences(s, pattern)) for s in seqs)


def _all_nodes(trie, node=SuffixTrie.root, prefix=()):
    """(path, count) of every node below `node`."""
    for token, child in trie.children[node].items():
        yield prefix + (token,), trie.counts[child]
        yield from _all_nodes(trie, child, prefix + (token,))


@pytest.mark.parametrize("seed", range(4))
def test_trie_counts_equal_brute_force_substring_counts(seed):
    rng = random.Random(seed)
    seqs = [[rng.randrange(4) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    trie = SuffixTrie(depth=5)
    for s in seqs:
        trie.add(s)
    nodes = dict(_all_nodes(trie))
    for path, count in nodes.items():
        assert len(path) <= 5
        assert count == _brute_count(seqs, path) > 0
    # every substring up to depth is in the trie
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + 5) + 1):
                assert tuple(s[i:j]) in nodes


@pytest.mark.parametrize("seed", range(4))
def test_incremental_request_trie_equals_one_built_at_once(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(5) for _ in range(60)]
    state = RequestSuffix(depth=6)
    state.extend(seq[:7])
    for i in range(7, 60, 5):
        state.extend(seq[i : i + 5])
    batch = SuffixTrie(depth=6)
    batch.add(seq)
    assert dict(_all_nodes(state.trie)) == dict(_all_nodes(batch))


@pytest.mark.parametrize("seed", range(6))
def test_speculation_follows_the_longest_matched_suffix_and_its_most_frequent_continuations(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(3) for _ in range(80)]
    depth = 8
    trie = SuffixTrie(depth)
    trie.add(seq)
    context = seq
    tokens, score, length = trie.speculate(context, 6, factor=10.0, min_prob=0.0)
    # brute force: the longest suffix (< depth) that occurs earlier followed by a token
    expected_len = 0
    for n in range(min(depth - 1, len(context)), 0, -1):
        occ = [i for i in _occurrences(seq, context[-n:]) if i + n < len(seq)]
        if occ:
            expected_len = n
            break
    assert length == expected_len
    # brute-force greedy continuation: the most frequent next token after the pattern (ties: the smallest id),
    # with the pattern growing by the chosen token, while it stays within the trie's depth
    pattern = list(context[-expected_len:])
    expected, running, expected_score = [], 1.0, 0.0
    while len(expected) < 6 and len(pattern) < depth:
        nexts = [seq[i + len(pattern)] for i in _occurrences(seq, pattern) if i + len(pattern) < len(seq)]
        if not nexts:
            break
        best = min(set(nexts), key=lambda t: (-nexts.count(t), t))
        running *= nexts.count(best) / len(nexts)
        expected.append(best)
        expected_score += running
        pattern.append(best)
    assert tokens == expected
    assert score == pytest.approx(expected_score)


def _walk(trie, pattern):
    node = trie.root
    for token in pattern:
        node = trie.children[node].get(token)
        if node is None:
            return None
    return node


@pytest.mark.parametrize("seed", range(4))
def test_matched_suffixes_kept_from_step_to_step_equal_a_fresh_walk(seed):
    """A request's matched suffix nodes in its own trie and in the shared one, extended as tokens commit, are the
    nodes a walk from the root finds for each suffix, also after the shared trie gains and loses sequences."""
    rng = random.Random(seed)
    depth = 6
    store = GlobalSuffix(depth, max_tokens=40)
    state = RequestSuffix(depth, store.trie)
    sequence = [rng.randrange(4) for _ in range(9)]
    state.extend(sequence)
    checked_shared = 0
    for step in range(60):
        if step % 7 == 3:  # another request leaves: the shared trie changes (and evicts once it holds 40 tokens)
            store.add([rng.randrange(4) for _ in range(rng.randint(3, 12))])
        new = [rng.randrange(4) for _ in range(rng.randint(0, 3))]
        sequence += new
        state.extend(new)
        (own, own_nodes), (shared, shared_nodes) = state.matches()
        assert shared is store.trie
        for trie, nodes, longest in ((own, own_nodes, depth), (shared, shared_nodes, depth - 1)):
            expected = []
            for length in range(1, min(longest, len(sequence)) + 1):
                node = _walk(trie, sequence[-length:])
                if node is None:
                    break
                expected.append(node)
            assert nodes == expected
            assert all(_walk(trie, sequence[-n:]) is None for n in range(len(expected) + 1, longest + 1))
        checked_shared += len(shared_nodes)
        # the speculation from the kept nodes is the one from the context
        for trie, nodes in state.matches():
            assert trie.speculate_from(nodes, 4, factor=2.0, min_prob=0.0) == trie.speculate(sequence, 4, factor=2.0,
                                                                                             min_prob=0.0)
    assert checked_shared > 0


def test_tries_make_nothing_the_cycle_collector_tracks():
    """A trie's nodes are integers in int-to-int dictionaries, which CPython's cycle collector does not track: adding
    tens of thousands of nodes triggers no collection passes (node objects made the collector walk all of them)."""
    import gc

    rng = random.Random(0)
    trie = SuffixTrie(24)
    state = RequestSuffix(24, trie)
    tokens = [rng.randrange(50_000) for _ in range(600)]
    trie.add(tokens)
    state.extend(tokens)
    assert trie.size > 10_000 and state.trie.size > 10_000
    for one in (trie, state.trie):
        assert not any(gc.is_tracked(kids) for kids in one.children)
    gc.collect()
    before = len(gc.get_objects())
    trie.add(tokens[::-1])
    state.extend(tokens[:300])
    assert len(gc.get_objects()) - before < 50  # a few lists grow; no object per node


def test_adaptive_length_and_min_prob_cut_the_speculation():
    trie = SuffixTrie(16)
    trie.add([1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    tokens, _, length = trie.speculate([9, 1, 2], 10, factor=1.0, min_prob=0.0)
    assert length == 2 and tokens == [3, 4]  # at most factor x matched length
    trie.add([1, 2, 9])
    trie.add([1, 2, 8])
    tokens, _, _ = trie.speculate([1, 2], 10, factor=4.0, min_prob=0.5)
    assert tokens == []  # 3, 9 and 8 follow (1, 2) once each: 1/3 < 0.5


def test_global_store_evicts_oldest_and_leaves_no_empty_nodes():
    store = GlobalSuffix(depth=4, max_tokens=10)
    store.add([1, 2, 3, 4])
    store.add([5, 6, 7])
    store.add([1, 2, 9, 9, 9])  # 12 tokens: the first sequence goes
    assert [list(s) for s in store.held] == [[5, 6, 7], [1, 2, 9, 9, 9]]
    fresh = SuffixTrie(4)
    fresh.add([5, 6, 7])
    fresh.add([1, 2, 9, 9, 9])
    assert dict(_all_nodes(store.trie)) == dict(_all_nodes(fresh))
    assert store.trie.size == fresh.size  # the evicted nodes were freed (and are reused)
    made = len(store.trie.counts)
    store.add([5, 6, 7, 1])  # evicts [5, 6, 7]: new nodes reuse freed ones
    assert len(store.trie.counts) == made
    with pytest.raises(DraftwiseError, match="never added"):
        store.trie.add([4, 4, 4], sign=-1)


REPEATING = [3, 9, 4, 3, 9, 4, 3, 9, 4, 11, 12, 3, 9]


@pytest.mark.parametrize("method", ["suffix", "prompt-lookup"])
def test_suffix_sd_equals_ar_token_for_token_at_t0(method):
    target = tiny_llama(0)
    prompts = [REPEATING, [1, 2, 3, 1, 2, 3, 1, 2], [5]]
    ar = draftwise.generate(target, prompts, method="ar", temperature=0, max_new_tokens=30, ignore_eos=True,
                            max_batch_size=3)
    out = draftwise.generate(target, prompts, method=method, temperature=0, max_new_tokens=30, ignore_eos=True,
                             max_batch_size=3)
    for a, s in zip(ar, out):
        assert s.token_ids == a.token_ids
    assert sum(s.stats["drafted"] for s in out) > 0


def test_hybrid_with_an_eagle3_head_equals_ar_at_t0_and_uses_both_drafters():
    from draftwise.rules.acceptance import ExactRule
    from draftwise.heads.eagle3 import Eagle3Head
    from draftwise.drafters.eagle import EagleRowsDrafter
    from draftwise.drafters.base import NoRowsDrafter
    from draftwise.engine.core import Engine
    from draftwise.engine.rows import Request
    from draftwise.models.runner import ModelRunner
    from draftwise.engine.sampling import SamplingConfig
    from draftwise.drafters.suffix import HybridRowsDrafter, SuffixRowsDrafter

    target = tiny_llama(0, layers=4, width=32)
    torch.manual_seed(3)
    head = Eagle3Head.new(target, vocab_ids=torch.arange(64), intermediate_size=48, feature_layers=(0, 2, 3)).eval()
    prompts = [REPEATING, [1, 2, 3, 1, 2, 3, 1, 2], [5, 7]]

    def run(drafter):
        engine = Engine(ModelRunner(target, vocab_size=64, rows=0), drafter, ExactRule(), gamma=4, max_batch_size=3)
        ids = [engine.submit(Request(tuple(p), SamplingConfig(temperature=0.0), max_new_tokens=30)) for p in prompts]
        engine.run()
        return [engine.result(i).token_ids for i in ids]

    device = torch.device("cpu")
    expected = run(NoRowsDrafter(64, device))
    hybrid = HybridRowsDrafter(EagleRowsDrafter(head, 64, device), SuffixRowsDrafter(64, device), threshold=0.8)
    assert run(hybrid) == expected
    assert hybrid.used_suffix > 0 and hybrid.used_head > 0


def test_suffix_options_are_checked():
    target = tiny_llama(0)
    for bad, match in (({"depth": 1}, "depth"), ({"factor": 0.0}, "factor"), ({"min_prob": 1.0}, "min_prob"),
                       ({"global_tokens": -1}, "global_tokens"), ({"min_match": 0}, "min_match")):
        with pytest.raises(DraftwiseError, match=match):
            draftwise.generate(target, [1, 2, 3], method="suffix", max_new_tokens=2, **bad)
    with pytest.raises(DraftwiseError, match="threshold"):
        draftwise.generate(target, [1, 2, 3], method="hybrid", draft=tiny_llama(1, layers=1), max_new_tokens=2,
                           threshold=-1.0)


def test_hybrid_equals_ar_at_t0_with_a_draft_model():
    target = tiny_llama(0)
    draft = tiny_llama(1, layers=1)
    prompts = [REPEATING, [1, 2, 3, 1, 2, 3, 1, 2], [5]]
    ar = draftwise.generate(target, prompts, method="ar", temperature=0, max_new_tokens=30, ignore_eos=True,
                            max_batch_size=3)
    out = draftwise.generate(target, prompts, method="hybrid", draft=draft, temperature=0, max_new_tokens=30,
                             ignore_eos=True, max_batch_size=3, threshold=0.5)
    for a, s in zip(ar, out):
        assert s.token_ids == a.token_ids
    assert sum(s.stats["drafted"] for s in out) > 0
