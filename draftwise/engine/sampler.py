"""The speculative sampler over a batch of rows: Algorithm 4 of Narasimhan et al., vectorised.

Row b drafted `num_drafted[b]` tokens (rows differ; positions past a row's count are
padding and never read). Per row: token j is *accepted* with probability min(1, pi_j(x_j) / draft_j(x_j)); at the first
rejection a *recovered* token is drawn from norm(max(0, pi - draft)); when every
drafted token is accepted a *bonus* token is drawn from `bonus_probs[b, k_b]`.

Randomness: row b draws `num_drafted[b] + 1` uniforms from its own generator, so its
outcome does not depend on which rows share the batch. Everything else runs on the
device as [rows, ...] tensors, and the result crosses to the host in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from draftwise.rules.acceptance import ZERO_RESIDUAL
from draftwise.engine.sampling import SamplingConfig, argmax_last, invert_cdf, warp


@dataclass(frozen=True)
class RowsAcceptance:
    num_accepted: list[int]  # [rows] drafted tokens kept, a prefix of each row's draft
    next_tokens: list[int]  # [rows] recovered (num_accepted < num_drafted) or bonus token


def draw_uniforms(generators: Sequence[torch.Generator], counts: Sequence[int], width: int,
                  device: torch.device) -> torch.Tensor:
    """[rows, width] float64 uniforms; row b's first counts[b] come from generators[b], the rest are 0."""
    out = torch.zeros(len(counts), width, dtype=torch.float64, device=device)
    for b, (generator, count) in enumerate(zip(generators, counts)):
        if count:
            out[b, :count] = torch.rand(count, generator=generator, device=generator.device,
                                        dtype=torch.float64).to(device)
    return out


def residual_rows(pi: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, pi - draft) per row, unnormalised (the sampler scales by the total), with the
    zero-residual fallback of `acceptance.residual`: pi itself where the mass is below ZERO_RESIDUAL.
    [rows, vocab] x 2 -> [rows, vocab]."""
    leftover = torch.clamp(pi - draft_probs, min=0.0)
    mass = leftover.sum(-1, keepdim=True)
    return torch.where(mass < ZERO_RESIDUAL, pi, leftover)


def speculative_sample_rows(
    draft_tokens: torch.Tensor,  # [rows, k] int64 (padding past num_drafted[b]: any valid id)
    draft_probs: torch.Tensor,  # [rows, k, vocab]
    pi: torch.Tensor,  # [rows, k, vocab] target distribution at the drafted positions
    bonus_probs: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],  # [rows, k + 1, vocab]: row b's bonus
    num_drafted: Sequence[int],  # [rows] host ints                      comes from position num_drafted[b];
    generators: Sequence[torch.Generator],  # one per row                or a callable given the rows that need
    greedy: Sequence[bool] | None = None,  # [rows] temperature-0 rows    a bonus ([rows] bool), run only if any do
) -> RowsAcceptance:
    assert draft_tokens.ndim == 2 and draft_probs.ndim == 3 and pi.ndim == 3
    rows, k = draft_tokens.shape
    device = draft_tokens.device
    counts = torch.tensor(list(num_drafted), dtype=torch.long, device=device)  # [rows]
    # Greedy rows need no randomness: their draft and target distributions are one-hot, so a token is
    # accepted exactly when pi gives it mass 1 (any u < 1 decides alike), and the recovered or bonus
    # distribution is one-hot too (its argmax is the draw). They draw no uniforms and fill in 0.5.
    greedy = list(greedy) if greedy is not None else [False] * rows
    uniforms = draw_uniforms(generators, [0 if g else c + 1 for c, g in zip(num_drafted, greedy)], k + 1, device)
    if any(greedy):
        uniforms[torch.tensor(greedy, device=device)] = 0.5  # [rows, k + 1]
    if k:
        draft_at_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).double()  # [rows, k]
        pi_at_x = pi.gather(-1, draft_tokens[..., None]).squeeze(-1).double()  # [rows, k]
        # u < pi/q written without the division; q(x) > 0 because x was drawn from q.
        accepted = uniforms[:, :k] * draft_at_x < pi_at_x  # [rows, k]
        accepted &= torch.arange(k, device=device)[None] < counts[:, None]
        num_accepted = accepted.long().cumprod(1).sum(1)  # [rows]
    else:
        num_accepted = torch.zeros(rows, dtype=torch.long, device=device)
    rejected = num_accepted < counts  # [rows]
    at = num_accepted.clamp(max=max(k - 1, 0))  # [rows] the rejected position (when rejected)
    index = torch.arange(rows, device=device)
    if callable(bonus_probs):
        bonus_probs = bonus_probs(~rejected)
    bonus = bonus_probs[index, num_accepted.clamp(max=k)]  # [rows, vocab] (== position counts[b] when not rejected)
    if k:
        recover = residual_rows(pi[index, at], draft_probs[index, at])  # [rows, vocab]
        probs = torch.where(rejected[:, None], recover, bonus)
    else:
        probs = bonus
    if all(greedy):
        next_tokens = argmax_last(probs)  # [rows]
    else:
        # each row's last uniform, drawn at index counts[b], picks its recovered or bonus token
        next_tokens = invert_cdf(probs, uniforms.gather(1, counts[:, None].clamp(max=k)))
        if any(greedy):
            next_tokens = torch.where(torch.tensor(greedy, device=device), argmax_last(probs), next_tokens)
    both = torch.stack([num_accepted, next_tokens]).tolist()  # the one device-to-host copy
    return RowsAcceptance(num_accepted=both[0], next_tokens=both[1])


def accept_greedy(draft_tokens: torch.Tensor, num_drafted: Sequence[int], target_logits: torch.Tensor
                  ) -> RowsAcceptance:
    """Temperature-0 rows under the exact rule, without any distribution: a drafted token is accepted when it is
    the target's argmax there, and the next token is the argmax after the accepted prefix. The same outcome as
    `speculative_sample_rows` with one-hot draft and target distributions (a greedy draft's token has q(x) = 1).
    draft_tokens [rows, k], target_logits [rows, k + 1, vocab]."""
    rows, k = draft_tokens.shape
    best = argmax_last(target_logits)  # [rows, k + 1]
    if k:
        counts = torch.tensor(list(num_drafted), dtype=torch.long, device=best.device)
        match = (draft_tokens.to(best.device) == best[:, :k]) & (torch.arange(k, device=best.device)[None]
                                                                 < counts[:, None])
        num_accepted = match.long().cumprod(1).sum(1)  # [rows]
    else:
        num_accepted = torch.zeros(rows, dtype=torch.long, device=best.device)
    next_tokens = best.gather(1, num_accepted[:, None])[:, 0]
    both = torch.stack([num_accepted, next_tokens]).tolist()  # the one device-to-host copy
    return RowsAcceptance(num_accepted=both[0], next_tokens=both[1])


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator], drawing: Sequence[bool],
                greedy: Sequence[bool]) -> torch.Tensor:
    """One token per row, with one uniform from the row's own generator. [rows, vocab] -> [rows].

    Only rows still `drawing` consume a uniform (the others' tokens are discarded), so a row's
    randomness does not depend on how long its batch-mates draft. Greedy rows take the argmax of
    their one-hot distribution and draw nothing."""
    if all(greedy):
        return argmax_last(probs)
    u = draw_uniforms(generators, [int(d and not g) for d, g in zip(drawing, greedy)], 1, probs.device)  # [rows, 1]
    sampled = invert_cdf(probs, u)
    if any(greedy):
        sampled = torch.where(torch.tensor(list(greedy), device=probs.device), argmax_last(probs), sampled)
    return sampled


def warp_rows(logits: torch.Tensor, configs: Sequence[SamplingConfig]) -> torch.Tensor:
    """Warp row b of logits [rows, ..., vocab] with configs[b]; rows sharing a config warp together."""
    if len(set(configs)) == 1:
        return warp(logits, configs[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[SamplingConfig, list[int]] = {}
    for b, config in enumerate(configs):
        groups.setdefault(config, []).append(b)
    for config, members in groups.items():
        index = torch.tensor(members, device=logits.device)
        out[index] = warp(logits[index], config)
    return out
