"""draftwise's model-free drafters as vLLM proposers (`speculative_config` method `custom_class`).

A team that outgrows one machine keeps draftwise's drafters on vLLM:

    from vllm import LLM
    llm = LLM(model=..., speculative_config={
        "method": "custom_class", "model": "draftwise.integrations.vllm_proposer.SuffixProposer",
        "num_speculative_tokens": 4})

`SuffixProposer` is draftwise's `suffix` method (SuffixDecoding: a per-request suffix trie plus a bounded
global trie of previous outputs); `PromptLookupProposer` is `prompt-lookup` (n-gram continuation of the
request's own text). Options come from the environment variable `DRAFTWISE_VLLM_OPTIONS` as JSON (the
method's options, as `draftwise methods` lists them), else the method's defaults. draftwise must be
importable in vLLM's Python (installed, or on PYTHONPATH). `hybrid` is not offered: its EAGLE head reads
the target's hidden states, which vLLM's custom proposer interface does not pass.

vLLM calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)` once per step for its
batch rows: row i's tokens so far are `token_ids_cpu[i, :num_tokens_no_spec[i]]`. The interface carries no
request ids, so the suffix proposer keeps one trie per batch row and recognises a new request in a row by
its tokens no longer extending the row's previous ones; the request that left gives its output to the
global trie.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

OPTIONS_ENV = "DRAFTWISE_VLLM_OPTIONS"


def _options(method: str) -> dict[str, Any]:
    from draftwise.methods import METHODS

    given = json.loads(os.environ.get(OPTIONS_ENV) or "{}")
    if not isinstance(given, dict):
        raise ValueError(f"{OPTIONS_ENV} must be a JSON object of {method}'s options, got {given!r}")
    return METHODS[method].resolve_options(given)


class _Proposer:
    """What both proposers share: vLLM's constructor and call shape."""

    method = ""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.options = _options(self.method)
        self.proposed = 0  # draft tokens proposed (for tests and logs)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's CPU runner calls this on every drafter; there is no model."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, *args: Any, **kwargs: Any) -> list[list[int]]:
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not len(sampled) or n >= self.max_model_len:  # nothing sampled this step, or no room left
                drafts.append([])
                continue
            draft = [int(t) for t in self.draft(i, token_ids_cpu[i, :n], min(self.k, self.max_model_len - n))]
            self.proposed += len(draft)
            drafts.append(draft)
        return drafts

    def draft(self, row: int, tokens: np.ndarray, limit: int) -> list[int]:
        raise NotImplementedError


class PromptLookupProposer(_Proposer):
    """draftwise's `prompt-lookup`: the tokens that followed the most recent earlier occurrence of the text's
    last n-gram (n from max_ngram down to min_ngram)."""

    method = "prompt-lookup"

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.ngrams = {"max_ngram": self.options["max_ngram"], "min_ngram": self.options["min_ngram"]}

    def draft(self, row: int, tokens: np.ndarray, limit: int) -> list[int]:
        from draftwise.drafters.lookup import prompt_lookup

        return prompt_lookup(tokens.tolist(), limit, **self.ngrams)


class SuffixProposer(_Proposer):
    """draftwise's `suffix`: per-request and global suffix tries, the better-scoring speculation wins."""

    method = "suffix"

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        from draftwise.methods import suffix_options
        from draftwise.drafters.suffix import GlobalSuffix

        self.suffix = suffix_options(self.options)
        self.store = GlobalSuffix(self.suffix.depth, self.suffix.global_tokens)
        self.rows: dict[int, Any] = {}  # batch row -> RequestSuffix

    def _state(self, row: int, tokens: np.ndarray) -> Any:
        from draftwise.drafters.suffix import RequestSuffix

        state = self.rows.get(row)
        seen = len(state.tokens) if state is not None else 0
        if state is not None and (seen > len(tokens) or not np.array_equal(tokens[:seen], state.prefix)):
            self.store.add(state.tokens[state.prompt_length:])  # another request took the row
            state = None
        if state is None:
            state = RequestSuffix(self.suffix.depth, self.store.trie)
            state.prompt_length = len(tokens)
            state.prefix = np.empty(0, dtype=tokens.dtype)
            self.rows[row] = state
        new = tokens[len(state.tokens):]
        state.extend(new.tolist())
        state.prefix = np.concatenate([state.prefix, new])
        return state

    def draft(self, row: int, tokens: np.ndarray, limit: int) -> list[int]:
        from draftwise.drafters.suffix import best_speculation

        state = self._state(row, tokens)
        return best_speculation(state.matches(), limit, self.suffix)[0]
