"""The model runner: one causal LM and the KV cache it owns.

Invariant: the cache holds keys/values for the first `length` tokens of the
sequence being decoded. `forward` appends tokens; `trim` drops the tail. The
decoding loop calls `trim` from one place (its rewind phase); nothing else
shortens a cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

# Grouped-query attention inside SDPA instead of repeating keys/values per head: transformers
# only does so without a mask, but a verification pass over k tokens has one. On CPU this cut
# verifying 3 tokens from 1.24x to 1.11x the cost of one (SmolLM2-135M, fp32). Outputs are
# unchanged (tests compare with transformers' own generate). Set to 0 to opt out.
os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


@dataclass(frozen=True)
class RunnerOutput:
    logits: torch.Tensor  # [num_logits, vocab] for the last num_logits tokens fed
    hidden: torch.Tensor | None  # [num_logits or n fed, hidden] last-layer hidden states, when asked


class ModelRunner:
    def __init__(self, model: PreTrainedModel, *, vocab_size: int | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size  # logits are cut to this many columns (padded vocabularies)
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.calls = 0  # forward passes
        self.tokens_processed = 0  # tokens fed through forward passes

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0
        self.calls = 0
        self.tokens_processed = 0

    @torch.inference_mode()
    def forward(
        self, new_tokens: Sequence[int] | torch.Tensor, *, num_logits: int | None = None, hidden: bool = False,
        hidden_all: bool = False,
    ) -> RunnerOutput:
        """Feed tokens after the cached ones; return logits for the last `num_logits` (default: all).

        hidden: also return the last layer's hidden states for those positions;
        hidden_all: for every fed token instead (feature drafters need them all).
        """
        ids = torch.as_tensor(new_tokens, dtype=torch.long, device=self.device).reshape(1, -1)  # [1, n]
        n = ids.shape[1]
        if n == 0:
            raise ValueError("ModelRunner.forward needs at least one token")
        num_logits = n if num_logits is None else num_logits
        if not 1 <= num_logits <= n:  # transformers reads logits_to_keep=0 as "all": never pass it
            raise ValueError(f"num_logits must be in [1, {n}], got {num_logits}")
        out = self.model(
            input_ids=ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=num_logits,
            output_hidden_states=hidden or hidden_all,
        )
        self.length += n
        self.calls += 1
        self.tokens_processed += n
        logits = out.logits[0, -num_logits:]  # [num_logits, vocab]
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        states = None
        if hidden_all:
            states = out.hidden_states[-1][0]
        elif hidden:
            states = out.hidden_states[-1][0, -num_logits:]
        return RunnerOutput(logits=logits, hidden=states)

    @torch.inference_mode()
    def forward_beams(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per cache row (beam search): tokens [beams] -> next-token logits [beams, vocab].

        The cache must hold one row per beam (`select_beams`); every row has the same length."""
        ids = tokens.to(device=self.device, dtype=torch.long).reshape(-1, 1)  # [beams, 1]
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.length += 1
        self.calls += 1
        self.tokens_processed += ids.shape[0]
        logits = out.logits[:, -1]  # [beams, vocab]
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return logits

    def select_beams(self, rows: torch.Tensor) -> None:
        """Make cache row i a copy of row `rows[i]` (broadcast one row to many, reorder, or pick one)."""
        if self.length:
            self.cache.batch_select_indices(rows.to(self.device))

    def prefill(self, tokens: Sequence[int] | torch.Tensor, *, hidden: bool = False) -> RunnerOutput:
        """Forward over a whole prompt, keeping only the last position's logits."""
        return self.forward(tokens, num_logits=1, hidden=hidden)

    def trim(self, keep: int) -> None:
        """Drop cached tokens past the first `keep` (rollback of rejected tokens)."""
        if not 0 <= keep <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} tokens to {keep}")
        if keep < self.length:
            self.cache.crop(keep - self.length)  # transformers 5: a negative count removes tokens
            self.length = keep

    def pending(self, sequence: Sequence[int]) -> list[int]:
        """The tokens of `sequence` not yet in the cache (the cache holds a prefix of it)."""
        return list(sequence[self.length :])
