"""MTAD's verification (the MTAD paper, Algorithm 1): keep the longest drafted prefix whose joint likelihood ratio
`min(1, p(x_{1:j}) / q(x_{1:j}))` clears tau; the target samples the next token. The beams it verifies come from
`drafters.mtad.BeamRowsDrafter`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftwise.engine.sampling import unwarped
from draftwise.errors import DraftwiseError
from draftwise.engine.protocols import StepDistributions
from draftwise.rules.acceptance import Rule


def check_tau(tau: float) -> None:
    if not 0.0 <= tau <= 1.0:
        raise DraftwiseError(f"mtad: tau must be in [0, 1] (1 accepts no draft token), got {tau!r}")


def passing_prefixes(target_joint: torch.Tensor, draft_joint: torch.Tensor, tau: float) -> torch.Tensor:
    """[..., k] bool: min(1, p(x_{1:j}) / q(x_{1:j})) > tau for each prefix j, from joint log-probabilities."""
    if tau >= 1.0:
        return torch.zeros_like(target_joint, dtype=torch.bool)
    ratio_ok = target_joint - draft_joint > (math.log(tau) if tau > 0 else -math.inf)
    return ratio_ok & torch.isfinite(target_joint)  # p(x_{1:j}) = 0 never passes (ratio 0 is not > tau)


@dataclass(frozen=True)
class MTADRule(Rule):
    """Algorithm 1's verification: keep the longest passing prefix; the target samples the next token.

    `prefix(step, greedy)` is the number of drafted tokens each row keeps; the engine cuts the draft there and runs
    the one sampler with pi = the (one-hot) draft, so it keeps all of them, and draws the next token from the
    target's warped distribution at position j + 1."""

    tau: float = 0.5
    name: str = "mtad"
    cuts_draft = True

    def prefix(self, step: StepDistributions, greedy: torch.Tensor) -> list[int]:
        """greedy: [rows] bool, temperature-0 rows (scored with the target's own distribution)."""
        tokens = step.draft_tokens  # [rows, k]
        if step.draft_joint is None:
            raise DraftwiseError("mtad needs a beam drafter's joint probabilities")
        p = torch.where(greedy[:, None, None], unwarped(step.target_logits[:, :-1]), step.target_probs[:, :-1])
        target_joint = torch.log(p.gather(-1, tokens[..., None])[..., 0]).cumsum(-1)  # [rows, k] log p(x_{1:j})
        k = tokens.shape[1]
        drafted = torch.arange(k, device=tokens.device)[None] < step.num_drafted[:, None]
        passing = passing_prefixes(target_joint, step.draft_joint, self.tau) & drafted
        last = torch.where(passing, torch.arange(1, k + 1, device=tokens.device), 0).max(-1).values
        return last.tolist()

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        return step.draft_probs
