"""The drafters' base class (drafters.base.Drafter): a drafter writes `propose` and nothing else it does not need.
A new drafter is three edits: its class (with its builder beside it), its DrafterKind entry and its Method entry
(methods.py); it then runs through the engine exactly (T=0: `ar`'s tokens). After each step the engine calls the
drafter's feedback hook `update` with what each row kept; the tree budget is an argument of `propose`; wrappers
hand every hook to the drafter they wrap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import draftwise
from draftwise.drafters.base import (Drafter, LookupRowsDrafter, ModelRowsDrafter, NoRowsDrafter, WrappingDrafter)
from draftwise.drafters.companion import CompanionRowsDrafter, StagedRowsDrafter
from draftwise.drafters.eagle import EagleRowsDrafter
from draftwise.drafters.mtad import BeamRowsDrafter, ModelBeams
from draftwise.drafters.suffix import HybridRowsDrafter, SuffixRowsDrafter
from draftwise.engine.protocols import one_hot_draft
from draftwise.engine.sampling import SamplingConfig
from draftwise.methods import DRAFTERS, METHODS, DrafterKind, Method
from draftwise.models.loading import load_model
from draftwise.models.runner import ModelRunner
from draftwise.models.tiny import tiny_llama
from draftwise.rules.acceptance import ExactRule

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[3, 17, 42, 8, 25, 3, 17], [5, 6, 5, 6, 5, 5, 5], [9, 10, 11, 12]]


class Repeat(Drafter):  # edit 1: the drafter (and its builder below)
    """Drafts each row's last token `limit` times."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device

    def propose(self, rows, limits):
        return one_hot_draft([[r.sequence[-1]] * limit for r, limit in zip(rows, limits)], self.vocab_size,
                             self.device)


def build_repeat(plan, rule):
    return Repeat(plan.vocab_size, plan.target.device)


@pytest.fixture(scope="module")
def target():
    return load_model(tiny_llama(0, eos=7))


def test_a_new_drafter_is_its_propose_and_two_entries_and_runs_exactly(target, monkeypatch):
    monkeypatch.setitem(DRAFTERS, "repeat", DrafterKind("repeat", "no draft model",  # edit 2
                                                        builder=f"{__name__}:build_repeat"))
    monkeypatch.setitem(METHODS, "repeat", Method("repeat", "repeats the last token", drafter="repeat",  # edit 3
                                                  make_rule=lambda options: ExactRule()))
    # 3 prompts on 2 rows: rows are admitted, moved and released; the bias makes the target repeat token 13 at times
    kwargs = dict(temperature=0, max_new_tokens=16, ignore_eos=True, max_batch_size=2, logit_bias={13: 4.0})
    ours = draftwise.generate(target, PROMPTS, method="repeat", gamma=3, **kwargs)
    ar = draftwise.generate(target, PROMPTS, method="ar", **kwargs)
    assert [g.token_ids for g in ours] == [g.token_ids for g in ar]
    assert sum(g.stats["drafted"] for g in ours) > 0 and sum(g.stats["accepted"] for g in ours) > 0
    alone = draftwise.generate(target, PROMPTS[1], method="repeat", gamma=3, **kwargs)
    assert alone.token_ids == ar[1].token_ids


class Learning(Repeat):
    """Repeat with the feedback hook: it adds up what each row kept."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self.kept: dict[int, int] = {}  # row id (the request's) -> drafted tokens kept
        self.steps = 0

    def update(self, rows, accepted):
        self.steps += 1
        for row, kept in zip(rows, accepted):
            self.kept[row.id] = self.kept.get(row.id, 0) + kept


BUILT: list[Learning] = []


def build_learning(plan, rule):
    BUILT.append(Learning(plan.vocab_size, plan.target.device))
    return BUILT[-1]


def test_the_engine_tells_the_drafter_what_each_row_kept(target, monkeypatch):
    monkeypatch.setitem(DRAFTERS, "learning", DrafterKind("learning", "no draft model",
                                                          builder=f"{__name__}:build_learning"))
    monkeypatch.setitem(METHODS, "learning", Method("learning", "repeats the last token", drafter="learning",
                                                    make_rule=lambda options: ExactRule()))
    ours = draftwise.generate(target, PROMPTS, method="learning", gamma=3, temperature=0, max_new_tokens=16,
                              ignore_eos=True, max_batch_size=2, logit_bias={13: 4.0})
    drafter = BUILT[-1]
    assert [drafter.kept[i] for i in sorted(drafter.kept)] == [g.stats["accepted"] for g in ours]
    assert sum(drafter.kept.values()) > 0 and drafter.steps >= max(g.stats["target_calls"] for g in ours)


def test_the_engine_gives_the_tree_budget_to_propose(target, monkeypatch):
    seen = []
    propose = SuffixRowsDrafter.propose

    def recording(self, rows, limits, **tree):
        seen.append(tree)
        return propose(self, rows, limits, **tree)

    monkeypatch.setattr(SuffixRowsDrafter, "propose", recording)
    kwargs = dict(temperature=0, max_new_tokens=12, ignore_eos=True)
    trees = draftwise.generate(target, PROMPTS[1], method="suffix", tree_nodes=4, tree_adaptive=0, **kwargs)
    assert seen and all(t == {"tree_nodes": 4, "tree_min_prob": 0.0} for t in seen)
    seen.clear()
    chains = draftwise.generate(target, PROMPTS[1], method="suffix", **kwargs)
    assert seen and all(t == {} for t in seen)  # chains: the two-argument call
    ar = draftwise.generate(target, PROMPTS[1], method="ar", **kwargs)
    assert trees.token_ids == chains.token_ids == ar.token_ids


def test_every_drafter_of_the_package_extends_the_base():
    for cls in (NoRowsDrafter, LookupRowsDrafter, ModelRowsDrafter, ModelBeams, EagleRowsDrafter, SuffixRowsDrafter,
                HybridRowsDrafter, CompanionRowsDrafter, StagedRowsDrafter, BeamRowsDrafter):
        assert issubclass(cls, Drafter), cls
    for cls in (HybridRowsDrafter, CompanionRowsDrafter, StagedRowsDrafter, BeamRowsDrafter):
        assert issubclass(cls, WrappingDrafter), cls


def _rows(*sequences):
    return [SimpleNamespace(sequence=list(s), request=SimpleNamespace(sampling=GREEDY), grammar=None, token_ids=[])
            for s in sequences]


def test_the_tree_budget_is_an_argument_of_propose(target):
    suffix = SuffixRowsDrafter(64, torch.device("cpu"))
    sequence = [5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2]  # after "1 2": 3 (twice) or 4 (once)
    suffix.admit(0, sequence)
    chain = suffix.propose(_rows(sequence), [4])
    assert chain.parents is None and chain.tokens[0].tolist() == [3, 6]
    tree = suffix.propose(_rows(sequence), [4], tree_nodes=6)
    assert tree.tokens[0].tolist() == [3, 4, 6, 8, 7] and tree.parents == ((-1, -1, 0, 0, 1),)
    assert suffix.propose(_rows(sequence), [4], tree_nodes=3).counts == [3]
    assert suffix.propose(_rows(sequence), [4], tree_nodes=6, tree_min_prob=0.5).tokens[0].tolist() == [3]

    model = ModelRowsDrafter(ModelRunner(tiny_llama(1, layers=1, eos=7), rows=1), 64)
    model.admit(0, PROMPTS[0])
    chain = model.propose(_rows(PROMPTS[0]), [3])
    assert chain.parents is None and chain.counts == [3]
    model.rewind(0, len(PROMPTS[0]) - 1)
    tree = model.propose(_rows(PROMPTS[0]), [3], tree_nodes=5)
    assert tree.parents is not None and tree.counts == [5]


def test_a_drafter_feeds_a_prompt_when_its_row_first_drafts_and_then_drafts_as_a_fresh_rollout():
    """Admission feeds the draft model nothing; a row's first drafting step feeds its prompt (in prefill chunks when
    it is longer than LAZY_PROMPT, in the step's own forward when shorter), beside a row that has drafted before and
    a one-token prompt, and every row's greedy draft equals a cache-free rollout of its sequence."""
    from draftwise.drafters.base import LAZY_PROMPT

    model = tiny_llama(1, layers=2)
    drafter = ModelRowsDrafter(ModelRunner(model, rows=0), 64)
    sequences = [[(7 * i + 3) % 60 for i in range(LAZY_PROMPT + 25)], [4], [9, 8, 7, 6, 5]]
    for b, seq in enumerate(sequences):
        drafter.admit(b, seq)
    assert drafter.runner.calls == 0 and drafter.runner.tokens_processed == 0
    empty = drafter.propose(_rows(*sequences), [0, 0, 0])  # a step that drafts nothing feeds nothing
    assert empty.counts == [0, 0, 0] and drafter.runner.calls == 0

    def rollout(seq, n):
        out = list(seq)
        with torch.inference_mode():
            for _ in range(n):
                out.append(int(model(torch.tensor([out])).logits[0, -1, :64].argmax()))
        return out[len(seq):]

    draft = drafter.propose(_rows(*sequences), [3, 2, 0])
    assert drafter.prefill_calls >= 1  # the long prompt went in as a prompt
    for b, seq in enumerate(sequences):
        assert draft.tokens[b, : draft.counts[b]].tolist() == rollout(seq, [3, 2, 0][b]), b
    for b, seq in enumerate(sequences):  # each row keeps one drafted token and a new one; draft again
        seq += [int(draft.tokens[b, 0]) if draft.counts[b] else 11, 12 + b]
        drafter.rewind(b, min(drafter.runner.lengths[b], len(seq) - 2))
    again = drafter.propose(_rows(*sequences), [2, 3, 4])
    for b, seq in enumerate(sequences):
        assert again.tokens[b, : again.counts[b]].tolist() == rollout(seq, [2, 3, 4][b]), b


def test_a_wrapper_hands_every_hook_to_the_drafter_it_wraps():
    calls = []

    class Inner(Drafter):
        calls = 7
        wants_features = True
        feature_layers = (1, 2)

        def __getattribute__(self, name):
            if name in ("admit", "rewind", "move_row", "release", "observe", "update"):
                return lambda *args: calls.append((name, args))
            return object.__getattribute__(self, name)

    outer = WrappingDrafter(Inner())
    assert (outer.calls, outer.wants_features, outer.feature_layers) == (7, True, (1, 2))
    outer.admit(0, [1, 2])
    outer.rewind(0, 1)
    outer.move_row(1, 0)
    outer.release(1)
    outer.observe(0, 0, "states")
    outer.update("rows", [2])
    assert calls == [("admit", (0, [1, 2])), ("rewind", (0, 1)), ("move_row", (1, 0)), ("release", (1,)),
                     ("observe", (0, 0, "states")), ("update", ("rows", [2]))]
    with pytest.raises(NotImplementedError):
        Drafter().propose([], [])


@pytest.mark.parametrize("keep_raw", [False, True])
def test_the_draft_loop_stops_each_row_at_its_limit_eos_or_policy_and_reads_no_flag_back(keep_raw, monkeypatch):
    """draft_chains over scripted logits: row b drafts the argmax of each step's logits until its limit, until it
    drafted EOS, or until the confidence policy stops it (top probability below the threshold); a head's draft
    vocabulary (`ids`) maps its tokens. The loop keeps its per-row flags on the host: no tensor is read as a bool.
    keep_raw takes the path that builds the distributions; the tokens and counts are the same."""
    from draftwise.drafters.base import draft_chains
    from draftwise.drafters.policies import ConfidenceStop

    rows_n, width, vocab = 5, 4, 12
    ids = torch.arange(vocab) * 2 + 1  # a head's draft vocabulary inside a target vocabulary of 2 * vocab + 1
    eos = int(ids[11])
    logits = [torch.zeros(rows_n, vocab) for _ in range(width)]  # all zeros: top probability 1/12, unconfident
    for step in range(width):
        for b in range(rows_n):
            if not (b == 4 and step == 1):  # row 4 is unconfident at its second token (and stays stopped)
                logits[step][b, 11 if (b, step) == (2, 1) else (b + 3 * step) % 11] = 10.0  # row 2 drafts EOS second
    limits = [4, 2, 4, 0, 3]
    threshold = 0.6
    rows = [SimpleNamespace(request=SimpleNamespace(sampling=GREEDY), grammar=None, sequence=[1]) for _ in limits]
    expected = []
    for b, limit in enumerate(limits):
        drafted = []
        for step in range(width):
            if len(drafted) >= limit or torch.softmax(logits[step][b], -1).max() < threshold:
                break
            drafted.append(int(ids[logits[step][b].argmax()]))
            if drafted[-1] == eos:
                break
        expected.append(drafted)
    assert [len(d) for d in expected] == [4, 2, 2, 0, 1] and expected[2][-1] == eos  # limit, limit, EOS, -, policy
    fed = []

    def advance(token):
        fed.append(token.tolist())
        return logits[len(fed)], None

    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("a tensor read as a bool"))
    draft = draft_chains(rows, limits, (logits[0], None), advance, vocab_size=2 * vocab + 1,
                         eos=torch.tensor([eos]), policy=ConfidenceStop(threshold), keep_raw=keep_raw, ids=ids)
    assert draft.counts == [len(d) for d in expected]
    assert [draft.tokens[b, :c].tolist() for b, c in enumerate(draft.counts)] == expected
    assert len(fed) == max(map(len, expected)) - 1  # no forward past the last row's last token
    assert (draft.q is None) != keep_raw
