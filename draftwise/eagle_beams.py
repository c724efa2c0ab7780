"""MTAD's beam search on an EAGLE head (the MTAD paper's drafter, with the head in place of a draft model).

`HeadBeamRunner` gives `mtad.beam_search` the runner interface it drives (`pending`,
`forward`, `select_beams`, `forward_beams`) over a head: the prefix step catches the head
up on the target's true features (one row), then each beam carries its own predicted state
and its own rows of the head's KV cache, reordered with the beams' parents. The decoding
loop feeds the target's features in with `observe` and rolls back with `rewind`, as for
`eagle.EagleDrafter`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .drafters import Draft, empty_draft
from .eagle import DraftHead, full_vocabulary_logits
from .errors import DraftwiseError
from .models.runner import ModelRunner, RunnerOutput
from .sampling import SamplingConfig


class HeadBeamRunner:
    def __init__(self, head: DraftHead, vocab_size: int, device: torch.device) -> None:
        self.head = head
        self.vocab_size = vocab_size
        self.device = device
        self.runner = ModelRunner(head.body, rows=1)
        usable = head.vocab_ids < vocab_size
        if not bool(usable.any()):
            raise DraftwiseError(f"no id of this head's draft vocabulary is below the vocabulary size {vocab_size}")
        self.usable, self.usable_ids = usable, head.vocab_ids[usable]
        self.features = torch.empty(0, head.feature_size, device=device)  # true features not yet read
        self.num_features = 0  # sequence positions with true features
        self.cached = 0  # head cache positions computed from true features
        self.states: torch.Tensor | None = None  # [beams, H] each beam's last predicted state
        self._sequence: list[int] = []

    @property
    def calls(self) -> int:
        return self.runner.calls

    @property
    def length(self) -> int:
        return self.runner.length

    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        return full_vocabulary_logits(self.head.logits(states)[:, self.usable], self.usable_ids, self.vocab_size)

    def pending(self, sequence: Sequence[int]) -> list[int]:
        self._sequence = list(sequence)
        return self._sequence[self.cached + 1 : self.num_features + 1]

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], *, num_logits: int = 1) -> RunnerOutput:
        """The prefix step: read the unread true features with their next tokens; logits of the last position."""
        count = self.num_features - self.cached
        if count < 1 or len(tokens) != count:
            raise DraftwiseError("EAGLE head beam search: no new target features to start from")
        dtype = self.head.fc.weight.dtype
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)[None]
        x = self.head.step_input(self.features[None].to(dtype), ids)
        states = self.runner.forward_states(x, [count])[0]  # [count, H]
        self.cached = self.num_features
        self.features = self.features[:0]
        self.states = states[-1:]
        return RunnerOutput(logits=self._logits(self.states), hidden=None)

    def select_beams(self, rows: torch.Tensor) -> None:
        self.runner.select_beams(rows)
        self.states = self.states[rows]

    @torch.inference_mode()
    def forward_beams(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.head.step_input(self.states[:, None], tokens.to(self.device)[:, None])  # [beams, 1, 2H or H]
        self.states = self.runner.forward_states(x, [1] * tokens.shape[0])[:, 0]
        return self._logits(self.states)

    def observe(self, hidden: torch.Tensor) -> None:
        hidden = self.head.take_features(hidden)
        self.features = torch.cat([self.features, hidden.to(self.features.dtype)])
        self.num_features += hidden.shape[0]

    def rewind(self, keep: int) -> None:
        self.num_features = min(self.num_features, keep)
        self.features = self.features[: max(0, self.num_features - self.cached)]
        self.cached = min(self.cached, self.num_features)
        self.runner.trim(min(self.runner.length, self.cached))


class HeadBeamDrafter:
    """MTAD's drafter over an EAGLE head: the best of `num_beams` beams, with its joint log-probabilities."""

    needs_target_hidden = True

    def __init__(self, head: DraftHead, sampling: SamplingConfig, vocab_size: int, num_beams: int,
                 device: torch.device) -> None:
        self.beams = HeadBeamRunner(head, vocab_size, device)
        self.head = head
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.num_beams = num_beams
        self.device = device

    @property
    def calls(self) -> int:
        return self.beams.calls

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    def observe(self, hidden: torch.Tensor) -> None:
        self.beams.observe(hidden)

    def propose(self, sequence: Sequence[int], max_tokens: int, generator: torch.Generator) -> Draft:
        from .mtad import beam_search

        if max_tokens < 1 or self.beams.num_features <= self.beams.cached:
            return empty_draft(self.vocab_size, self.device)
        beam = beam_search(self.beams, sequence, max_tokens, self.num_beams, self.sampling, generator)
        probs = torch.zeros(len(beam.tokens), self.vocab_size, device=self.device)
        probs.scatter_(1, beam.tokens[:, None], 1.0)
        return Draft(beam.tokens, probs, joint_log_probs=beam.joint_log_probs)

    def rewind(self, keep: int) -> None:
        self.beams.rewind(keep)
