"""Tiny random models and a tiny tokenizer, built in-process (no downloads)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# Tiny models gain nothing from threads, and on a 2-core machine two processes with
# 2 threads each slow each other down many times over.
torch.set_num_threads(1)

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "speculative decoding drafts tokens and the target verifies them",
    "a small draft model proposes and a large target model accepts or rejects",
    "once upon a time there was a tiny model that decoded very fast",
] * 4


def tiny_llama(seed: int, *, vocab: int = 64, layers: int = 2, width: int = 64, init: float = 0.5,
               window: int = 256, eos: int | None = None) -> LlamaForCausalLM:
    """A random Llama. `init` scales the weights: 0.5 gives peaked, model-specific distributions."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=window,
        bos_token_id=None, eos_token_id=eos, pad_token_id=None, initializer_range=init, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


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


def _byte_level_bpe(corpus, alphabet, vocab: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly `vocab` entries ("</s>" first, then the alphabet and every character of the
    corpus, then merges), trained here deterministically: the most frequent adjacent pair first, ties broken by the
    pair itself. (tokenizers' BpeTrainer breaks ties by hash order, which changes from process to process: the
    tiny tokenizer, and with it every tiny model's tokens, differed between runs.)"""
    from collections import Counter

    split = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = Counter(tuple(piece) for text in corpus for piece, _ in split.pre_tokenize_str(text))
    symbols = sorted(set(alphabet) | {c for word in words for c in word})
    table = {"</s>": 0, **{c: i + 1 for i, c in enumerate(symbols)}}
    merges = []
    while len(table) < vocab:
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        joined = best[0] + best[1]
        merges.append(best)
        table.setdefault(joined, len(table))
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    tok = Tokenizer(models.BPE(vocab=table, merges=merges))
    tok.pre_tokenizer = split
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def tiny_tokenizer(vocab: int = 64) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly `vocab` entries (incl. one end-of-sequence token) trained on CORPUS, the same in
    every run."""
    return _byte_level_bpe(CORPUS, sorted(pre_tokenizers.ByteLevel.alphabet())[:40], vocab)  # a set: sorted


def save_pair(root, *, window: int = 256, init: float = 0.5) -> tuple[str, str]:
    """The tiny target (seed 0, 2 layers) and draft (seed 1, 1 layer) saved under `root` as Hugging Face
    directories with the tiny tokenizer: (target_dir, draft_dir)."""
    tok = tiny_tokenizer(64)
    dirs = []
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        tiny_llama(seed, layers=layers, init=init, window=window).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs.append(str(root / name))
    return dirs[0], dirs[1]


@pytest.fixture(scope="session")
def llama_pair():
    """(target, draft): two different tiny Llamas with the same 64-token vocabulary."""
    return tiny_llama(0), tiny_llama(1, layers=1)


JSON_CORPUS = ['{"a": true, "b": "cat"}', '{"a": false, "b": "dog"}', '{"b": "cat", "a": false}',
               '{"n": 10, "m": [1, 2, 3]}', '{"name": "tiny model", "ok": null}'] * 4


def json_tokenizer(vocab: int = 64) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly `vocab` entries whose alphabet spells JSON (braces, quotes, digits, a few
    letters), for grammar tests; one end-of-sequence token."""
    return _byte_level_bpe(JSON_CORPUS, list('{}[]":,0123456789abcdefglmnorstuy') + ["Ġ"], vocab)


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
