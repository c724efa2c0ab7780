"""The engine's bookkeeping at an end-of-sequence token, and the row drafters stopping at one.

- An accepted drafted EOS ends the answer there: the step counts the drafted tokens up to it as accepted, none
  after it (every verified one as drafted); an EOS as the bonus token changes no count.
- The draft model's row drafter stops after drafting an EOS (no forward past it); prompt lookup cuts its
  continuation after one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftwise.rules.acceptance import ExactRule
from draftwise.drafters.base import LookupRowsDrafter, ModelRowsDrafter, NoRowsDrafter
from draftwise.engine.core import Engine
from draftwise.engine.protocols import one_hot_draft
from draftwise.engine.rows import Request
from draftwise.models.runner import ModelRunner
from draftwise.engine.sampling import SamplingConfig, make_generator

from conftest import tiny_llama

PROMPT = [3, 17, 42, 8, 25]
GREEDY = SamplingConfig(temperature=0)


def greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    """Cache-free greedy decoding: one full forward per token."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(prompt):]


class FixedRowsDrafter(NoRowsDrafter):
    """Proposes the given continuation of the prompt (one-hot draft distributions), EOS or not."""

    def __init__(self, continuation: list[int], vocab: int) -> None:
        super().__init__(vocab, torch.device("cpu"))
        self.continuation = continuation

    def propose(self, rows, limits):
        done = [len(r.sequence) - len(PROMPT) for r in rows]
        return one_hot_draft([self.continuation[d: d + limit] for d, limit in zip(done, limits)], self.vocab_size,
                             self.device)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def _run(target, continuation: list[int], eos: int):
    engine = Engine(ModelRunner(target, rows=0), FixedRowsDrafter(continuation, 64), ExactRule(), gamma=8)
    rid = engine.submit(Request(tuple(PROMPT), GREEDY, max_new_tokens=20, eos_token_ids=frozenset({eos})))
    engine.run()
    return engine.result(rid)


@pytest.mark.parametrize("eos_at", [0, 2, 7])
def test_counters_stop_at_an_accepted_eos(target, eos_at: int):
    """EOS at draft position `eos_at` of an all-accepted 8-token draft: eos_at + 1 tokens are committed; the step counts
    those as accepted (none past the EOS) and all 8 as drafted (the target verified them)."""
    continuation = greedy_continuation(target, PROMPT, 9)
    eos = continuation[eos_at]
    first = continuation.index(eos)  # the cut falls at the first occurrence
    result = _run(target, continuation, eos)
    s = result.stats
    assert result.token_ids == continuation[: first + 1] and result.finish_reason == "eos"
    assert s["steps"] == 1
    assert s["accepted"] == first + 1 and s["drafted"] == 8
    assert s["accepted_per_position"] == [1] * (first + 1) + [0] * (7 - first)
    assert s["drafted_per_position"] == [1] * 8


def test_counters_unchanged_when_the_eos_is_the_bonus_token(target):
    continuation = greedy_continuation(target, PROMPT, 9)
    eos = continuation[8]
    assert eos not in continuation[:8]  # this target's continuation: the bonus token is new
    result = _run(target, continuation, eos)
    assert result.token_ids == continuation
    assert (result.stats["drafted"], result.stats["accepted"], result.stats["new_tokens"]) == (8, 8, 9)


def _rows(sequence):
    return [SimpleNamespace(sequence=list(sequence), request=SimpleNamespace(sampling=GREEDY), grammar=None,
                            generator=make_generator(0))]


def test_model_row_drafter_stops_after_drafting_an_eos():
    draft = tiny_llama(1, layers=1)
    continuation = greedy_continuation(draft, PROMPT, 6)
    eos = continuation[2]
    first = continuation.index(eos)
    plain = ModelRowsDrafter(ModelRunner(draft, rows=0), 64)
    plain.admit(0, PROMPT)
    whole = plain.propose(_rows(PROMPT), [6])
    assert whole.tokens[0].tolist() == continuation
    runner = ModelRunner(draft, rows=0)
    stopping = ModelRowsDrafter(runner, 64, eos_token_ids=frozenset({eos}))
    stopping.admit(0, PROMPT)
    calls = runner.calls
    cut = stopping.propose(_rows(PROMPT), [6])
    assert cut.counts == [first + 1] and cut.tokens[0, : first + 1].tolist() == continuation[: first + 1]
    assert torch.equal(cut.probs[0, : first + 1], whole.probs[0, : first + 1])
    assert runner.calls - calls == first + 1  # no forward past the EOS
    assert runner.lengths[0] == len(PROMPT) + first  # the last drafted token is never fed, as without an EOS


def test_prompt_lookup_stops_after_an_eos():
    eos = 9
    sequence = [1, 2, 3, 4, eos, 5, 6, 1, 2, 3]  # "1 2 3" was followed by 4, EOS, 5, 6
    plain = LookupRowsDrafter(64, torch.device("cpu"), max_ngram=3, min_ngram=1).propose(_rows(sequence), [4])
    assert plain.tokens[0].tolist() == [4, eos, 5, 6]
    cut = LookupRowsDrafter(64, torch.device("cpu"), max_ngram=3, min_ngram=1,
                            eos_token_ids=frozenset({eos})).propose(_rows(sequence), [4])
    assert cut.counts == [2] and cut.tokens[0].tolist() == [4, eos]
    assert cut.probs.shape == (1, 2, 64)
