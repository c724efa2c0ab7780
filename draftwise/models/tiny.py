"""Tiny random models and a tiny tokenizer, built in-process (no downloads): what the tests, the server's soak run
and other self-checks decode with when the figure is draftwise's own work, not a model's.

`tiny_llama(seed)` is a random Llama (64-token vocabulary by default), `tiny_tokenizer()` a byte-level BPE trained
deterministically on CORPUS, `save_pair(root)` the two saved as a target and a draft (Hugging Face folders), and
`word_prompt(i)` the i-th of many short prompts spelled in the corpus's words.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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


def byte_level_bpe(corpus, alphabet, vocab: int) -> PreTrainedTokenizerFast:
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
    return byte_level_bpe(CORPUS, sorted(pre_tokenizers.ByteLevel.alphabet())[:40], vocab)  # a set: sorted


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


WORDS = "the cat sat on mat and dog log a small draft model proposes large target accepts tiny fast".split()


def word_prompt(i: int) -> str:
    """The i-th short prompt (3 to 6 of the corpus's WORDS): many different prompts the tiny tokenizer spells well."""
    return " ".join(WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(3 + i % 4))
