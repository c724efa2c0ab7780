"""The accept phase without one-hots (issue 56, item 6): a draft without distributions takes the no-probabilities
path of the speculative sampler (q(x) = 1 at its tokens), and under the exact rule greedy rows keep their logits,
read only for their argmax. Each path must give the outcome the one-hots gave, bit for bit, for every row of a
batch that mixes greedy and sampled rows; and the engine's accept phase must build no one-hot under the exact rule.
"""

from __future__ import annotations

import pytest
import torch

from draftwise.drafters.base import ModelRowsDrafter, NoRowsDrafter
from draftwise.drafters.suffix import SuffixRowsDrafter
from draftwise.engine import sampler as sampler_module
from draftwise.engine import sampling, step
from draftwise.engine.core import Engine
from draftwise.engine.keyed import Draws
from draftwise.engine.protocols import RowsDraft
from draftwise.engine.sampler import residual_at, residual_rows, speculative_sample_rows, warp_rows
from draftwise.engine.rows import Request
from draftwise.engine.sampling import SamplingConfig
from draftwise.models.runner import ModelRunner
from draftwise.rules.acceptance import ExactRule
from draftwise.models.loading import load_model
from draftwise.models.tiny import tiny_llama

VOCAB = 48


def _one_hot(tokens: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    return torch.zeros(*tokens.shape, vocab).scatter_(-1, tokens[..., None], 1.0)


def test_the_residual_of_a_deterministic_draft_is_the_one_hots_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(64, VOCAB, generator=gen) * 3, -1)
    tokens = torch.randint(0, VOCAB, (64,), generator=gen)
    pi[:8] = _one_hot(tokens[:8])  # the draft's own token has all the mass: the zero-residual fallback
    pi[8:16] *= 1.7  # a sub-normalised or scaled pi (lossy with beta < 1) can exceed 1 at the token
    pi[8:16, :] = pi[8:16].scatter(-1, tokens[8:16, None], 1.3)
    expected = residual_rows(pi, _one_hot(tokens))
    assert torch.equal(residual_at(pi, tokens), expected)
    wrong = residual_at(pi, (tokens + 1) % VOCAB)  # the negative control: another token's residual differs
    assert not torch.equal(wrong, expected)


def _batch(rows: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, k + 1, VOCAB, generator=gen) * 2
    logits[:, :, 5] += 6.0  # a likely token, so that drafts of it are often accepted
    tokens = torch.where(torch.rand(rows, k, generator=gen) < 0.5, torch.full((rows, k), 5),
                         torch.randint(0, VOCAB, (rows, k), generator=gen))
    counts = [int(c) for c in torch.randint(0, k + 1, (rows,), generator=gen)]
    counts[0] = 0  # a row with no draft this step
    greedy = [b % 3 == 1 for b in range(rows)]
    configs = [SamplingConfig(temperature=0.0) if g else SamplingConfig(temperature=0.8, top_k=20)
               for g in greedy]
    draws = Draws(list(range(100 + seed, 100 + seed + rows)), [7 + b for b in range(rows)], [False] * rows, "cpu")
    return logits, tokens, counts, greedy, configs, draws


@pytest.mark.parametrize("seed", range(6))
def test_no_probabilities_and_greedy_scores_give_the_one_hots_outcome(seed):
    logits, tokens, counts, greedy, configs, draws = _batch(rows=9, k=4, seed=seed)
    target = warp_rows(logits, configs)  # greedy rows: one-hot at their argmax (the reference)
    dense = speculative_sample_rows(tokens, _one_hot(tokens), target[:, :4], target, counts, draws, greedy)
    lean = speculative_sample_rows(tokens, None, target[:, :4], target, counts, draws, greedy)
    scores = warp_rows(logits, configs, greedy_scores=True)
    assert not torch.equal(scores, target)  # the greedy rows carry logits, not one-hots
    argmax = speculative_sample_rows(tokens, None, scores[:, :4], scores, counts, draws, greedy, greedy_argmax=True)
    assert dense == lean == argmax
    assert 0 < sum(dense.num_accepted) < sum(counts)  # both branches ran: acceptances and rejections
    # all rows greedy: the same, through the all-greedy branch
    greedy_all = [True] * len(greedy)
    target = warp_rows(logits, [SamplingConfig(temperature=0.0)] * len(greedy))
    scores = warp_rows(logits, [SamplingConfig(temperature=0.0)] * len(greedy), greedy_scores=True)
    dense = speculative_sample_rows(tokens, _one_hot(tokens), target[:, :4], target, counts, draws, greedy_all)
    argmax = speculative_sample_rows(tokens, None, scores[:, :4], scores, counts, draws, greedy_all,
                                     greedy_argmax=True)
    assert dense == argmax


def test_reading_scores_as_probabilities_would_be_caught():
    """The negative control: greedy rows' logits fed to the sampler as if they were distributions (no
    `greedy_argmax`) give another outcome on some seed."""
    differs = 0
    for seed in range(6):
        logits, tokens, counts, greedy, configs, draws = _batch(rows=9, k=4, seed=seed)
        target = warp_rows(logits, configs)
        scores = warp_rows(logits, configs, greedy_scores=True)
        dense = speculative_sample_rows(tokens, None, target[:, :4], target, counts, draws, greedy)
        wrong = speculative_sample_rows(tokens, None, scores[:, :4], scores, counts, draws, greedy)
        differs += dense != wrong
    assert differs


@pytest.fixture(scope="module")
def pair():
    return load_model(tiny_llama(0, init=0.05, vocab=64)), load_model(tiny_llama(1, layers=1, init=0.05, vocab=64))


PROMPTS = [[3, 17, 42, 8, 25, 3, 17], [5, 6, 5, 6, 5, 5, 5], [9], [9, 10, 11, 12, 9, 10, 11, 12]]
SETTINGS = [SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.0), SamplingConfig(0.7, top_k=5)]


def _engine(pair, method: str, coupling: str, tree_nodes: int) -> Engine:
    target, draft = pair
    if method == "sd":
        drafter = ModelRowsDrafter(ModelRunner(draft.model, vocab_size=64, rows=0), 64)
    else:
        drafter = SuffixRowsDrafter(64, torch.device("cpu"))
    return Engine(ModelRunner(target.model, vocab_size=64, rows=0), drafter, ExactRule(coupling=coupling), gamma=3,
                  max_batch_size=4, tree_nodes=tree_nodes, tree_adaptive=False)


def _run(engine: Engine, indices) -> list:
    ids = [engine.submit(Request(tuple(PROMPTS[b]), SETTINGS[b], max_new_tokens=12, seed=100 + b)) for b in indices]
    engine.run()
    return [engine.result(i) for i in ids]


def _tokens(results) -> list[tuple[int, ...]]:
    return [tuple(r.token_ids) for r in results]


@pytest.mark.parametrize("method,coupling,tree_nodes", [("sd", "gumbel", 0), ("sd", "rejection", 0),
                                                        ("suffix", "gumbel", 0), ("sd", "gumbel", 4)])
def test_the_exact_accept_phase_builds_no_one_hot(pair, monkeypatch, method, coupling, tree_nodes):
    """A batch mixing greedy and sampled rows (a one-token prompt among them) through the exact rule: while the
    accept phase runs, neither `warp`'s one-hot for greedy rows nor a draft's dense one-hots are built; each row
    writes what it writes alone, and the greedy rows write `ar`'s tokens."""
    inside = []
    accept = step.Stepper._accept

    def watched(self, *args):
        inside.append(True)
        try:
            return accept(self, *args)
        finally:
            inside.pop()

    original = {"one_hot_argmax": sampling.one_hot_argmax, "probs": RowsDraft.probs.fget}
    built = []

    def refuse(name):
        def build(*args, **kwargs):
            if inside:
                built.append(name)
            return original[name](*args, **kwargs)
        return build

    monkeypatch.setattr(step.Stepper, "_accept", watched)
    monkeypatch.setattr(sampling, "one_hot_argmax", refuse("one_hot_argmax"))
    monkeypatch.setattr(RowsDraft, "probs", property(refuse("probs")))
    engine = _engine(pair, method, coupling, tree_nodes)
    results = _run(engine, range(4))
    assert not built, built
    mixed = _tokens(results)
    alone = [_tokens(_run(_engine(pair, method, coupling, tree_nodes), [b]))[0] for b in range(4)]
    assert mixed == alone
    ar = Engine(ModelRunner(pair[0].model, vocab_size=64, rows=0), NoRowsDrafter(64, torch.device("cpu")), ExactRule(), gamma=0,
                max_batch_size=4)
    assert [mixed[0], mixed[2]] == _tokens(_run(ar, [0, 2]))
    assert sum(r.stats["accepted"] for r in results) > 0


def test_the_watch_sees_a_one_hot_when_one_is_built(pair, monkeypatch):
    """The negative control of the test above: the same watch, with the old accept phase's one-hot greedy rows
    (`warp_rows` ignoring `greedy_scores`), reports the one-hot."""
    plain = sampler_module.warp_rows
    monkeypatch.setattr(step, "warp_rows", lambda logits, configs, greedy_scores=False: plain(logits, configs))
    with pytest.raises(AssertionError, match="one_hot_argmax"):
        test_the_exact_accept_phase_builds_no_one_hot(pair, monkeypatch, "sd", "rejection", 0)
