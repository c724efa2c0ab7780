"""Token trees (draftwise/engine/tree.py): the tree forward and the cache compaction against cache-free forwards, the
tree drafters against cache-free rollouts, tree acceptance's exactness (goodness of fit, with negative controls
that the same test catches) and token-for-token greedy equality through the engine.

Goodness of fit as in test_exactness: Pearson chi-square over the joint of the first tokens, cells expected below
5 pooled, significance ALPHA = 1e-3; controls must be rejected at p < ALPHA."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import draftwise
import draftwise.engine.step as engine_module
import draftwise.engine.tree as tree_module
from draftwise.errors import DraftwiseError
from draftwise.models.runner import ModelRunner
from draftwise.drafters.tree_growth import grow_trees, merge_trees
from draftwise.engine.tree import TreeBudget, accept_tree, depths, slot_structure, verify_mask

from conftest import sweep, near_copy, tiny_llama
from test_exactness import (ALPHA, WARPED, _feature_head, exact_joint, pooled_chisquare, sample_joint,
                            target_and_draft, SD_PROMPTS, LOOKUP_PROMPTS)

N_TREE = 2000  # generate() runs per tree configuration
N_TREE_CONTROL = 1200


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """n nodes, parents before children, distinct tokens among siblings."""
    tokens, parents = [], []
    for i in range(n):
        parent = rng.randrange(-1, i)
        used = {t for t, p in zip(tokens, parents) if p == parent}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            parent = -1 if parent != -1 else 0
            used = {t for t, p in zip(tokens, parents) if p == parent}
            free = [t for t in range(vocab) if t not in used]
        tokens.append(rng.choice(free))
        parents.append(parent)
    return tokens, parents


def path_of(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


# ----------------------------------------------------------------------------- the forward and the cache

@pytest.mark.parametrize("fast", ["1", "0"])
def test_tree_forward_and_compaction_match_a_cache_free_forward_under_random_acceptance(fast, monkeypatch):
    """Three rows, five rounds: random trees verified in one forward (every slot's logits equal a cache-free
    forward of prefix + the slot's path), a random accepted path compacted, a random bonus; at the end each row
    decodes one more token, which must equal the cache-free forward of the whole sequence."""
    monkeypatch.setenv("DRAFTWISE_FAST", fast)
    model = tiny_llama(0)
    runner = ModelRunner(model, vocab_size=64, rows=3)
    rng = random.Random(4)
    seqs = [[rng.randrange(64) for _ in range(n)] for n in (5, 9, 2)]
    for b, seq in enumerate(seqs):
        runner.forward_rows(torch.tensor([seq[:-1]]), [len(seq) - 1], begin=b)

    def reference(seq):
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0, -1]

    worst = 0.0
    for _ in range(5):
        trees = [random_tree(rng, rng.randint(0, 7), 64) for _ in seqs]
        width = 1 + max(len(t) for t, _ in trees)
        feed = torch.zeros(3, width, dtype=torch.long)
        for b, (tokens, _) in enumerate(trees):
            feed[b, 0] = seqs[b][-1]
            feed[b, 1: 1 + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        starts = runner.lengths[:3]
        mask = verify_mask([p for _, p in trees], starts, width, runner.device)
        out = runner.forward_rows(feed, [1 + len(t) for t, _ in trees], tree=mask)
        for b, (tokens, parents) in enumerate(trees):
            for slot in range(1 + len(tokens)):
                path = [] if slot == 0 else [tokens[i] for i in path_of(parents, slot - 1)]
                worst = max(worst, float((reference(seqs[b] + path) - out.logits[b, slot]).abs().max()))
            # a random accepted path: a random node's path, or nothing
            node = rng.randrange(-1, len(tokens))
            accepted = path_of(parents, node) if node >= 0 else []
            runner.cache.compact(b, starts[b] + 1, [starts[b] + 1 + i for i in accepted])
            seqs[b] = seqs[b] + [tokens[i] for i in accepted] + [rng.randrange(64)]
            runner.trim_row(b, len(seqs[b]) - 1)
    assert worst < 1e-3, worst  # fp32 in another summation order than transformers' (measured up to 1.2e-4)
    out = runner.forward_rows(torch.tensor([[s[-1]] for s in seqs]), [1, 1, 1])
    for b, seq in enumerate(seqs):
        assert float((reference(seq) - out.logits[b, 0]).abs().max()) < 1e-4


def test_slot_structure_and_depths():
    depth, visible = slot_structure([(-1, -1, 0, 2)], 6)
    assert depth[0].tolist() == [0, 1, 1, 2, 3, 0]
    assert visible[0, 4].tolist() == [True, True, False, True, True, False]  # node 3: root, 0, 2, itself
    assert visible[0, 5].tolist() == [True, False, False, False, False, True]  # padding: root and itself
    with pytest.raises(DraftwiseError, match="parents must come before"):
        depths([0])


def test_merge_trees_joins_shared_paths_best_first_within_the_budget():
    a = ([5, 6, 7], [-1, 0, 1], [0.9, 0.5, 0.2])
    b = ([5, 8, 6, 9], [-1, 0, -1, 2], [0.6, 0.3, 0.4, 0.35])
    tokens, parents, scores = merge_trees([a, b], 10)
    # union: 5 (0.9, the best of 0.9 and 0.6), 5-6 (0.5), 6 (0.4), 6-9 (0.35), 5-8 (0.3), 5-6-7 (0.2)
    assert tokens == [5, 6, 6, 9, 8, 7] and parents == [-1, 0, -1, 2, 0, 1]
    assert scores == [0.9, 0.5, 0.4, 0.35, 0.3, 0.2]
    tokens, parents, scores = merge_trees([a, b], 3)  # a prefix of the best-first order: ancestors kept
    assert tokens == [5, 6, 6] and parents == [-1, 0, -1]
    depths(merge_trees([b, a], 4)[1])  # parents precede children whichever tree comes first


def test_tree_budget_fits_the_verification_cost_and_cuts_by_value():
    budget = TreeBudget(32)
    # no measurement yet: widths in turn (max_nodes, a quarter, half, ...) over the rows, and no cut
    assert [budget.nodes(1) for _ in range(3)] == [16, 8, 32] and budget.nodes(4) == 4
    assert budget.min_prob(1) == 0.0 and budget.cut([[0.9, 0.01], [0.2]]) == [2, 1]
    for tokens in (1, 4, 9, 17, 33, 2, 50):
        budget.observe(tokens, 0.010 + 0.0005 * tokens)  # fixed 10 ms, 0.5 ms a token: 20 tokens a forward
    assert budget.fit() == pytest.approx((0.010, 0.0005), rel=1e-6)
    assert budget.nodes(1) == 19 and budget.nodes(4) == 4 and budget.nodes(16) == 1
    assert budget.growth(1) == 32
    # no drafting time: a lone row commits 1 token in 10.5 ms; a node pays above 0.5 / 10.5
    assert budget.min_prob(1) == pytest.approx(0.0005 / 0.0105)
    budget.observe_draft(0.0045)  # drafting adds 4.5 ms a step
    assert budget.min_prob(1) == pytest.approx(0.0005 / 0.015)
    # rate: (1 + 0.9) / 15.5 ms = 0.1226 / ms; 0.5 ms x that = 0.061 > 0.05: the 0.05 node does not join
    assert budget.cut([[0.9, 0.05]]) == [1]
    # across rows: best first while p > 0.5 ms x the rate; a row's nodes join in order
    rows = [[0.95, 0.9, 0.3, 0.06], [0.8, 0.7, 0.2]]
    counts = budget.cut(rows)
    value, cost = 2.0, 0.015 + 0.0005 * 2
    for p in sorted((p for row, c in zip(rows, counts) for p in row[:c]), reverse=True):
        assert p * cost > 0.0005 * value
        value, cost = value + p, cost + 0.0005
    left = [row[c] for row, c in zip(rows, counts) if c < len(row)]
    assert all(p * cost <= 0.0005 * value for p in left) and counts == [3, 3]
    fixed = TreeBudget(4, adaptive=False)  # the same trees whatever the timings
    for tokens in (1, 4, 9, 17, 33):
        fixed.observe(tokens, 0.010 + 0.0005 * tokens)
    assert fixed.growth(16) == 4 and fixed.min_prob(16) == 0.0 and fixed.cut([[0.9, 0.01], [0.2] * 6]) == [2, 4]
    small = TreeBudget(2)
    for tokens in (1, 4, 9, 17, 33):
        small.observe(tokens, 0.010 + 0.0005 * tokens)
    assert small.cut([[0.9, 0.8, 0.7]]) == [2]


# ----------------------------------------------------------------------------- drafters against cache-free rollouts

def _cache_free_tree(logprobs_after, tokens_so_far, nodes, depth):
    """grow_trees with every distribution from a cache-free forward of the context plus the node's path."""
    root = logprobs_after(tokens_so_far)[None]
    fed_paths: list[list[int]] = []

    def expand(request):
        items = request[0]
        out = []
        for token, parent, ancestors, _ in items:
            path = ([] if parent < 0 else fed_paths[parent]) + [token]
            fed_paths.append(path)
            out.append(logprobs_after(tokens_so_far + path))
        return torch.stack(out)[None]

    return grow_trees(root, expand, budgets=[nodes], max_depths=[depth])


class _Row:
    def __init__(self, sequence):
        from draftwise.engine.rows import Request
        from draftwise.engine.sampling import SamplingConfig, make_generator

        self.sequence = sequence
        self.request = Request(tuple(sequence), SamplingConfig(temperature=0.0))
        self.generator = make_generator(0)
        self.grammar = None


def test_draft_model_trees_equal_cache_free_trees_under_forced_acceptance():
    from draftwise.drafters.base import ModelRowsDrafter

    draft = tiny_llama(1, layers=1)
    drafter = ModelRowsDrafter(ModelRunner(draft, vocab_size=64, rows=0), 64)

    def logprobs_after(seq):
        with torch.no_grad():
            return torch.log_softmax(draft(torch.tensor([seq])).logits[0, -1].float(), -1)

    rng = random.Random(5)
    rows = [_Row([rng.randrange(64) for _ in range(n)]) for n in (3, 8, 1)]
    for b, row in enumerate(rows):
        drafter.admit(b, row.sequence)
    for _ in range(5):
        limits = [rng.randint(1, 4) for _ in rows]
        proposal = drafter.propose(rows, limits, tree_nodes=9)
        assert proposal.parents is not None
        for b, row in enumerate(rows):
            tokens = proposal.tokens[b, : proposal.counts[b]].tolist()
            expected = _cache_free_tree(logprobs_after, row.sequence, 9, limits[b])
            assert (tokens, list(proposal.parents[b])) == (expected[0][0], expected[1][0]), b
            node = rng.randrange(-1, len(tokens))  # forced acceptance: a random node's path
            accepted = path_of(list(proposal.parents[b]), node) if node >= 0 else []
            row.sequence += [tokens[i] for i in accepted] + [rng.randrange(64)]
            drafter.rewind(b, len(row.sequence) - 1)


def test_eagle_head_trees_equal_cache_free_trees_under_forced_acceptance():
    from draftwise.heads.eagle import EagleConfig, EagleHead
    from draftwise.drafters.eagle import EagleRowsDrafter

    target = tiny_llama(0, width=16, vocab=64)
    torch.manual_seed(3)
    head = EagleHead(EagleConfig(hidden_size=16, num_heads=4, num_kv_heads=2, intermediate_size=32,
                                 target_vocab_size=64), torch.arange(0, 64, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)
    head.attach(target)
    drafter = EagleRowsDrafter(head, 64, torch.device("cpu"))

    def features(seq):
        with torch.no_grad():
            return target(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]

    def full_logprobs(state):
        logits = torch.full((64,), float("-inf"))
        logits[head.vocab_ids] = head.logits(state).float()
        return torch.log_softmax(logits, -1)

    def head_tree(seq, nodes, depth):
        """The tree from cache-free head forwards: true features of seq, then predicted ones along each path."""
        feats = list(features(seq)[: len(seq) - 1])
        nexts = list(seq[1:])

        def state_after(path_states, path_tokens):
            with torch.no_grad():
                return head(torch.stack(feats + path_states)[None], torch.tensor([nexts + path_tokens]))[0, -1]

        root_state = state_after([], [])
        states_of: dict[tuple[int, ...], torch.Tensor] = {(): root_state}
        fed: list[tuple[int, ...]] = []

        def expand(request):
            out = []
            for token, parent, _, _ in request[0]:
                prefix = () if parent < 0 else fed[parent]
                path = prefix + (token,)
                # the state after `path`: the head reads the states along the path and its tokens
                chain = [states_of[path[:i]] for i in range(len(path))]
                states_of[path] = state_after(chain, list(path))
                fed.append(path)
                out.append(full_logprobs(states_of[path]))
            return torch.stack(out)[None]

        return grow_trees(full_logprobs(root_state)[None], expand, budgets=[nodes], max_depths=[depth])

    rng = random.Random(6)
    rows = [_Row([rng.randrange(64) for _ in range(n)]) for n in (4, 7)]
    for b, row in enumerate(rows):
        drafter.admit(b, row.sequence)
        drafter.observe(b, 0, features(row.sequence)[: len(row.sequence) - 1])
    for _ in range(4):
        limits = [rng.randint(1, 3) for _ in rows]
        proposal = drafter.propose(rows, limits, tree_nodes=8)
        for b, row in enumerate(rows):
            tokens = proposal.tokens[b, : proposal.counts[b]].tolist()
            expected = head_tree(row.sequence, 8, limits[b])
            assert (tokens, list(proposal.parents[b])) == (expected[0][0], expected[1][0]), b
            node = rng.randrange(-1, len(tokens))
            accepted = path_of(list(proposal.parents[b]), node) if node >= 0 else []
            path_slots = [0] + [i + 1 for i in accepted]
            # the engine hands over the target's features of the pending token and the accepted path
            fed_seq = row.sequence + [tokens[i] for i in accepted]
            drafter.observe(b, len(row.sequence) - 1, features(fed_seq)[len(row.sequence) - 1:][: len(path_slots)])
            row.sequence = fed_seq + [rng.randrange(64)]
            drafter.rewind(b, len(row.sequence) - 1)


def test_suffix_trees_follow_the_counts_best_first():
    from draftwise.drafters.suffix import SuffixTrie

    trie = SuffixTrie(8)
    trie.add([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 5])
    tokens, parents, expected, scores = trie.speculate_tree([9, 1], 6, 3, factor=4.0, min_prob=0.0, min_match=1)
    # after "1": 2 (3 of 4), 5 (1 of 4); after "1 2": 3 (2 of 3), 4 (1 of 3); after "1 2 3": 1; after "1 2 4": 1.
    # Path scores 0.75, 0.5, 0.5, 0.25, 0.25, 0.25, best first (ties: the earlier found)
    assert tokens == [2, 3, 1, 5, 4, 1] and parents == [-1, 0, 1, -1, 0, 4]
    assert expected == pytest.approx(2.5)
    assert scores == pytest.approx([0.75, 0.5, 0.5, 0.25, 0.25, 0.25])
    assert trie.speculate_tree([9, 1], 6, 3, factor=4.0, min_prob=0.3, min_match=1)[0] == [2, 3, 1]
    assert trie.speculate_tree([9, 1], 2, 1, factor=4.0, min_prob=0.0, min_match=1)[0] == [2, 5]


# ----------------------------------------------------------------------------- acceptance

def test_accept_tree_greedy_follows_the_argmax_as_far_as_the_tree_holds_it():
    probs = torch.zeros(1, 5, 8)
    probs[0, 0, 3] = probs[0, 2, 6] = probs[0, 4, 1] = probs[0, 1, 7] = probs[0, 3, 2] = 1.0
    # nodes: 0 -> token 5 (root), 1 -> token 3 (root), 2 -> 6 (under node 1), 3 -> 4 (under node 1)
    out = accept_tree([(-1, -1, 1, 1)], [[5, 3, 6, 4]], probs, [torch.Generator()], [True])
    assert out.paths == [[1, 2]] and out.next_tokens == [2]  # slot 3 (node 2)'s argmax


def _tree_joint_case(method, vocab, length, **extra):
    target, draft = target_and_draft(vocab)
    prompt = (SD_PROMPTS if method == "sd" else LOOKUP_PROMPTS)[vocab]
    # fixed trees (tree_adaptive=0): the trees' shapes, and so the controls' power, do not follow the timings
    kwargs = dict(target=target, prompt=prompt, method=method, gamma=3, max_new_tokens=length + 1,
                  temperature=WARPED.temperature, top_k=WARPED.top_k, top_p=WARPED.top_p, tree_nodes=6,
                  tree_adaptive=0)
    if method in ("sd", "hybrid"):
        kwargs["draft"] = draft
    kwargs.update(extra)
    return kwargs, exact_joint(target, prompt, WARPED, length)


@pytest.mark.parametrize("method,vocab,length,adaptive", sweep([("sd", 6, 3, 0), ("sd", 12, 2, 0), ("suffix", 6, 3, 0),
                                                                 ("hybrid", 6, 2, 0), ("sd", 6, 3, 1)], {2, 4},
                                                                ids=lambda c: "-".join(map(str, c))))
def test_tree_methods_reproduce_the_target_joint_distribution(method, vocab, length, adaptive):
    """Fixed trees, and trees the budget cuts by value (any ancestor-closed subtree keeps the sampling exact)."""
    kwargs, expected = _tree_joint_case(method, vocab, length, tree_adaptive=adaptive)
    counts, totals = sample_joint(N_TREE, length, vocab, **kwargs)
    assert 0 < totals["accepted"] < totals["steps"] * 3  # trees were accepted and rejected
    p_value = pooled_chisquare(counts, expected)
    print(f"{method} tree: chi-square p = {p_value:.3g}")
    assert p_value > ALPHA, f"{method} tree: chi-square p = {p_value:.3g}"


def test_eagle_head_trees_reproduce_the_target_joint_distribution():
    target, _ = target_and_draft(12)
    kwargs, expected = _tree_joint_case("sd", 12, 2, draft=_feature_head("eagle", target))
    counts, totals = sample_joint(N_TREE, 2, 12, **kwargs)
    assert 0 < totals["accepted"]
    p_value = pooled_chisquare(counts, expected)
    print(f"eagle tree: chi-square p = {p_value:.3g}")
    assert p_value > ALPHA, f"eagle tree: chi-square p = {p_value:.3g}"


@pytest.mark.parametrize("bug", ["slot-off-by-one", "argmax-walk"])
def test_control_tree_acceptance_bugs_are_rejected(bug, monkeypatch):
    """Drawing a node's token from its parent's distribution (a slot off by one), or walking the tree with the
    target's argmax while sampling only the last token, must fail the same test."""
    if bug == "slot-off-by-one":
        monkeypatch.setattr(tree_module, "node_slot", lambda node: max(node, 0))
    else:
        original = tree_module.accept_tree

        def argmax_walk(parents, tokens, target_probs, generators, greedy):
            walked = original(parents, tokens, target_probs, generators, [True] * len(parents))
            last = original([()] * len(parents), [[]] * len(parents),
                            target_probs[torch.arange(len(parents)), walked.final_slots][:, None], generators, greedy)
            return tree_module.TreeAcceptance(walked.paths, last.next_tokens, walked.final_slots)

        monkeypatch.setattr(engine_module, "accept_tree", argmax_walk)
    kwargs, expected = _tree_joint_case("sd", 6, 2)
    counts, _ = sample_joint(N_TREE_CONTROL, 2, 6, **kwargs)
    p_value = pooled_chisquare(counts, expected)
    print(f"control {bug}: p = {p_value:.3g}")
    assert p_value < ALPHA, f"the {bug} bug was not detected: p = {p_value:.3g}"


# ----------------------------------------------------------------------------- greedy equality and request features

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [3, 3, 3, 3],
           [5, 6, 7, 5, 6, 8, 5, 6], [1], [2, 9]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0)
    return target, near_copy(target, 0.1)


@pytest.mark.parametrize("method", ["sd", "suffix", "hybrid", "eagle"])
def test_tree_methods_at_temperature_0_equal_target_greedy_token_for_token(method, pair):
    target, draft = pair
    if method == "eagle":
        from draftwise.heads.eagle import EagleConfig, EagleHead

        torch.manual_seed(3)
        draft = EagleHead(EagleConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                      target_vocab_size=64), torch.arange(64)).attach(target)
        method = "sd"
    ar = draftwise.generate(target, PROMPTS, method="ar", temperature=0, max_new_tokens=40, ignore_eos=True)
    for nodes in (3, 16):
        out = draftwise.generate(target, PROMPTS, draft=None if method == "suffix" else draft, method=method, temperature=0, max_new_tokens=40,
                                 tree_nodes=nodes, gamma=5, max_batch_size=3, ignore_eos=True)
        for a, b in zip(ar, out):
            assert a.token_ids == b.token_ids
    if method != "suffix":
        assert sum(o.stats["accepted"] for o in out) > 0  # the drafts were used, not only verified


def test_tree_rows_apply_penalties_min_tokens_and_logprobs_as_target_greedy(pair):
    target, draft = pair
    common = dict(temperature=0, max_new_tokens=30, repetition_penalty=1.3, min_new_tokens=20, logprobs=2)
    eos_model = tiny_llama(0, eos=7)
    ar = draftwise.generate(eos_model, PROMPTS[:4], method="ar", **common)
    out = draftwise.generate(eos_model, PROMPTS[:4], draft=draft, method="sd", tree_nodes=8, gamma=4, **common)
    for a, b in zip(ar, out):
        assert a.token_ids == b.token_ids
        assert [x.token_id for x in b.logprobs] == b.token_ids
        assert np.allclose([x.logprob for x in a.logprobs], [x.logprob for x in b.logprobs], atol=1e-4)


def test_a_grammar_with_a_tree_is_refused_with_its_reason(pair):
    target, draft = pair
    with pytest.raises(DraftwiseError, match="tree_nodes=4 cannot apply a grammar"):
        draftwise.generate(target, [1, 2], draft=draft, method="sd", tree_nodes=4, grammar={"regex": "a+"})


def test_tree_nodes_is_bounded():
    target = tiny_llama(0)
    with pytest.raises(DraftwiseError, match="tree_nodes"):
        draftwise.generate(target, [1, 2], method="suffix", tree_nodes=1000)
    with pytest.raises(DraftwiseError, match="tree_adaptive"):
        draftwise.generate(target, [1, 2], method="suffix", tree_nodes=4, tree_adaptive=2)


def test_tree_steps_record_nodes_and_depths(pair):
    target, draft = pair
    out = draftwise.generate(target, PROMPTS[0], draft=draft, method="sd", temperature=0, max_new_tokens=20,
                             tree_nodes=8, gamma=3, ignore_eos=True)
    stats = out.stats
    assert stats["drafted"] <= 8 * stats["steps"]
    assert stats["drafted_per_position"][0] >= stats["drafted_per_position"][2]
    assert stats["accepted"] == sum(stats["accepted_per_position"])
    assert stats["target_tokens"] >= stats["drafted"] + stats["steps"]

