"""Test helpers: the package's tiny models (draftwise/models/tiny.py) and a few more, fixtures, a sampler shortcut."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from draftwise.models.tiny import byte_level_bpe, save_pair, tiny_llama, tiny_tokenizer  # noqa: F401 (for tests)

# Tiny models gain nothing from threads, and on a 2-core machine two processes with
# 2 threads each slow each other down many times over.
torch.set_num_threads(1)


def tiny_gpt2(seed: int, *, vocab: int = 64, layers: int = 2, width: int = 64, init: float = 0.5,
              window: int = 256) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab, n_embd=width, n_layer=layers, n_head=4, n_positions=window,
        bos_token_id=None, eos_token_id=None, initializer_range=init,
    )
    return GPT2LMHeadModel(config).eval()


def near_copy(model, scale: float = 0.02, seed: int = 5):
    """The model with every weight perturbed by `scale` of its std: a draft that agrees often, not always."""
    import copy

    near = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return near


@pytest.fixture(scope="session")
def llama_pair():
    """(target, draft): two different tiny Llamas with the same 64-token vocabulary."""
    return tiny_llama(0), tiny_llama(1, layers=1)


JSON_CORPUS = ['{"a": true, "b": "cat"}', '{"a": false, "b": "dog"}', '{"b": "cat", "a": false}',
               '{"n": 10, "m": [1, 2, 3]}', '{"name": "tiny model", "ok": null}'] * 4


def json_tokenizer(vocab: int = 64) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly `vocab` entries whose alphabet spells JSON (braces, quotes, digits, a few
    letters), for grammar tests; one end-of-sequence token."""
    return byte_level_bpe(JSON_CORPUS, list('{}[]":,0123456789abcdefglmnorstuy') + ["Ġ"], vocab)


def speculative_sample(draft_tokens, draft_probs, pi, bonus_probs, generator):
    """One row through the engine's sampler (`batched.speculative_sample_rows`, Algorithm 4): draft_tokens [k],
    draft_probs and pi [k, vocab], bonus_probs [vocab] or a callable giving it (called only when every drafted token
    was accepted). Returns num_drafted, num_accepted, next_token and bonus (whether next_token is the bonus)."""
    from types import SimpleNamespace

    from draftwise.engine.sampler import speculative_sample_rows

    k = int(draft_tokens.shape[0])

    def rows(probs):  # [vocab] -> [1, k + 1, vocab], the bonus at position k
        out = torch.zeros(1, k + 1, probs.shape[-1], dtype=probs.dtype, device=probs.device)
        out[0, k] = probs
        return out

    if callable(bonus_probs):
        width = pi.shape[-1]

        def bonus(needed):
            if not bool(needed.any()):
                return torch.zeros(1, k + 1, width, dtype=pi.dtype, device=pi.device)
            return rows(bonus_probs())
    else:
        bonus = rows(bonus_probs)
    outcome = speculative_sample_rows(draft_tokens[None], draft_probs[None], pi[None], bonus, [k], [generator])
    accepted = int(outcome.num_accepted[0])
    return SimpleNamespace(num_drafted=k, num_accepted=accepted, next_token=int(outcome.next_tokens[0]),
                           bonus=accepted == k)


def sweep(values, keep, ids=None):
    """Parameters for a statistical sweep: the values whose index is in `keep` run in `make test`; the rest are
    marked slow (`make test-slow` runs them), so that the default suite proves each method once per family within
    its time budget and the full sweep stays one command away."""
    out = []
    for i, value in enumerate(values):
        args = value if isinstance(value, tuple) else (value,)
        name = None if ids is None else ids(value)
        out.append(pytest.param(*args, id=name, marks=() if i in keep else pytest.mark.slow))
    return out
