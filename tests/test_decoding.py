"""The decoding loop's bookkeeping at an end-of-sequence token, and drafters stopping at one.

A drafter that proposes the target's own greedy continuation has every token accepted at
temperature 0, so where the EOS falls in the draft is chosen exactly by the test.
"""

from __future__ import annotations

import pytest
import torch

from draftwise.acceptance import ExactRule
from draftwise.decoding import Counters, Limits, decode
from draftwise.drafters import Draft, ModelDrafter, PromptLookupDrafter
from draftwise.models.runner import ModelRunner
from draftwise.sampling import SamplingConfig, make_generator

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


class FixedDrafter:
    """Proposes the given continuation of the prompt (one-hot draft distributions), EOS or not."""

    calls = 0

    def __init__(self, prompt: list[int], continuation: list[int], vocab: int) -> None:
        self.prompt, self.continuation, self.vocab = prompt, continuation, vocab

    def propose(self, sequence, max_tokens, generator) -> Draft:
        done = len(sequence) - len(self.prompt)
        tokens = torch.tensor(self.continuation[done : done + max_tokens], dtype=torch.long)
        return Draft(tokens, torch.nn.functional.one_hot(tokens, self.vocab).float())

    def rewind(self, keep: int) -> None:
        pass


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.mark.parametrize("eos_at", [0, 2, 7])
def test_counters_stop_at_an_accepted_eos(target, eos_at: int):
    """EOS at draft position `eos_at` of an all-accepted 8-token draft: eos_at + 1 tokens are committed,
    and the step counts exactly those as drafted and accepted (not 8)."""
    continuation = greedy_continuation(target, PROMPT, 9)
    eos = continuation[eos_at]
    first = continuation.index(eos)  # the cut falls at the first occurrence
    counters = Counters(gamma=8)
    steps = list(decode(PROMPT, target=ModelRunner(target), drafter=FixedDrafter(PROMPT, continuation, 64),
                        rule=ExactRule(), sampling=GREEDY, gamma=8, limits=Limits(20, frozenset({eos})),
                        generator=make_generator(0), counters=counters))
    assert steps == [continuation[: first + 1]]
    assert counters.new_tokens == first + 1
    assert counters.steps == 1
    assert counters.accepted == counters.drafted == first + 1
    assert counters.accepted_per_position == [1] * (first + 1) + [0] * (7 - first)
    assert counters.drafted_per_position == counters.accepted_per_position


def test_counters_unchanged_when_the_eos_is_the_bonus_token(target):
    continuation = greedy_continuation(target, PROMPT, 9)
    eos = continuation[8]
    if eos in continuation[:8]:
        pytest.skip("the bonus token also occurs in the draft")
    counters = Counters(gamma=8)
    steps = list(decode(PROMPT, target=ModelRunner(target), drafter=FixedDrafter(PROMPT, continuation, 64),
                        rule=ExactRule(), sampling=GREEDY, gamma=8, limits=Limits(20, frozenset({eos})),
                        generator=make_generator(0), counters=counters))
    assert steps == [continuation]
    assert (counters.drafted, counters.accepted, counters.new_tokens) == (8, 8, 9)


def test_model_drafter_stops_after_drafting_an_eos():
    draft = tiny_llama(1, layers=1)
    continuation = greedy_continuation(draft, PROMPT, 6)
    eos = continuation[2]
    first = continuation.index(eos)
    plain = ModelDrafter(ModelRunner(draft), GREEDY, 64).propose(PROMPT, 6, make_generator(0))
    assert plain.tokens.tolist() == continuation
    runner = ModelRunner(draft)
    stopping = ModelDrafter(runner, GREEDY, 64, eos_token_ids={eos}).propose(PROMPT, 6, make_generator(0))
    assert stopping.tokens.tolist() == continuation[: first + 1]
    assert torch.equal(stopping.probs, plain.probs[: first + 1])
    assert runner.calls == first + 1  # no forward past the EOS
    assert runner.length == len(PROMPT) + first  # the last drafted token is never fed, as without an EOS


def test_prompt_lookup_stops_after_an_eos():
    eos = 9
    sequence = [1, 2, 3, 4, eos, 5, 6, 1, 2, 3]  # "1 2 3" was followed by 4, EOS, 5, 6
    assert PromptLookupDrafter(64, torch.device("cpu")).propose(sequence, 4, None).tokens.tolist() == [4, eos, 5, 6]
    drafter = PromptLookupDrafter(64, torch.device("cpu"), eos_token_ids={eos})
    draft = drafter.propose(sequence, 4, None)
    assert draft.tokens.tolist() == [4, eos]
    assert draft.probs.shape == (2, 64)
