"""SPRINTER's acceptance (Zhong et al.): the drafted tokens its verifier accepted stay, the run's last token (the one
it rejected) is replaced by the target's; and AdaEDL's entropy-based early stop. The verifier itself is
`heads.sprinter.Verifier`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftwise.errors import DraftwiseError
from draftwise.engine.protocols import StepDistributions
from draftwise.rules.acceptance import Rule


def adaedl_stop(scale: float, threshold: float):
    """AdaEDL (Agrawal et al. 2024): stop drafting when the entropy-based lower bound on the next
    token's acceptance probability, 1 - sqrt(scale * H(q)), falls below `threshold` (H of the
    draft's unwarped distribution, in nats). The threshold is fixed here; AdaEDL's online
    adjustment of it from the observed acceptance rate is not implemented."""
    def stop(q: torch.Tensor) -> torch.Tensor:  # [..., vocab] -> [...] bool
        entropy = -torch.special.xlogy(q, q).sum(-1)
        return 1.0 - torch.sqrt((scale * entropy).clamp(min=0.0)) < threshold
    return stop


@dataclass(frozen=True)
class SprinterRule(Rule):
    """pi = one-hot(x) where the verifier accepted x, S(p) where it rejected (only the run's last token)."""

    name: str = "sprinter"

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        verdicts = step.verdicts
        if verdicts is None:
            raise DraftwiseError("the sprinter rule needs the verifier's verdicts (a VerifierStop policy)")
        one_hot = torch.zeros_like(step.draft_probs).scatter_(-1, step.draft_tokens[..., None], 1.0)
        return torch.where(verdicts[..., None], one_hot, step.target_probs[..., :-1, :])


def check_tau(tau: float) -> float:
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and 0.0 <= tau <= 1.0):
        raise DraftwiseError(f"sprinter: tau must be in [0, 1], got {tau!r}")
    return float(tau)
