"""OpenAI's frequency_penalty, presence_penalty and logit_bias on the engine: the target's logits lose
frequency x count + presence x [count > 0] over the tokens this request generated and gain each biased token's
bias; greedy output equals a one-token-at-a-time reference, speculative methods stay exact at T=0, and a row's
processing reads only its own tokens (a batch-mate with other penalties, or none, changes nothing)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import draftwise
from conftest import tiny_llama
from draftwise.errors import DraftwiseError
from draftwise.models.loading import load_model

PROMPTS = [[3, 17, 42, 8, 25, 3, 17], [5, 6, 5, 6, 5], [9, 10, 11, 12]]
NEW = 16


@pytest.fixture(scope="module")
def models():
    return load_model(tiny_llama(0, eos=7)), load_model(tiny_llama(1, layers=1, eos=7))


def _reference(model, prompt, *, frequency=0.0, presence=0.0, bias=None, new=NEW):
    """Greedy decoding one token at a time with OpenAI's rule applied by hand (ignore_eos)."""
    ids, made = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(made, dtype=torch.long), minlength=logits.shape[-1]).float() \
                if made else torch.zeros_like(logits)
            logits = logits - frequency * counts - presence * (counts > 0).float()
            for token, value in (bias or {}).items():
                logits[token] += value
            token = int(logits.argmax())
            ids.append(token)
            made.append(token)
    return made


@pytest.mark.parametrize("method", ["ar", "sd", "prompt-lookup"])
def test_penalties_and_bias_match_a_one_token_reference_at_t0(models, method):
    target, draft = models
    kwargs = {"draft": draft} if method == "sd" else {}
    for prompt in PROMPTS:
        for frequency, presence, bias in ((1.5, 0.0, None), (0.0, 2.0, None), (0.8, 0.5, {11: 3.0, 5: -2.0}),
                                          (-0.5, 0.0, None), (0.0, 0.0, {prompt[0]: 4.0})):
            ours = draftwise.generate(target, prompt, method=method, temperature=0, max_new_tokens=NEW,
                                      ignore_eos=True, frequency_penalty=frequency, presence_penalty=presence,
                                      logit_bias=bias, **kwargs).token_ids
            assert ours == _reference(target.model, prompt, frequency=frequency, presence=presence, bias=bias), \
                (method, prompt, frequency, presence, bias)


def test_the_penalties_really_change_the_output_and_zero_changes_nothing(models):
    """The negative control: at 0 (and an empty bias) the output is the plain one; at strong values it is not."""
    target, _ = models

    def run(**kwargs):
        return [draftwise.generate(target, p, method="ar", temperature=0, max_new_tokens=NEW, ignore_eos=True,
                                   **kwargs).token_ids for p in PROMPTS]

    plain = run()
    assert run(frequency_penalty=0.0, presence_penalty=0, logit_bias={}) == plain
    assert run(frequency_penalty=5.0) != plain
    assert run(presence_penalty=5.0) != plain
    # a strong positive bias makes a token the only greedy choice; a strong negative one bans the plain choice
    assert all(set(ids) == {13} for ids in run(logit_bias={13: 100.0}))
    banned = {ids[0]: -100.0 for ids in plain}
    assert all(not set(ids) & set(banned) for ids in run(logit_bias=banned))
    # the penalties count generated tokens only: a prompt full of a token does not ban it
    presence = run(presence_penalty=100.0)
    assert all(len(set(ids)) == len(ids) for ids in presence)  # nothing generated twice


def test_a_rows_penalties_never_depend_on_its_batch_mates(models):
    """Rows with different penalties (and none) in one engine give what each gives alone."""
    from draftwise.builder import build_engine
    from draftwise.plan import make_plan, request_for

    target, draft = models
    settings = [dict(frequency_penalty=2.0), dict(), dict(presence_penalty=3.0, logit_bias=((4, 2.5),)),
                dict(logit_bias=((13, 50.0),))]

    def requests(plan):
        return [dataclasses.replace(request_for(plan, PROMPTS[i % len(PROMPTS)]), **s) for i, s in enumerate(settings)]

    for method in ("ar", "sd"):
        plan = make_plan(target=target, prompt=PROMPTS[0], draft=draft if method == "sd" else None, method=method,
                         max_new_tokens=NEW, temperature=0.0, top_k=0, top_p=1.0, seed=0, gamma=4, stop=None,
                         ignore_eos=True, method_options={})
        together = build_engine(plan, 4)
        ids = [together.submit(r) for r in requests(plan)]
        together.run()
        batched = [together.result(i).token_ids for i in ids]
        for request, got in zip(requests(plan), batched):
            alone = build_engine(plan, 1)
            only = alone.submit(request)
            alone.run()
            assert alone.result(only).token_ids == got, (method, request)
            expected = _reference(target.model, list(request.prompt_ids), frequency=request.frequency_penalty,
                                  presence=request.presence_penalty, bias=dict(request.logit_bias))
            assert got == expected, (method, request)
        assert batched[3] == [13] * NEW and batched[0] != batched[1 % len(batched)]  # they did differ


def test_each_drafted_position_counts_the_drafts_before_it():
    from draftwise.engine.core import Engine
    from draftwise.engine.protocols import RowsDraft
    from draftwise.engine.step import StepBatch
    from draftwise.engine.rows import Request

    class Row:
        def __init__(self, sequence, made, **penalties):
            self.sequence, self.token_ids = sequence + made, made
            self.request = Request(tuple(sequence), **penalties)

    torch.manual_seed(0)
    rows = [Row([1, 2, 3], [8, 8], frequency_penalty=0.7), Row([4, 4], [5], presence_penalty=1.3),
            Row([7], [], logit_bias=((2, 1.5), (9, -4.0))), Row([6], [6])]
    tokens = torch.tensor([[8, 9, 8], [1, 5, 2], [3, 0, 0], [6, 6, 0]])
    counts = [3, 2, 1, 2]
    draft = RowsDraft(tokens, torch.zeros(4, 3, 16), counts)
    logits = torch.randn(4, 4, 16)
    out = Engine.__new__(Engine)._processed(StepBatch.of(rows, draft), draft, logits)
    for b, row in enumerate(rows):
        request = row.request
        for j in range(counts[b] + 1):
            made = torch.bincount(torch.tensor(row.token_ids + tokens[b, :j].tolist(), dtype=torch.long),
                                  minlength=16).float()
            expected = logits[b, j] - request.frequency_penalty * made - request.presence_penalty * (made > 0).float()
            for token, value in request.logit_bias:
                expected[token] += value
            assert torch.allclose(out[b, j], expected), (b, j)
    assert torch.equal(out[3], logits[3])  # a row with no processors is untouched


def test_bad_values_are_refused_by_name(models):
    target, _ = models
    for kwargs, name in ((dict(frequency_penalty=float("nan")), "frequency_penalty"),
                         (dict(presence_penalty="1"), "presence_penalty"),
                         (dict(logit_bias={"x": 1.0}), "logit_bias"),
                         (dict(logit_bias={10**6: 1.0}), "logit_bias"),
                         (dict(logit_bias={3: float("inf")}), "logit_bias"),
                         (dict(logit_bias=[3, 1.0]), "logit_bias")):
        with pytest.raises(DraftwiseError, match=name):
            draftwise.generate(target, PROMPTS[0], method="ar", temperature=0, max_new_tokens=2, **kwargs)
    # OpenAI's string keys are token ids too
    assert draftwise.generate(target, PROMPTS[0], method="ar", temperature=0, max_new_tokens=3, ignore_eos=True,
                              logit_bias={"13": 100}).token_ids == [13, 13, 13]
