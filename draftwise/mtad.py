"""MTAD and MTJD (the MTAD paper): beam-search drafts, joint verification, multi-token joint decoding.

Beam search here (`beam_search`) runs on one `ModelRunner` for `length` tokens:

- The prefix is fed once, with batch 1. The first beam step selects from that one row;
  its cache is then broadcast to the `W` beams by `select_beams` (a batch index of zeros),
  so the prompt is never recomputed per beam, and every later step feeds `W` tokens
  (batch `W`, one position each) and reorders the cache rows by the beams' parents, as
  transformers' beam search does.
- Sampled beams (temperature > 0): the `W x V` joint scores `log q(beam) + log T(q)(x)`,
  T the request's warping, are sampled *without replacement* with the Gumbel-top-k trick
  (equivalent to drawing one candidate at a time proportionally to `p_beam`, eq. 2).
- Deterministic beams (temperature 0): the top `W` joint scores of the model's own
  log-probabilities (a one-hot warp would leave a single candidate).
- The result is the beam with the highest joint score and its cumulative joint
  log-probability for every prefix, `log q(x_{1:j})`; afterwards the cache holds the
  prefix and that beam's first `length - 1` tokens, batch 1 again (its last token is fed
  by the next forward, as with every drafter).

When fewer than `W` candidates have non-zero probability (top-k below `W`, or a peaked
warp), fewer beams are kept that step.

MTAD verification (Algorithm 1): the target scores the best beam in one pass; the
longest prefix `j` with `min(1, p(x_{1:j}) / q(x_{1:j})) > tau` is kept, where earlier
prefixes may fail, and one token is sampled from the target at position `j + 1`. Both
joints use the same warping (at temperature 0 the models' own distributions: the warp
there is one-hot). MTAD is lossy by design: its output does not follow the target's
distribution, it aims at a higher joint likelihood (lower perplexity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .acceptance import StepDistributions
from .drafters import Draft, empty_draft
from .errors import DraftwiseError
from .models.runner import ModelRunner
from .sampling import SamplingConfig, unwarped, warp


@dataclass(frozen=True)
class Beam:
    tokens: torch.Tensor  # [n] int64, the best beam
    joint_log_probs: torch.Tensor  # [n] float32: log q(x_{1:j}) for j = 1..n
    beams: int  # beams alive at the last step (<= num_beams)


def step_log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """[rows, vocab] logits -> the log-probabilities beams are scored with (-inf where warped away).

    Temperature 0 scores with the model's own distribution; otherwise with the warped one.
    """
    probs = unwarped(logits) if sampling.greedy else warp(logits, sampling)
    return torch.log(probs)


def _select(scores: torch.Tensor, n: int, sampling: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """Indices of n candidates of flat joint log-scores: top-n (greedy) or sampled without replacement."""
    finite = int(torch.isfinite(scores).sum())
    n = max(1, min(n, finite))
    if sampling.greedy:
        return torch.topk(scores, n).indices
    u = torch.rand(scores.shape, generator=generator, device=scores.device, dtype=torch.float64)
    u = u.clamp_(min=1e-300)  # keeps the Gumbel noise finite
    gumbel = scores.double() - torch.log(-torch.log(u))  # -inf stays -inf: never chosen
    return torch.topk(gumbel, n).indices


def beam_search(
    runner: ModelRunner,
    sequence: Sequence[int],
    length: int,
    num_beams: int,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> Beam:
    """`length` tokens after `sequence` by beam search (see the module docstring). length >= 1."""
    if length < 1:
        raise ValueError("beam_search needs length >= 1")
    logits = runner.forward(runner.pending(sequence), num_logits=1).logits  # [1, vocab]
    vocab = logits.shape[-1]
    scores = torch.zeros(1, device=logits.device)  # [beams] joint log-probability of each beam
    history = torch.empty(1, 0, dtype=torch.long, device=logits.device)  # [beams, t]
    joints = torch.empty(1, 0, device=logits.device)  # [beams, t] cumulative joint per prefix
    parents = torch.zeros(1, dtype=torch.long, device=logits.device)
    for t in range(length):
        if t:
            runner.select_beams(parents)  # cache rows follow their beams (t = 1: broadcast the prefix)
            logits = runner.forward_beams(history[:, -1])  # [beams, vocab]
        joint = scores[:, None] + step_log_probs(logits, sampling)  # [beams, vocab]
        chosen = _select(joint.flatten(), num_beams, sampling, generator)  # [beams']
        parents = torch.div(chosen, vocab, rounding_mode="floor")
        tokens = chosen % vocab
        scores = joint.flatten()[chosen].float()
        history = torch.cat([history[parents], tokens[:, None]], dim=1)
        joints = torch.cat([joints[parents], scores[:, None]], dim=1)
    best = int(torch.argmax(scores))
    if length > 1:
        runner.select_beams(parents[best : best + 1])  # batch 1: the chosen beam's row
    return Beam(tokens=history[best], joint_log_probs=joints[best], beams=int(scores.shape[0]))


class BeamDrafter:
    """MTAD's drafter: the best of `num_beams` beams over `gamma` tokens of an independent draft model.

    Draft.probs are one-hot at the beam's tokens (the proposal is deterministic once the
    beams are drawn); Draft.joint_log_probs carries log q(x_{1:j}) for the verification.
    """

    def __init__(self, runner: ModelRunner, sampling: SamplingConfig, vocab_size: int, num_beams: int) -> None:
        self.runner = runner
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.num_beams = num_beams

    @property
    def calls(self) -> int:
        return self.runner.calls

    def propose(self, sequence: Sequence[int], max_tokens: int, generator: torch.Generator) -> Draft:
        if max_tokens < 1:
            return empty_draft(self.vocab_size, self.runner.device)
        beam = beam_search(self.runner, sequence, max_tokens, self.num_beams, self.sampling, generator)
        probs = torch.zeros(len(beam.tokens), self.vocab_size, device=self.runner.device)
        probs.scatter_(1, beam.tokens[:, None], 1.0)
        return Draft(beam.tokens, probs, joint_log_probs=beam.joint_log_probs)

    def rewind(self, keep: int) -> None:
        self.runner.trim(min(keep, self.runner.length))


def check_tau(tau: float) -> None:
    if not 0.0 <= tau <= 1.0:
        raise DraftwiseError(f"mtad: tau must be in [0, 1] (1 accepts no draft token), got {tau!r}")


def check_beams(num_beams: int) -> None:
    if num_beams < 1:
        raise DraftwiseError(f"num_beams must be >= 1, got {num_beams}")


def passing_prefixes(target_joint: torch.Tensor, draft_joint: torch.Tensor, tau: float) -> torch.Tensor:
    """[k] bool: min(1, p(x_{1:j}) / q(x_{1:j})) > tau for each prefix j, from joint log-probabilities."""
    if tau >= 1.0:
        return torch.zeros_like(target_joint, dtype=torch.bool)
    ratio_ok = target_joint - draft_joint > (math.log(tau) if tau > 0 else -math.inf)
    return ratio_ok & torch.isfinite(target_joint)  # p(x_{1:j}) = 0 never passes (ratio 0 is not > tau)


@dataclass(frozen=True)
class MTADRule:
    """Algorithm 1's verification: keep the longest passing prefix; the target samples the next token.

    `prefix(step)` is the number of drafted tokens kept; the decoding loop then runs the
    one sampler on that prefix with pi = the (one-hot) draft, so it keeps all of them, and
    draws the next token from the target's warped distribution at position j + 1.
    """

    tau: float = 0.5
    name: str = "mtad"

    def prefix(self, step: StepDistributions) -> int:
        tokens = step.draft_tokens
        if step.draft_joint is None:
            raise DraftwiseError("mtad needs a beam drafter's joint probabilities")
        p = unwarped(step.target_logits[:-1]) if step.greedy else step.target_probs[:-1]  # [k, vocab]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        target_joint = torch.log(p[rows, tokens]).cumsum(0)  # [k] log p(x_{1:j})
        passing = passing_prefixes(target_joint, step.draft_joint, self.tau).nonzero().flatten()
        return int(passing[-1]) + 1 if passing.numel() else 0

    def __call__(self, step: StepDistributions) -> torch.Tensor:
        return step.draft_probs
