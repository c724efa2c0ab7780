"""Target-distribution rules for the one speculative sampler (Narasimhan et al., Algorithm 4; the sampler itself is
`engine.sampler.speculative_sample_rows`).

Words: a drafted token is *accepted* when the sampler keeps it; at
the first rejection a *recovered* token is drawn from the residual
`norm(max(0, pi - draft_probs))`; when every drafted token is accepted a *bonus*
token is drawn from `pi` at the position after the last one.

A rule maps the step's distributions to `pi = T(draft_probs, target_probs)`. Exact
speculative decoding is `pi = target_probs` (Algorithm 1); lossy speculative
sampling is the max/min form of Lemma 2; later methods (cascades) add rules here,
never a second sampler.

The bonus position has no draft token. Its `pi` is the target's distribution for
exact, lossy and the sequential rules (the choice of Leviathan et al. and Tran-Thien).
A rule with `bonus_from_pi` set and a `bonus(q, q_warped, p, p_warped, greedy)` method
(the speculative cascades: Algorithm 4 samples the bonus from pi_{t+gamma} =
T(q_{t+gamma}, p_{t+gamma})) gets the draft's distribution there from one more draft
forward, run only when every drafted token was accepted.

Zero residual: `max(0, pi - draft_probs)` is all zero only when `pi <= draft_probs`
everywhere. For a normalised `pi` that means `pi == draft_probs`, where rejection
has probability zero and happens only through rounding. When the residual mass
`r = sum max(0, pi - draft_probs)` is below `ZERO_RESIDUAL` we draw the recovered
token from `norm(pi)` instead, so the sampler never divides by zero or hands
`multinomial` an all-zero row. This fallback is exact only when `r` is truly zero
(for a normalised `pi` rejection then has probability zero, so a rejection that
rounding lets through does not change the output distribution; for a sub-normalised
`pi` the fallback is the definition of the recovery, which `output_distribution`
shares). For `0 < r < ZERO_RESIDUAL` it
is an approximation: drawing from `norm(pi)` instead of `norm(residual)` moves the
committed token's distribution by at most the rejection probability
`1 - sum min(draft_probs, pi)` in total variation, which equals `r` (so is below
`ZERO_RESIDUAL`) for a normalised `pi`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.engine.protocols import StepDistributions
from draftwise.engine.sampler import ZERO_RESIDUAL
from draftwise.engine.sampling import unwarped
from draftwise.errors import DraftwiseError

class Rule:
    """The defaults every rule inherits: the bonus from the target, no unwarped draft, every drafted token judged."""

    name = "rule"
    exact = False
    bonus_from_pi = False
    needs_draft_raw = False
    cuts_draft = False
    coupling = "rejection"  # how draft and target randomness are coupled (engine.keyed): rules other than the exact
    #                         one are defined by rejection sampling (Algorithm 4)


@dataclass(frozen=True)
class ExactRule(Rule):
    """pi = target: standard speculative decoding (Narasimhan et al. Algorithm 1).

    `coupling` (engine.keyed): "gumbel" (default) verifies a drafted token by equality with the target's own
    Gumbel-max draw at its position, the draft sampling with the same Gumbel noise (Daliri et al. 2024): drafter
    invariant, a seeded answer is `ar`'s whatever was drafted, the batch, the draft length or other requests'
    history. "rejection" is Algorithm 1 itself (accept with min(1, p/q), recover from the residual) with keyed
    uniforms: independent of the batch-mates, but a position drafted or not commits a different token, so the
    answer follows the draft lengths (a long prompt catching up beside decoding rows, a select phase, hybrid's
    choice of drafter); it accepts more (1 - TV against at least (1 - TV) / (1 + TV))."""

    name: str = "exact"
    coupling: str = "gumbel"
    exact = True  # a declaration, not a field

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        return step.target_probs[..., :-1, :]


@dataclass(frozen=True)
class LossyRule(Rule):
    """Lossy speculative sampling (Tran-Thien 2023) as a target distribution, Narasimhan et al. Lemma 2:

    pi(v) = max{ min{ draft(v), target(v) / (1 - alpha) }, target(v) / beta }.

    With Algorithm 4 this accepts with min(1, target / ((1 - alpha) draft)) and recovers
    from norm(max(0, target / beta - draft)) (eq. 17, 18). beta = 1 is the heuristic of
    Zhou et al.; then pi need not sum to 1 and the tokens follow
    `output_distribution(draft, pi)`, which is what tests check.
    """

    alpha: float = 0.0
    beta: float = 1.0
    name: str = "lossy"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha < 1.0:
            raise DraftwiseError(f"lossy: alpha must be in [0, 1), got {self.alpha!r}")
        if self.beta < 1.0 - self.alpha or self.beta <= 0:
            raise DraftwiseError(f"lossy: beta must be >= 1 - alpha = {1.0 - self.alpha:g}, got {self.beta!r}")

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        draft, target = step.draft_probs, step.target_probs[..., :-1, :]
        return torch.maximum(torch.minimum(draft, target / (1.0 - self.alpha)), target / self.beta)


@dataclass(frozen=True)
class LossyGreedyRule(Rule):
    """SpecDecode [Lossy, Greedy] (Leviathan et al. 2023 A.5; Narasimhan et al. §C.4), temperature 0.

    A greedy draft token v is kept when target(v) >= (1 - alpha) * max target, computed
    on the *unwarped* target distribution; otherwise it is replaced by the target's
    argmax. As a target distribution (Lemma 7's form): pi = one-hot(v) if v is in the
    top set T_alpha, else one-hot(argmax target).
    """

    alpha: float = 0.0
    name: str = "lossy-greedy"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise DraftwiseError(f"lossy-greedy: alpha must be in [0, 1], got {self.alpha!r}")

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        raw = unwarped(step.target_logits[..., :-1, :])  # [k, vocab]
        tokens = step.draft_tokens
        in_top_set = raw.gather(-1, tokens[..., None]).squeeze(-1) >= (1.0 - self.alpha) * raw.max(dim=-1).values  # [k]
        keep_draft = torch.zeros_like(raw).scatter_(-1, tokens[..., None], 1.0)
        return torch.where(in_top_set[..., None], keep_draft, step.target_probs[..., :-1, :])


def residual(pi: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, pi - draft_probs)), or norm(pi) when the residual mass is below ZERO_RESIDUAL
    (exact for a truly zero residual, an approximation within that mass otherwise; module docstring).
    [vocab] -> [vocab]."""
    assert pi.ndim == 1 and draft_probs.ndim == 1
    res = torch.clamp(pi - draft_probs, min=0.0)
    mass = res.sum()
    if mass.item() < ZERO_RESIDUAL:
        return pi / pi.sum()
    return res / mass


def output_distribution(draft_probs: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """The distribution of the token Algorithm 4 commits at one position. [vocab], [vocab] -> [vocab].

    min(draft, pi) + (1 - sum min(draft, pi)) * residual(pi, draft). Equals pi when pi
    sums to 1; for lossy with beta = 1 it is that method's own distribution.
    """
    kept = torch.minimum(draft_probs, pi)
    return kept + (1.0 - kept.sum()) * residual(pi, draft_probs)
