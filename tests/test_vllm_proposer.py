"""draftwise's drafters as vLLM `custom_class` proposers.

Fast: the proposers are checked directly against draftwise's own drafters on vLLM's call shape (rows of a
token array, a new request taking a row). Slow (opt-in, `make test-slow`): vLLM's CPU build decodes with
them and its acceptance is compared with draftwise's on the same prompts (draftwise/bench/peers/plugin.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from draftwise.drafters.lookup import prompt_lookup
from draftwise.methods import METHODS, suffix_options
from draftwise.drafters.suffix import SuffixRowsDrafter
from draftwise.integrations.vllm_proposer import PromptLookupProposer, SuffixProposer


def _config(k=4, max_len=64):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_len))


def _batch(sequences, width=64):
    tokens = np.zeros((len(sequences), width), dtype=np.int64)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
    return tokens, np.array([len(s) for s in sequences])


SEQUENCES = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8], [5, 5, 5, 5, 5, 5]]


def test_prompt_lookup_proposer_equals_the_drafter():
    proposer = PromptLookupProposer(_config())
    tokens, counts = _batch(SEQUENCES)
    out = proposer.propose([[1]] * 3, counts, tokens)
    options = METHODS["prompt-lookup"].resolve_options({})
    assert out == [prompt_lookup(s, 4, max_ngram=options["max_ngram"], min_ngram=options["min_ngram"])
                   for s in SEQUENCES]
    assert out[0] == [4, 5, 1, 2]
    assert proposer.propose([[], [1], [1]], counts, tokens)[0] == []  # nothing sampled: nothing drafted


class Row:
    def __init__(self, sequence):
        self.sequence = sequence


def test_suffix_proposer_equals_the_rows_drafter_as_tokens_commit_and_rows_change_hands():
    proposer = SuffixProposer(_config())
    ours = SuffixRowsDrafter(64, torch.device("cpu"), suffix_options(METHODS["suffix"].resolve_options({})))
    sequences = [list(s) for s in SEQUENCES]
    for b, s in enumerate(sequences):
        ours.admit(b, s)
    for step in range(6):
        tokens, counts = _batch(sequences)
        theirs = proposer.propose([[1]] * 3, counts, tokens)
        mine, _ = ours.speculate([Row(s) for s in sequences], [4, 4, 4])
        assert theirs == mine, step
        for s in sequences:  # commit the first drafted token, or a fresh one
            s.append((s[-1] * 3 + step) % 11)
    # a new request takes row 1: its trie starts afresh, the old request's output joins the global store
    sequences[1] = [2, 4, 6, 2, 4]
    tokens, counts = _batch(sequences)
    before = proposer.store.size
    proposer.propose([[1]] * 3, counts, tokens)
    state = proposer.rows[1]
    assert state.tokens == [2, 4, 6, 2, 4] and state.prompt_length == 5
    assert proposer.store.size == before + 5  # the old request's tokens it saw after its prompt (the last one
    # appended after step 6 was never proposed on)


@pytest.mark.slow
def test_vllm_decodes_with_the_proposers_and_accepts_as_draftwise_does():
    from draftwise.bench.peers import PEERS
    from draftwise.bench.peers.plugin import compare

    if not (PEERS / "vllm" / "bin" / "python").exists():
        pytest.skip("vLLM's CPU build is not installed in .peers/vllm (`make bench-peers` installs it)")
    report = compare(max_new_tokens=64, gamma=4, num_prompts=4)
    for method in ("prompt-lookup", "suffix"):
        ours, theirs = report[method]["draftwise"], report[method]["vllm"]
        assert theirs["drafted"] > 0
        assert abs(ours["acceptance_rate"] - theirs["acceptance_rate"]) < 0.1, report[method]
