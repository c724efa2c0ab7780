"""SPRINTER's training data with a draft that has a restricted output vocabulary (the pair's 0.5B drafts over 32,768
of 151,936 tokens): every kind of prefix (a-d of SPRINTER §3.2) gives examples, as with a full-vocabulary draft."""

from __future__ import annotations

import dataclasses

import torch

from conftest import tiny_llama


def test_restricted_output_vocabulary_keeps_every_kind():
    from draftwise.models.loading import load_model
    from draftwise.training.verifier import KINDS, VerifierDataConfig, collect

    target = load_model(tiny_llama(0, init=0.08))
    draft = dataclasses.replace(load_model(tiny_llama(1, layers=1, init=0.08)), output_ids=torch.arange(48))
    config = VerifierDataConfig(continuation=8, per_kind=3)
    prompts = [[i, i + 1, i + 2, 5, 6, 7] for i in range(4)]
    data = collect(target, draft, prompts, config, vocab_size=64)
    counts = torch.bincount(data["kind"], minlength=len(KINDS))
    # before the fix the output vocabulary's ids replaced the prompt's: 48 "prompt tokens", so every later kind's
    # prefix range was empty and only kind a (prompt prefixes) was collected
    assert counts.tolist() == [3 * len(prompts)] * len(KINDS), counts.tolist()
    for prompt in range(len(prompts)):
        assert int((data["prompt"] == prompt).sum()) == 3 * len(KINDS)
    # the draft's probability of a token outside its output vocabulary is zero, inside it positive
    assert (data["q_x"] > 0).all()
