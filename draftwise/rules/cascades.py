"""Speculative cascades (Narasimhan et al.): deferral rules as target distributions for Algorithm 4.

Every rule here is a `TargetRule`: it maps one verification step to `pi` at the drafted
positions, and the one speculative sampler in `acceptance.py` does the rest. What the
rules read (Narasimhan et al. §C.1):

- the deferral decision is computed on the *unwarped* distributions q, p (softmax of
  the raw logits: temperature 1, no top-k / top-p);
- the mixture is formed from the *warped* ones S(q), S(p) (the distributions the draft
  sampled from and the target would sample from);
- `opt` and `opt-log` weigh the TV distance of the warped distributions (§C.1).

Cascaded rules (Table 1, eq. 6): pi = (1 - delta) S(q) + delta S(p) with
    chow     delta = 1[max q < 1 - alpha]                                   (eq. 2)
    diff     delta = 1[max q < max p - alpha]                               (eq. 5)
    opt      delta = 1[max q < max p - alpha TV(S(p), S(q))]                (eq. 10)
    opt-log  delta = 1[sum q log q < sum p log p - alpha TV(S(p), S(q))]    (eq. 28)
    bild     delta = 1[D(q, p) > alpha], D = -log p(argmax q) at temperature 0,
             -sum_v q(v) log p(v) otherwise (§F.1): the BiLD* row of Table 1.
Token-specific rules (§5, eq. 11, Algorithm 6): r(v) per candidate token,
    pi(v) = S(q)(v) (1 - r(v)) + S(p)(v) sum_v' r(v') S(q)(v')
    token-v1 r(v) = 1[q(v) < max p - alpha]                                 (eq. 13)
    token-v2 r(v) = 1[p(v) < max p - alpha]                                 (eq. 14)
    token-v3 r(v) = 1[p(v) < (1 - alpha) max p]                             (eq. 15)

Lemma 3: with a cascaded rule the rejection probability is delta * TV(S(p), S(q)).
Lemma 7: token-v3 at temperature 0 is SpecDecode [Lossy, Greedy] (`lossy-greedy`).

Also here, as rules on the same sampler: the sequential baselines' acceptance pieces
(`AcceptDraftRule` for the token-level cascade, `BildRollbackRule` for the original
deterministic BiLD) and vLLM's lossy FLy verification (`FLyRule`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from draftwise.engine.protocols import StepDistributions
from draftwise.rules.acceptance import Rule
from draftwise.errors import DraftwiseError
from draftwise.engine.sampling import unwarped

CASCADE_RULES = ("chow", "diff", "opt", "opt-log", "bild", "token-v1", "token-v2", "token-v3")
TOKEN_RULES = ("token-v1", "token-v2", "token-v3")


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_v max(0, p(v) - q(v)) over the last dimension (Narasimhan et al. Lemma 3's D_TV)."""
    return torch.clamp(p - q, min=0.0).sum(-1)


def neg_entropy(probs: torch.Tensor) -> torch.Tensor:
    """sum_v p(v) log p(v) (0 log 0 = 0)."""
    return torch.special.xlogy(probs, probs).sum(-1)


def _finite_alpha(rule: str, alpha: float) -> float:
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise DraftwiseError(f"cascade rule {rule!r}: alpha must be a finite number, got {alpha!r}")
    return float(alpha)


def deferral(rule: str, alpha: float, q: torch.Tensor, p: torch.Tensor, q_warped: torch.Tensor,
             p_warped: torch.Tensor, *, greedy: bool | torch.Tensor) -> torch.Tensor:
    """delta(q, p) for a cascaded rule, per row: [..., vocab] x 4 -> [...] bool.

    q, p unwarped (decisions); q_warped, p_warped for the TV distance of opt / opt-log.
    """
    if rule == "chow":
        return q.max(-1).values < 1.0 - alpha
    if rule == "diff":
        return q.max(-1).values < p.max(-1).values - alpha
    if rule == "opt":
        return q.max(-1).values < p.max(-1).values - alpha * tv_distance(p_warped, q_warped)
    if rule == "opt-log":
        return neg_entropy(q) < neg_entropy(p) - alpha * tv_distance(p_warped, q_warped)
    if rule == "bild":
        return bild_discrepancy(q, p, greedy=greedy) > alpha
    raise DraftwiseError(f"unknown cascade rule {rule!r}; choose one of: {', '.join(CASCADE_RULES)}")


def bild_discrepancy(q: torch.Tensor, p: torch.Tensor, *, greedy: bool | torch.Tensor) -> torch.Tensor:
    """BiLD's D(q, p) as in Narasimhan et al. §F.1: -log p(argmax q) greedy, cross-entropy -sum q log p otherwise.

    greedy: one flag, or per row ([rows] bool for [rows, ..., vocab] inputs)."""
    def at_argmax() -> torch.Tensor:
        return -torch.log(p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1))

    def cross_entropy() -> torch.Tensor:
        return -(torch.special.xlogy(q, p)).sum(-1)  # q(v) > 0 = p(v) gives +inf: always a deferral

    if isinstance(greedy, bool):
        return at_argmax() if greedy else cross_entropy()
    argmax_d, cross = at_argmax(), cross_entropy()
    return torch.where(greedy.reshape(greedy.shape + (1,) * (cross.ndim - greedy.ndim)), argmax_d, cross)


def token_deferral(rule: str, alpha: float, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """r(v) for every candidate token v, per row: [..., vocab] -> [..., vocab] bool (eq. 13-15)."""
    p_max = p.max(-1, keepdim=True).values
    if rule == "token-v1":
        return q < p_max - alpha
    if rule == "token-v2":
        return p < p_max - alpha
    if rule == "token-v3":
        return p < (1.0 - alpha) * p_max
    raise DraftwiseError(f"unknown token-specific rule {rule!r}; choose one of: {', '.join(TOKEN_RULES)}")


def cascade_pi(rule: str, alpha: float, q: torch.Tensor, p: torch.Tensor, q_warped: torch.Tensor,
               p_warped: torch.Tensor, *, greedy: bool | torch.Tensor) -> torch.Tensor:
    """The target distribution pi of any cascade rule, per row. All inputs [..., vocab]."""
    if rule in TOKEN_RULES:
        r = token_deferral(rule, alpha, q, p).to(q_warped.dtype)
        eta = (r * q_warped).sum(-1, keepdim=True)
        return q_warped * (1.0 - r) + p_warped * eta
    delta = deferral(rule, alpha, q, p, q_warped, p_warped, greedy=greedy)
    return torch.where(delta[..., None], p_warped, q_warped)


@dataclass(frozen=True)
class CascadeRule(Rule):
    """`method="cascade"`: Algorithm 5 (cascaded rules) or Algorithm 6 (token-specific rules)."""

    rule: str = "token-v3"
    alpha: float = 0.1
    bonus_from: str = "pi"  # "pi": T(q, p) at the bonus position (Algorithm 4); "target": p, like sd and lossy
    name: str = "cascade"
    needs_draft_raw = True

    def __post_init__(self) -> None:
        if self.rule not in CASCADE_RULES:
            raise DraftwiseError(f"unknown cascade rule {self.rule!r}; choose one of: {', '.join(CASCADE_RULES)}")
        _finite_alpha(self.rule, self.alpha)
        if self.bonus_from not in ("pi", "target"):
            raise DraftwiseError(f"cascade: bonus must be 'pi' or 'target', got {self.bonus_from!r}")

    @property
    def bonus_from_pi(self) -> bool:
        return self.bonus_from == "pi"

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        q = step.draft_raw
        if q is None:
            raise DraftwiseError("cascade rules need the draft's unwarped distributions (a draft model drafter)")
        p = unwarped(step.target_logits[..., :-1, :])
        return cascade_pi(self.rule, self.alpha, q, p, step.draft_probs, step.target_probs[..., :-1, :], greedy=step.greedy)

    def bonus(self, q: torch.Tensor, q_warped: torch.Tensor, p: torch.Tensor, p_warped: torch.Tensor,
              greedy: bool | torch.Tensor) -> torch.Tensor:
        """pi at the bonus position, T(q, p) there (Algorithm 4's pi_{t+gamma}): [..., vocab] each; greedy one flag
        or per row."""
        return cascade_pi(self.rule, self.alpha, q, p, q_warped, p_warped, greedy=greedy)


@dataclass(frozen=True)
class AcceptDraftRule(Rule):
    """pi = the draft's own distribution: every drafted token is kept (the token-level cascade's
    small-model run, whose length the drafter's deferral decides; the target then samples the
    next token from S(p) as the bonus)."""

    name: str = "accept-draft"

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        return step.draft_probs


@dataclass(frozen=True)
class BildRollbackRule(Rule):
    """Original BiLD's deterministic rollback (Kim et al. 2023; Narasimhan et al. §B, §F.5), temperature 0.

    A drafted token x is kept while D = -log p(x) <= alpha (unwarped target); at the first
    token with D > alpha the target's own greedy token replaces it. As pi: one-hot(x) when
    kept, else one-hot(argmax p).
    """

    alpha: float = 2.0
    name: str = "bild-rollback"

    def __post_init__(self) -> None:
        _finite_alpha("bild", self.alpha)
        if self.alpha < 0:
            raise DraftwiseError(f"bild: the rollback threshold alpha must be >= 0, got {self.alpha!r}")

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        p = unwarped(step.target_logits[..., :-1, :])
        keep = -torch.log(p.gather(-1, step.draft_tokens[..., None]).squeeze(-1)) <= self.alpha
        one_hot = torch.zeros_like(p).scatter_(-1, step.draft_tokens[..., None], 1.0)
        return torch.where(keep[..., None], one_hot, step.target_probs[..., :-1, :])


@dataclass(frozen=True)
class FLyRule(Rule):
    """vLLM's lossy FLy verification (Li et al. 2025, "Training-free loosely speculative decoding").

    A drafted token the target disagrees with is still kept when (i) the target is uncertain
    there: entropy of the unwarped p at that position >= `entropy_threshold` nats, and (ii) the
    draft stays aligned after it: each of the next `window` drafted tokens is the target's
    argmax given the draft's prefix (the target's self-correction did not kick in). Otherwise
    the exact rule applies. As pi: one-hot(x_j) at a lenient position, S(p_j) elsewhere.

    Our reading of FLy decides within one verification block: a mismatch with fewer than
    `window` drafted tokens after it is not deferred to the next block but judged exactly.
    """

    window: int = 2
    entropy_threshold: float = 0.5
    name: str = "fly"

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise DraftwiseError(f"fly: window must be an integer >= 1, got {self.window!r}")
        if not math.isfinite(self.entropy_threshold) or self.entropy_threshold < 0:
            raise DraftwiseError(f"fly: entropy_threshold must be >= 0 nats, got {self.entropy_threshold!r}")

    def lenient(self, step: StepDistributions) -> torch.Tensor:
        """[k] bool: the positions where a disagreement is forgiven."""
        p = unwarped(step.target_logits[..., :-1, :])  # [k, vocab]
        aligned = p.argmax(-1) == step.draft_tokens  # [k]
        if step.num_drafted is not None:  # batched rows: padding past a row's drafts is never aligned
            positions = torch.arange(aligned.shape[-1], device=aligned.device)
            aligned &= positions < step.num_drafted.to(aligned.device)[..., None]
        uncertain = -neg_entropy(p) >= self.entropy_threshold  # [k]
        return uncertain & aligned_ahead(aligned, self.window)

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        lenient = self.lenient(step)
        one_hot = torch.zeros_like(step.draft_probs).scatter_(-1, step.draft_tokens[..., None], 1.0)
        return torch.where(lenient[..., None], one_hot, step.target_probs[..., :-1, :])


def aligned_ahead(aligned: torch.Tensor, window: int) -> torch.Tensor:
    """ahead[..., j] = all of aligned[..., j+1 : j+1+window], and that many drafted tokens exist.

    aligned: [..., k] bool -> [..., k] bool, no loop over positions: with
    misses[..., i] = the misaligned count in aligned[..., :i] (an exclusive cumulative sum),
    the window after j is all aligned when misses[j+1+window] == misses[j+1].
    """
    k = aligned.shape[-1]
    ahead = torch.zeros_like(aligned, dtype=torch.bool)
    if k > window:
        misses = torch.nn.functional.pad((~aligned).long().cumsum(-1), (1, 0))  # [..., k + 1]
        ahead[..., : k - window] = misses[..., window + 1 :] == misses[..., 1 : k - window + 1]
    return ahead


def chow_stop(alpha: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The small model's own deferral (eq. 2) on its unwarped distributions [..., vocab]: stop drafting where
    max q < 1 - alpha ([...] bool)."""
    return lambda q: q.max(-1).values < 1.0 - alpha


def sequence_confidence(log_probs: list[float], aggregate: str) -> float:
    """Sequence-level Chow (eq. 1) on the drafted response: its probability under q (`product`,
    the literal eq. 1 with the sampled response standing in for the max), or the per-token
    geometric mean (`mean`, length-normalised: a long response is not penalised for its length)."""
    if not log_probs:
        return 1.0
    total = math.fsum(log_probs)
    if aggregate == "product":
        return math.exp(total)
    if aggregate == "mean":
        return math.exp(total / len(log_probs))
    raise DraftwiseError(f"seq-cascade: aggregate must be 'mean' or 'product', got {aggregate!r}")
