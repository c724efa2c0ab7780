"""Length policies: how many tokens each row drafts, decided row by row while drafting.

A row drafts until its limit (`min(gamma, budget - 1)`), an end-of-sequence token, or
its policy stops it. Two moments can stop a row:

- `stop_before(q_raw)`: before the next token is sampled, from the draft's unwarped
  distribution there (AdaEDL's entropy bound, the cascades' Chow rule, BiLD's fallback).
  The target then produces that token.
- `after(hidden, tokens, q_raw)`: after a token is drafted, from the draft's last-layer
  state and the token (SPRINTER's verifier: the run ends with the first token it
  rejects; SpecDec++'s head: stop once P(some rejection) exceeds a threshold). A policy
  may also return per-token *verdicts* the acceptance rule reads (SPRINTER).

Every method is a triple: a drafter, one of these policies, and an acceptance rule.
(Speculative Verification's goodput policy and SmartSpec's moving average choose how many
drafted tokens to *verify*; they plug in at the engine's select phase.)
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class LengthPolicy(Protocol):
    needs_hidden: bool  # `after` reads the draft's last-layer states
    needs_raw: bool  # the policy reads the draft's unwarped distribution

    def start(self, rows: int, device: torch.device) -> None:
        """A new drafting round over `rows` rows (per-round state resets here)."""

    def stop_before(self, q_raw: torch.Tensor | None) -> torch.Tensor:
        """[rows, vocab] -> [rows] bool: stop before sampling the next token."""

    def after(self, hidden: torch.Tensor | None, tokens: torch.Tensor, q_raw: torch.Tensor | None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """-> (stop after this token [rows] bool, or None when no row stops; verdicts [rows] bool or None)."""


class FixedLength:
    """Draft up to the limit (SD's fixed gamma)."""

    needs_hidden = False
    needs_raw = False

    def start(self, rows: int, device: torch.device) -> None:
        self._rows, self._device = rows, device

    def stop_before(self, q_raw):
        return torch.zeros(self._rows, dtype=torch.bool, device=self._device)

    def after(self, hidden, tokens, q_raw):
        return None, None  # no row stops: nothing to read back


class StopBefore(FixedLength):
    """Stop the rows where `stop(q_raw)` says so (AdaEDL, Chow, BiLD's fallback, SVIP): [rows, vocab] -> [rows]
    bool, one call for every row."""

    needs_raw = True

    def __init__(self, stop: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.stop = stop

    def stop_before(self, q_raw):
        return self.stop(q_raw)  # vectorised over rows: no host sync


class ConfidenceStop(FixedLength):
    """Dynamic draft length (EAGLE-2, and the AdaEDL family): stop a row once the draft's top probability, in its
    unwarped distribution, falls below `threshold`."""

    needs_raw = True

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def stop_before(self, q_raw):
        return q_raw.amax(dim=-1) < self.threshold  # the largest value alone: no index search


class VerifierStop(FixedLength):
    """SPRINTER (Zhong et al. Algorithm 2): a verifier scores each drafted token; a token scoring below
    `tau` is the run's last, and its verdict sends it to the target."""

    needs_hidden = True
    needs_raw = True

    def __init__(self, verifier, tau: float, embedding: torch.nn.Module) -> None:
        self.verifier, self.tau, self.embedding = verifier, tau, embedding

    def scores(self, hidden: torch.Tensor, tokens: torch.Tensor, q_raw: torch.Tensor) -> torch.Tensor:
        from draftwise.heads.sprinter import verifier_features

        features = verifier_features(self.verifier.spec.features, hidden, tokens, q_raw, self.embedding)
        return self.verifier(features.to(self.verifier.mean.dtype))  # [rows]

    def after(self, hidden, tokens, q_raw):
        passes = self.scores(hidden, tokens, q_raw) >= self.tau
        return ~passes, passes


class StopHead(VerifierStop):
    """SpecDec++ (Huang et al. 2024): the head predicts each token's acceptance a_i; a row stops after
    the token where 1 - prod a_i exceeds `threshold`. No verdicts: verification stays exact."""

    def start(self, rows: int, device: torch.device) -> None:
        super().start(rows, device)
        self._survive = torch.ones(rows, device=device)

    def after(self, hidden, tokens, q_raw):
        self._survive = self._survive * self.scores(hidden, tokens, q_raw).to(self._survive.dtype)
        return 1.0 - self._survive > self.tau, None
