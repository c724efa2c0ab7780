"""The model runner: one causal LM and the position-indexed KV cache it owns.

Invariant: cache row `b` holds keys/values for the first `lengths[b]` tokens of the
sequence that row decodes. `forward_rows` appends a different number of tokens to
each row of a contiguous block; `trim_row` rolls one row back. The decoding loops
call the rollback from one place (their rewind phase); nothing else shortens a row.

A single request is row 0 of the same cache: `forward`, `prefill`, `trim` and
`pending` are the batch-of-one spellings of the row methods, and MTAD's beam search
uses `select_beams` / `forward_beams` on the same rows.

Logits are computed only where they are asked for: the base model returns hidden
states, the runner gathers the positions each row needs and applies the LM head to
those alone (a prompt of 256 tokens pays for one LM-head row, not 256). Models whose
head does more than a matrix product (logit soft-capping or scaling) take the
generic path through the full model instead.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from .kvcache import PositionCache, check_supported, sliding_window

# Families whose causal-LM head is exactly `lm_head(last_hidden_state)`: the runner applies it itself.
_PLAIN_HEAD = {"llama", "mistral", "qwen2", "qwen3", "gpt2", "smollm3", "phi3", "olmo", "olmo2", "starcoder2", "gpt_neox"}


@contextlib.contextmanager
def _cpu_gqa(device: torch.device) -> Iterator[None]:
    """Grouped-query attention inside SDPA, on CPU only, for the duration of one forward.

    transformers only does so without a mask, but a verification pass has one; on CPU this cut
    verifying 3 tokens from 1.24x to 1.11x the cost of one (SmolLM2-135M, fp32). Outputs are
    unchanged. A value the user set (0 or 1) is left alone; on accelerators nothing is set.
    """
    if device.type != "cpu" or "TRANSFORMERS_SDPA_FORCE_GQA" in os.environ:
        yield
        return
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)


@dataclass(frozen=True)
class RunnerOutput:
    logits: torch.Tensor  # [num_logits, vocab] for the last num_logits tokens fed
    hidden: torch.Tensor | None  # [num_logits or n fed, hidden] last-layer hidden states, when asked


@dataclass(frozen=True)
class RowsOutput:
    logits: torch.Tensor  # [rows, width, vocab]: position j of row i is its j-th fed token (padding: garbage)
    hidden: torch.Tensor | None  # [rows, width, hidden] last-layer states of the fed tokens, when asked


class ModelRunner:
    def __init__(self, model: PreTrainedModel, *, vocab_size: int | None = None, rows: int = 1) -> None:
        check_supported(model.config)
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size  # logits are cut to this many columns (padded vocabularies)
        self._window = sliding_window(model.config)
        config = model.config
        self._max_position = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        self._rows = rows
        self._additive = model.config._attn_implementation not in ("sdpa", "flex_attention")
        self._split = getattr(model.config, "model_type", "") in _PLAIN_HEAD and model.get_output_embeddings() is not None
        self.cache = PositionCache(rows=rows, window=self._window)
        self.calls = 0  # forward passes
        self.tokens_processed = 0  # tokens fed through forward passes (padding excluded)

    def reset(self) -> None:
        self.cache = PositionCache(rows=self._rows, window=self._window)
        self.calls = 0
        self.tokens_processed = 0

    # ---- rows ------------------------------------------------------------------

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    @torch.inference_mode()
    def forward_rows(
        self, tokens: torch.Tensor, counts: Sequence[int], *, begin: int = 0, logits_at: torch.Tensor | None = None,
        hidden: bool = False,
    ) -> RowsOutput:
        """Feed `counts[i]` tokens (row i of `tokens`, right-padded) to cache row `begin + i`.

        tokens: [rows, width] int64. logits_at: [rows, m] positions (within the fed tokens) whose
        logits are wanted, default all `width`. Returns logits [rows, m, vocab] and, with
        `hidden`, the last-layer states of every fed position [rows, width, hidden]."""
        assert tokens.ndim == 2 and tokens.shape[0] == len(counts), (tokens.shape, len(counts))
        counts = [int(c) for c in counts]
        if min(counts) < 1:
            raise ValueError("ModelRunner.forward_rows needs at least one token per row")
        ids = tokens.to(device=self.device, dtype=torch.long)
        with self._writing(counts, begin, ids.shape[1], self.model.dtype) as (positions, mask):
            if self._split:
                states = self.model.base_model(input_ids=ids, position_ids=positions, attention_mask=mask,
                                               past_key_values=self.cache, use_cache=True).last_hidden_state
                picked = states if logits_at is None else _gather(states, logits_at)
                logits = self.model.get_output_embeddings()(picked)
            else:
                out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                                 past_key_values=self.cache, use_cache=True, output_hidden_states=hidden)
                states = out.hidden_states[-1] if hidden else None
                logits = out.logits if logits_at is None else _gather(out.logits, logits_at)
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return RowsOutput(logits=logits, hidden=states if hidden else None)

    @torch.inference_mode()
    def forward_states(self, embeds: torch.Tensor, counts: Sequence[int], *, begin: int = 0) -> torch.Tensor:
        """A base-model forward from input embeddings (feature-level draft heads): embeds [rows, width, hidden]
        -> last hidden states [rows, width, hidden], written to rows `begin ..` like `forward_rows`."""
        with self._writing([int(c) for c in counts], begin, embeds.shape[1], embeds.dtype) as (positions, mask):
            return self.model.base_model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask,
                                         past_key_values=self.cache, use_cache=True).last_hidden_state

    @contextlib.contextmanager
    def _writing(self, counts: list[int], begin: int, width: int, dtype: torch.dtype
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward over rows `begin ..`: yields (position_ids, mask); commits the rows' new lengths
        when the forward succeeds, leaves them as they were when it raises."""
        positions, _ = self.cache.begin_forward(counts, begin=begin, width=width, device=self.device)
        try:
            with _cpu_gqa(self.device):
                mask = self._mask(positions, dtype)  # from the true positions
                # The model sees padded slots at their row's last real position (and never past the
                # window): a padded slot's output is discarded, but a position id past the model's
                # table would crash (learned positions) or rescale RoPE for the batch (dynamic RoPE).
                last = positions[:, :1] + torch.tensor(counts, device=self.device)[:, None] - 1  # [rows, 1]
                model_positions = torch.minimum(positions, last)
                if self._max_position:
                    model_positions = model_positions.clamp(max=self._max_position - 1)
                yield model_positions, mask
        except BaseException:
            self.cache.abort()
            raise
        self.cache.commit(counts)
        self.calls += 1
        self.tokens_processed += sum(counts)

    def _mask(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The 4-D mask from the row lengths; None for one unpadded row, where transformers builds the same
        causal mask itself (and SDPA runs a single query with no mask at all)."""
        if self.cache.single_row():
            return None
        return self.cache.attention_mask(positions, dtype, additive=self._additive)

    def trim_row(self, row: int, keep: int) -> None:
        """Drop row `row`'s cached tokens past its first `keep` (rollback of rejected tokens)."""
        self.cache.trim(row, keep)

    # ---- a single request: row 0 ------------------------------------------------

    @property
    def length(self) -> int:
        return self.cache.lengths[0]

    def forward(
        self, new_tokens: Sequence[int] | torch.Tensor, *, num_logits: int | None = None, hidden: bool = False,
        hidden_all: bool = False,
    ) -> RunnerOutput:
        """Feed tokens to row 0 after its cached ones; return logits for the last `num_logits` (default: all).

        hidden: also return the last layer's hidden states for those positions;
        hidden_all: for every fed token instead (feature drafters need them all).
        """
        ids = torch.as_tensor(new_tokens, dtype=torch.long).reshape(1, -1)  # [1, n]
        n = ids.shape[1]
        if n == 0:
            raise ValueError("ModelRunner.forward needs at least one token")
        num_logits = n if num_logits is None else num_logits
        if not 1 <= num_logits <= n:
            raise ValueError(f"num_logits must be in [1, {n}], got {num_logits}")
        at = torch.arange(n - num_logits, n, device=self.device)[None]  # [1, num_logits]
        out = self.forward_rows(ids, [n], logits_at=at, hidden=hidden or hidden_all)
        states = None
        if hidden_all:
            states = out.hidden[0]
        elif hidden:
            states = out.hidden[0, -num_logits:]
        return RunnerOutput(logits=out.logits[0], hidden=states)

    def prefill(self, tokens: Sequence[int] | torch.Tensor, *, hidden: bool = False) -> RunnerOutput:
        """Forward over a whole prompt, keeping only the last position's logits."""
        return self.forward(tokens, num_logits=1, hidden=hidden)

    def trim(self, keep: int) -> None:
        """Drop row 0's cached tokens past the first `keep`."""
        self.cache.trim(0, keep)

    def pending(self, sequence: Sequence[int]) -> list[int]:
        """The tokens of `sequence` not yet in row 0 (the row holds a prefix of it)."""
        return list(sequence[self.length :])

    # ---- beams (MTAD): every row the same length ----------------------------------

    def forward_beams(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per cache row: tokens [beams] -> next-token logits [beams, vocab]."""
        ids = tokens.to(device=self.device, dtype=torch.long).reshape(-1, 1)  # [beams, 1]
        return self.forward_rows(ids, [1] * ids.shape[0]).logits[:, -1]

    def select_beams(self, rows: torch.Tensor) -> None:
        """Make cache row i a copy of row `rows[i]` (broadcast one row to many, reorder, or pick one)."""
        self.cache.select_rows(rows)


def _gather(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """values [rows, width, d], at [rows, m] -> [rows, m, d]."""
    at = at.to(values.device)
    return values.gather(1, at[:, :, None].expand(-1, -1, values.shape[-1]))
