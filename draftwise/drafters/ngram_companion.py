"""An n-gram companion for Speculative Verification: the companion's distributions from counted n-grams.

SV (Kim et al.) reads a companion model's distribution at every drafted position; `CompanionRowsDrafter` asks the
companion's runner for them. A model companion costs a forward per step. This one counts n-grams instead, over

- the row's own context (its prompt and output so far, with the drafted tokens it is fed), as prompt lookup and
  suffix decoding do, and
- optionally a corpus: the target's own answers (`training/answers.py` chunks, e.g. data/answers/<target>),

and returns, at each wanted position, Witten-Bell interpolated probabilities of orders 1..`order` (unigram to
`order - 1` tokens of context) over a uniform floor:

    P_n(w | h) = (c(h, w) + T(h) P_{n-1}(w | h')) / (c(h) + T(h)),   P_0(w) = 1 / V,

c the row's counts plus the corpus's, T(h) the distinct tokens seen after h, h' the context one token shorter.
Every token keeps probability > 0 (the floor), so the draft-companion ratios SV reads (S, A) are always defined. The
distribution at fed position j counts only tokens up to j: whether SV verifies drafted token i must not depend on
token i (tests/test_sv.py explains why), and the companion's view of it is computed before it.

`NgramRunner` has the `ModelRunner` surface that `CompanionRowsDrafter` and `bench.sv_profile` use (forward_rows,
trim_row, lengths, calls, cache.reset_row / move_row / drop_rows / fit). `NgramCompanion` stands where a loaded
companion model does (name, tokenizer, vocab_size, device); `load_companion` resolves a companion spec:

- `ngram`: the row's context only;
- `ngram:DIR`: plus the answers in DIR;
- a registry name whose entry is an n-gram companion (`qwen2.5-coder-1.5b-ngram`: the 1.5B's own answers);
- anything else: a model, by `load_model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from draftwise.errors import DraftwiseError

ORDER = 4  # unigram to 3 tokens of context
NGRAM = "ngram"
_FLOOR_ONLY = (0.0, 1.0)  # (alpha, beta x V) of a position with nothing counted: uniform


class Counts:
    """n-gram counts of some token sequences: unigrams (sparse) and, per context of 1 .. order - 1 tokens, the
    tokens seen after it."""

    def __init__(self, order: int) -> None:
        self.order = order
        self.unigrams: dict[int, int] = {}
        self.total = 0
        self.following: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, tokens: Sequence[int], end: int) -> None:
        """Count tokens[end - 1] (the last of the first `end`) with its contexts."""
        token = tokens[end - 1]
        self.unigrams[token] = self.unigrams.get(token, 0) + 1
        self.total += 1
        for n in range(1, min(self.order, end)):
            after = self.following.setdefault(tuple(tokens[end - 1 - n: end - 1]), {})
            after[token] = after.get(token, 0) + 1

    def remove(self, tokens: Sequence[int], end: int) -> None:
        """Undo `add(tokens, end)`."""
        token = tokens[end - 1]
        _decrement(self.unigrams, token)
        self.total -= 1
        for n in range(1, min(self.order, end)):
            context = tuple(tokens[end - 1 - n: end - 1])
            after = self.following[context]
            _decrement(after, token)
            if not after:
                del self.following[context]

    def copy(self) -> "Counts":
        out = Counts(self.order)
        out.unigrams, out.total = dict(self.unigrams), self.total
        out.following = {h: dict(after) for h, after in self.following.items()}
        return out


def _decrement(counts: dict[int, int], token: int) -> None:
    left = counts[token] - 1
    if left:
        counts[token] = left
    else:
        del counts[token]


@dataclass
class Corpus:
    """Counts over fixed sequences (the target's answers), shared by every row; unigrams also as tensors."""

    counts: Counts
    ids: torch.Tensor  # [types] sorted token ids seen
    counts_vector: torch.Tensor  # [types] float32: their counts
    sequences: int = 0

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], order: int, vocab_size: int) -> "Corpus":
        counts, n = Counts(order), 0
        for seq in sequences:
            seq = [t for t in seq if 0 <= t < vocab_size]
            for end in range(1, len(seq) + 1):
                counts.add(seq, end)
            n += 1
        ids = sorted(counts.unigrams)
        return cls(counts, torch.tensor(ids, dtype=torch.long),
                   torch.tensor([counts.unigrams[t] for t in ids], dtype=torch.float32), n)


@dataclass
class _RowState:
    tokens: list[int] = field(default_factory=list)
    counts: Counts = field(default_factory=lambda: Counts(ORDER))
    new_types: int = 0  # distinct tokens of the row the corpus never saw

    def copy(self) -> "_RowState":
        return _RowState(list(self.tokens), self.counts.copy(), self.new_types)


class _Rows:
    """The runner's per-row state, with the cache methods the companion drafter calls."""

    def __init__(self, order: int) -> None:
        self.order = order
        self.states: list[_RowState] = []

    @property
    def lengths(self) -> list[int]:
        return [len(s.tokens) for s in self.states]

    def ensure(self, rows: int) -> None:
        while len(self.states) < rows:
            self.states.append(_RowState(counts=Counts(self.order)))

    def reset_row(self, row: int) -> None:
        self.ensure(row + 1)
        self.states[row] = _RowState(counts=Counts(self.order))

    def move_row(self, src: int, dst: int) -> None:
        self.ensure(dst + 1)
        if src != dst:
            self.states[dst] = self.states[src].copy()

    def drop_rows(self, keep: int) -> None:
        del self.states[keep:]

    def fit(self) -> None:
        """Nothing to cut: the state is the rows' tokens and counts."""


@dataclass(frozen=True)
class NgramOutput:
    logits: torch.Tensor  # [rows, m, vocab] log-probabilities (the runner's buffer: read before its next call)
    hidden: None = None


class NgramRunner:
    """A companion runner whose logits are log n-gram probabilities (see the module's docstring)."""

    def __init__(self, vocab_size: int, *, corpus: Corpus | None = None, order: int = ORDER,
                 device: torch.device | str = "cpu") -> None:
        if order < 1:
            raise DraftwiseError(f"n-gram order must be >= 1, got {order}")
        if corpus is not None and corpus.counts.order < order:
            raise DraftwiseError(f"the corpus was counted to order {corpus.counts.order}, not {order}")
        self.vocab_size = vocab_size
        self.order = order
        self.corpus = corpus
        self.device = torch.device(device)
        self.cache = _Rows(order)
        self.calls = 0
        self.tokens_processed = 0
        # the logits buffer, reused: a fresh [rows, m, vocab] tensor a call costs more than filling it (page faults
        # on 48 MB at batch 16 and Qwen's vocabulary); a call's logits are valid until the next call
        self._out: torch.Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    def trim_row(self, row: int, keep: int) -> None:
        state = self.cache.states[row]
        if not 0 <= keep <= len(state.tokens):
            raise ValueError(f"cannot trim row {row} of {len(state.tokens)} tokens to {keep}")
        while len(state.tokens) > keep:
            self._pop(state)

    def forward_rows(self, tokens: torch.Tensor, counts: Sequence[int], *, begin: int = 0,
                     logits_at: torch.Tensor | None = None, hidden: bool = False, prompt: bool | int = False,
                     tree: Any = None) -> NgramOutput:
        """Feed `counts[i]` tokens (row i of `tokens` [rows, width], right-padded) to row `begin + i`; logits
        [rows, m, vocab] at `logits_at` [rows, m] (positions within the fed tokens; default all `width`). A
        position past a row's fed tokens (padding) gets the uniform distribution."""
        assert tokens.ndim == 2 and tokens.shape[0] == len(counts), (tokens.shape, len(counts))
        if hidden or tree is not None:
            raise DraftwiseError("the n-gram companion has no hidden states and reads no token trees")
        counts = [int(c) for c in counts]
        if min(counts) < 1:
            raise ValueError("NgramRunner.forward_rows needs at least one token per row")
        rows, width = tokens.shape
        fed = tokens.tolist()
        wanted = logits_at.tolist() if logits_at is not None else [list(range(width))] * rows
        m = len(wanted[0]) if rows else 0
        self.calls += 1
        self.tokens_processed += sum(counts)
        self.cache.ensure(begin + rows)
        if self._out is None or self._out.shape != (rows, m, self.vocab_size):
            self._out = torch.empty(rows, m, self.vocab_size)
        for b in range(rows):
            self._row_logits(self.cache.states[begin + b], fed[b][: counts[b]], [int(p) for p in wanted[b]],
                             self._out[b])
        return NgramOutput(self._out if self.device.type == "cpu" else self._out.to(self.device))

    def _row_logits(self, state: _RowState, fed: list[int], wanted: list[int], out: torch.Tensor) -> None:
        """Feed `fed` to a row; writes log-probabilities at those positions of `fed` to `out` [len(wanted), vocab].

        Each distribution is alpha x (unigram counts before this call) + beta / V + sparse extras (`_mixture`): it
        is beta / V at every token neither the corpus nor the row has seen, so only the tokens seen (the support)
        are computed; the rest of the vocabulary is one fill."""
        m, vocab = len(wanted), self.vocab_size
        row_ids = torch.tensor(list(state.counts.unigrams), dtype=torch.long)  # counts before this call
        row_counts = torch.tensor(list(state.counts.unigrams.values()), dtype=torch.float32)
        by_position: dict[int, list[int]] = {}
        for q, position in enumerate(wanted):
            by_position.setdefault(position, []).append(q)
        alpha, beta = [_FLOOR_ONLY[0]] * m, [_FLOOR_ONLY[1]] * m  # a position past the fed tokens: uniform
        extra_q: list[int] = []
        extra_token: list[int] = []
        extra_value: list[float] = []
        added: dict[int, int] = {}  # tokens counted in this call (not in row_counts)
        for j, token in enumerate(fed):
            self._push(state, token)
            added[token] = added.get(token, 0) + 1
            if j in by_position:
                a, bv, extra = self._mixture(state, added)
                for q in by_position[j]:
                    alpha[q], beta[q] = a, bv
                    extra_q.extend([q] * len(extra))
                    extra_token.extend(extra)
                    extra_value.extend(extra.values())
        parts = [row_ids, torch.tensor(fed, dtype=torch.long)]
        if self.corpus is not None:
            parts.append(self.corpus.ids)
        support = torch.unique(torch.cat(parts))  # sorted
        support = support[support < vocab]
        base = torch.zeros(len(support))  # [support] unigram counts before this call
        keep = row_ids < vocab
        base[torch.searchsorted(support, row_ids[keep])] += row_counts[keep]
        if self.corpus is not None:
            base[torch.searchsorted(support, self.corpus.ids)] += self.corpus.counts_vector
        alpha_t = torch.tensor(alpha, dtype=torch.float64).float()[:, None]
        floor = torch.tensor(beta, dtype=torch.float64).float()[:, None] / vocab  # [m, 1]
        probs = alpha_t * base[None] + floor  # [m, support]
        if extra_q:
            probs.index_put_((torch.tensor(extra_q), torch.searchsorted(support, torch.tensor(extra_token))),
                             torch.tensor(extra_value, dtype=torch.float32), accumulate=True)
        out.copy_(floor.log().expand(m, vocab))
        out[:, support] = probs.log_()

    # ---- counting ----------------------------------------------------------------

    def _push(self, state: _RowState, token: int) -> None:
        state.tokens.append(token)
        if token not in state.counts.unigrams and not self._in_corpus(token):
            state.new_types += 1
        state.counts.add(state.tokens, len(state.tokens))

    def _pop(self, state: _RowState) -> None:
        token = state.tokens[-1]
        state.counts.remove(state.tokens, len(state.tokens))
        if token not in state.counts.unigrams and not self._in_corpus(token):
            state.new_types -= 1
        state.tokens.pop()

    def _in_corpus(self, token: int) -> bool:
        return self.corpus is not None and token in self.corpus.counts.unigrams

    def _mixture(self, state: _RowState, added: dict[int, int]) -> tuple[float, float, dict[int, float]]:
        """The distribution after the row's tokens as alpha x (the unigram counts before this call) +
        beta / V + sparse extra probabilities (Witten-Bell over orders 1 .. order)."""
        corpus = self.corpus.counts if self.corpus is not None else None
        total = state.counts.total + (corpus.total if corpus else 0)
        types = state.new_types + (len(corpus.unigrams) if corpus else 0)
        if total == 0:
            return _FLOOR_ONLY[0], _FLOOR_ONLY[1], {}
        alpha = 1.0 / (total + types)
        beta = types * alpha
        extra = {t: n * alpha for t, n in added.items() if t < self.vocab_size}
        tokens = state.tokens
        for n in range(1, min(self.order, len(tokens) + 1)):
            context = tuple(tokens[len(tokens) - n:])
            seen = dict(state.counts.following.get(context, {}))
            if corpus is not None:
                for t, c in corpus.following.get(context, {}).items():
                    seen[t] = seen.get(t, 0) + c
            if not seen:
                break  # a longer context is unseen too
            count = sum(seen.values())
            scale = 1.0 / (count + len(seen))
            keep = len(seen) * scale
            alpha, beta = alpha * keep, beta * keep
            extra = {t: v * keep for t, v in extra.items()}
            for t, c in seen.items():
                if t < self.vocab_size:
                    extra[t] = extra.get(t, 0.0) + c * scale
        return alpha, beta, extra


# ---- the companion as a loaded model -------------------------------------------------------


@dataclass(frozen=True)
class NgramCompanion:
    """An n-gram companion where a loaded companion model goes (plan.companion): the target's tokenizer and
    vocabulary, an optional corpus of the target's answers, and a name for SV profiles."""

    name: str
    tokenizer: Any
    vocab_size: int
    device: torch.device
    order: int = ORDER
    corpus_dir: Path | None = None
    held_out: frozenset[tuple[int, ...]] = frozenset()  # prompts whose answers the corpus leaves out
    context_window: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: None = None

    def without_answers_to(self, prompts: Iterable[Sequence[int]]) -> "NgramCompanion":
        """The same companion with the corpus's answers to `prompts` left out (a profile's own prompts)."""
        return replace(self, held_out=self.held_out | {tuple(int(t) for t in p) for p in prompts})

    def runner(self, vocab_size: int | None = None) -> NgramRunner:
        vocab = min(vocab_size or self.vocab_size, self.vocab_size)
        return NgramRunner(vocab, corpus=self._corpus(vocab), order=self.order, device=self.device)

    def _corpus(self, vocab: int) -> Corpus | None:
        if self.corpus_dir is None:
            return None
        from draftwise.answer_chunks import read_answers

        return _corpus_cache(self.corpus_dir, self.order, vocab, self.held_out,
                             lambda: (a.answer_ids for a in read_answers(self.corpus_dir)
                                      if tuple(a.prompt_ids) not in self.held_out))


_CORPORA: dict[tuple, Corpus] = {}


def _corpus_cache(directory: Path, order: int, vocab: int, held_out: frozenset, sequences) -> Corpus:
    """One count of a corpus per (directory, order, vocabulary, held-out prompts) in this process."""
    key = (str(Path(directory).resolve()), order, vocab, held_out)
    if key not in _CORPORA:
        _CORPORA[key] = Corpus.build(sequences(), order, vocab)
    return _CORPORA[key]


def ngram_corpus(spec: str) -> tuple[bool, Path | None, str | None]:
    """(is an n-gram companion, its corpus directory, its registry name) for a companion spec."""
    from draftwise.models import registry

    if spec == NGRAM:
        return True, None, None
    if spec.startswith(NGRAM + ":"):
        directory = Path(spec[len(NGRAM) + 1:]).expanduser()
        if not directory.is_dir():
            raise DraftwiseError(f"companion {spec!r}: {directory} is not a directory of answer chunks")
        return True, directory, None
    corpus = registry.ngram_companion_corpus(spec)
    if corpus is not None:
        return True, corpus, spec
    return False, None, None


def load_companion(spec: Any, target: Any, **load: Any) -> Any:
    """SV's companion for `target`: an n-gram companion for an n-gram spec (or one given), else
    `load_model(spec, **load)`."""
    if isinstance(spec, NgramCompanion):
        return spec
    if isinstance(spec, str):
        is_ngram, corpus, registered = ngram_corpus(spec)
        if is_ngram:
            return NgramCompanion(name=registered or spec, tokenizer=target.tokenizer, vocab_size=target.vocab_size,
                                  device=target.device, corpus_dir=corpus, eos_token_ids=target.eos_token_ids)
    from draftwise.models.loading import load_model

    return load_model(spec, **load)


def companion_runner(companion: Any, *, vocab_size: int | None) -> Any:
    """The runner a companion drafter reads: the n-gram runner, or the model's (`draft_runner`)."""
    if isinstance(companion, NgramCompanion):
        return companion.runner(vocab_size)
    from draftwise.models.runner import draft_runner

    return draft_runner(companion, vocab_size=vocab_size)
