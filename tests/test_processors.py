"""repetition_penalty and min_new_tokens (transformers' logits processors) on the batched engine:
greedy output equals transformers' generate token for token, speculative methods stay exact at T=0,
sequential methods refuse them with the reason; stream events carry tokens and the final stats."""

from __future__ import annotations

import pytest
import torch

import draftwise
from conftest import tiny_llama
from draftwise.errors import DraftwiseError
from draftwise.models.loading import load_model

PROMPTS = [[3, 17, 42, 8, 25, 3, 17], [5, 6, 5, 6, 5], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def models():
    return load_model(tiny_llama(0, eos=7)), load_model(tiny_llama(1, layers=1, eos=7))


def _hf(model, prompt, **kwargs):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, eos_token_id=7, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("method", ["ar", "sd", "prompt-lookup"])
def test_repetition_penalty_and_min_new_tokens_match_transformers_greedy(models, method):
    target, draft = models
    kwargs = {"draft": draft} if method == "sd" else {}
    for prompt in PROMPTS:
        for penalty, minimum in ((1.3, 0), (0.7, 0), (0.2, 0), (4.0, 0), (1.0, 12), (1.5, 6)):
            ours = draftwise.generate(target, prompt, method=method, temperature=0, max_new_tokens=16,
                                      repetition_penalty=penalty, min_new_tokens=minimum, **kwargs).token_ids
            theirs = _hf(target.model, prompt, max_new_tokens=16, repetition_penalty=penalty, min_new_tokens=minimum)
            assert ours == theirs, (method, prompt, penalty, minimum)


def test_the_penalty_really_changes_the_output(models):
    target, _ = models
    plain = [draftwise.generate(target, p, method="ar", temperature=0, max_new_tokens=16).token_ids for p in PROMPTS]
    penalised = [draftwise.generate(target, p, method="ar", temperature=0, max_new_tokens=16,
                                    repetition_penalty=2.0).token_ids for p in PROMPTS]
    assert plain != penalised


def test_every_method_applies_processors_and_bad_values_are_refused(models):
    target, _ = models
    mtjd = draftwise.generate(target, PROMPTS[0], method="mtjd", k=1, temperature=0, repetition_penalty=1.2,
                              max_new_tokens=12, ignore_eos=True)  # one-token blocks at temperature 0: greedy
    ar = draftwise.generate(target, PROMPTS[0], method="ar", temperature=0, repetition_penalty=1.2,
                            max_new_tokens=12, ignore_eos=True)
    assert mtjd.token_ids == ar.token_ids
    for bad in (0, -1.0, float("nan"), "2"):
        with pytest.raises(DraftwiseError, match="repetition_penalty"):
            draftwise.generate(target, PROMPTS[0], method="ar", repetition_penalty=bad)
    with pytest.raises(DraftwiseError, match="min_new_tokens"):
        draftwise.generate(target, PROMPTS[0], method="ar", min_new_tokens=-1)


def test_stream_events_carry_tokens_text_and_final_stats(models):
    target, draft = models
    whole = draftwise.generate(target, PROMPTS[0], method="sd", draft=draft, temperature=0, max_new_tokens=12)
    events = list(draftwise.stream(target, PROMPTS[0], method="sd", draft=draft, temperature=0, max_new_tokens=12,
                                   events=True))
    assert sum((e.token_ids for e in events), []) == whole.token_ids
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    assert events[-1].finish_reason == whole.stats["finish_reason"]
    assert events[-1].stats["new_tokens"] == whole.stats["new_tokens"]


def test_the_penalty_at_each_drafted_position_counts_the_drafts_before_it():
    """Engine._processed against transformers' processor applied to each prefix (sequence + drafts[:j])."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from draftwise.engine.core import Engine
    from draftwise.engine.protocols import RowsDraft
    from draftwise.engine.step import StepBatch
    from draftwise.engine.rows import Request

    class Row:
        def __init__(self, sequence, penalty):
            self.sequence, self.token_ids = sequence, []
            self.request = Request(tuple(sequence), repetition_penalty=penalty)

    torch.manual_seed(0)
    rows = [Row([1, 2, 3], 1.7), Row([4, 4, 5, 6], 0.5), Row([7], 1.0)]
    tokens = torch.tensor([[8, 9, 8], [1, 1, 2], [3, 0, 0]])
    counts = [3, 2, 1]
    draft = RowsDraft(tokens, torch.zeros(3, 3, 16), counts)
    logits = torch.randn(3, 4, 16)
    engine = Engine.__new__(Engine)
    out = engine._processed(StepBatch.of(rows, draft), draft, logits)
    for b, row in enumerate(rows):
        processor = RepetitionPenaltyLogitsProcessor(row.request.repetition_penalty)
        for j in range(counts[b] + 1):
            prefix = torch.tensor([row.sequence + tokens[b, :j].tolist()])
            expected = processor(prefix, logits[b, j : j + 1].clone())[0]
            assert torch.allclose(out[b, j], expected), (b, j)
