"""Drafters propose tokens and the distributions they were drawn from.

The protocol is two methods, like transformers' candidate generators:
`propose(sequence, max_tokens, generator)` and `rewind(keep)`, called by the
decoding loop's rewind phase after every verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Protocol, Sequence

import torch

from .models.runner import ModelRunner
from .sampling import SamplingConfig, sample, unwarped, warp


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [k] int64 proposed tokens (k may be 0)
    probs: torch.Tensor  # [k, vocab] the distributions they were drawn from (one-hot for deterministic drafters)
    raw_probs: torch.Tensor | None = None  # [k, vocab] unwarped distributions, when the drafter keeps them
    verifier_accepts: torch.Tensor | None = None  # [k] bool: a SPRINTER verifier's verdict per token
    joint_log_probs: torch.Tensor | None = None  # [k] log q(x_{1:j}) of a beam drafter (MTAD)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def empty_draft(vocab_size: int, device: torch.device) -> Draft:
    return Draft(torch.empty(0, dtype=torch.long, device=device), torch.empty(0, vocab_size, device=device))


class Drafter(Protocol):
    calls: int  # forward passes of a draft model (0 for model-free drafters)

    def propose(self, sequence: Sequence[int], max_tokens: int, generator: torch.Generator) -> Draft: ...

    def rewind(self, keep: int) -> None: ...


class NoDrafter:
    """Proposes nothing: the step degenerates to one target call and one sampled token (`ar`)."""

    calls = 0

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self._empty = empty_draft(vocab_size, device)

    def propose(self, sequence: Sequence[int], max_tokens: int, generator: torch.Generator) -> Draft:
        return self._empty

    def rewind(self, keep: int) -> None:
        pass


class ModelDrafter:
    """An independent draft model sampling autoregressively from its warped distribution.

    `keep_raw` also returns the unwarped distributions (cascade rules decide on them).
    `stop_when(q)`, given the unwarped distribution of the next position, ends the draft
    before that token is sampled (the small model's own deferral: token-level cascades, BiLD's
    fallback); the target then produces that token. A drafted token in `eos_token_ids` ends the
    draft after it: nothing past an EOS can be committed.
    """

    def __init__(self, runner: ModelRunner, sampling: SamplingConfig, vocab_size: int, *, keep_raw: bool = False,
                 stop_when: Callable[[torch.Tensor], bool] | None = None,
                 eos_token_ids: Collection[int] = ()) -> None:
        self.runner = runner
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.keep_raw = keep_raw or stop_when is not None
        self.stop_when = stop_when
        self.eos_token_ids = frozenset(eos_token_ids)

    @property
    def calls(self) -> int:
        return self.runner.calls

    def propose(self, sequence: Sequence[int], max_tokens: int, generator: torch.Generator) -> Draft:
        feed: Sequence[int] | torch.Tensor = self.runner.pending(sequence)
        tokens, probs, raws = [], [], []
        for _ in range(max_tokens):
            logits = self.runner.forward(feed, num_logits=1).logits  # [1, vocab]
            if self.keep_raw:
                raw = unwarped(logits)  # [1, vocab]
                if self.stop_when is not None and self.stop_when(raw[0]):
                    break
                raws.append(raw)
            step_probs = warp(logits, self.sampling)  # [1, vocab]
            token = step_probs.argmax(-1) if self.sampling.greedy else sample(step_probs, generator)  # [1]
            tokens.append(token)
            probs.append(step_probs)
            if self.eos_token_ids and int(token) in self.eos_token_ids:
                break
            feed = token
        if not tokens:
            draft = empty_draft(self.vocab_size, self.runner.device)
            return Draft(draft.tokens, draft.probs, draft.probs) if self.keep_raw else draft
        return Draft(torch.cat(tokens), torch.cat(probs), torch.cat(raws) if self.keep_raw else None)

    def next_distribution(self, sequence: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(unwarped, warped) distribution after `sequence` (committed + drafted): one more forward."""
        logits = self.runner.forward(self.runner.pending(sequence), num_logits=1).logits  # [1, vocab]
        return unwarped(logits)[0], warp(logits, self.sampling)[0]

    def rewind(self, keep: int) -> None:
        # The last drafted token was never fed, so the cache may already be shorter than `keep`.
        self.runner.trim(min(keep, self.runner.length))


class PromptLookupDrafter:
    """n-gram drafting over the prompt and output so far (no draft model).

    Finds the most recent earlier occurrence of the sequence's last n tokens (n from
    `max_ngram` down to `min_ngram`) and proposes the tokens that followed it, with
    one-hot draft distributions, so speculative sampling stays exact.
    """

    calls = 0

    def __init__(self, vocab_size: int, device: torch.device, *, max_ngram: int = 3, min_ngram: int = 1,
                 eos_token_ids: Collection[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.eos_token_ids = frozenset(eos_token_ids)  # a proposal ends after its first EOS

    def lookup(self, sequence: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        seq = torch.as_tensor(sequence, dtype=torch.long)
        length = seq.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = seq[: length - 1].unfold(0, n, 1)  # [length - n, n]: every earlier n-gram start
            hits = (windows == seq[length - n :]).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # continuation of the most recent match
                return seq[start : start + max_tokens].tolist()
        return []

    def propose(self, sequence: Sequence[int], max_tokens: int, generator: torch.Generator) -> Draft:
        found = self.lookup(sequence, max_tokens)
        for i, token in enumerate(found):
            if token in self.eos_token_ids:
                found = found[: i + 1]
                break
        tokens = torch.tensor(found, dtype=torch.long, device=self.device)
        probs = torch.zeros(len(found), self.vocab_size, device=self.device)
        if found:
            probs.scatter_(1, tokens[:, None], 1.0)
        return Draft(tokens, probs)

    def rewind(self, keep: int) -> None:
        pass
