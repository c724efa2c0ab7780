"""The speculative sampler over a batch of rows: Algorithm 4 of Narasimhan et al., vectorised.

Row b drafted `num_drafted[b]` tokens (rows differ; positions past a row's count are
padding and never read). Per row: token j is *accepted* with probability min(1, pi_j(x_j) / draft_j(x_j)); at the first
rejection a *recovered* token is drawn from norm(max(0, pi - draft)); when every
drafted token is accepted a *bonus* token is drawn from `bonus_probs[b, k_b]`.

Randomness is keyed (keyed.py): the uniforms deciding row b's token at absolute position t are hashes of (its
seed, t, purpose), never the next numbers of a stream, so its outcome does not depend on which rows share the
batch or on how many numbers earlier steps took. Everything else runs on the device as [rows, ...] tensors, and the
result crosses to the host in one copy.

Under the exact rule the engine normally takes the *Gumbel* coupling instead (`accept_own_draws`: a drafted token
is kept when it equals the target's own Gumbel-max draw); this sampler is the *rejection* coupling, and the only
one for lossy and cascade rules, whose distributions are defined by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from draftwise.engine.keyed import ACCEPT, BONUS, RESIDUAL, Draws, as_draws
from draftwise.engine.sampling import SamplingConfig, argmax_last, invert_cdf, unwarped, warp, warps_nothing

ZERO_RESIDUAL = 1e-5  # a residual mass below this draws the recovered token from norm(pi) (rules/acceptance.py says why)


@dataclass(frozen=True)
class RowsAcceptance:
    num_accepted: list[int]  # [rows] drafted tokens kept, a prefix of each row's draft
    next_tokens: list[int]  # [rows] recovered (num_accepted < num_drafted) or bonus token


def residual_rows(pi: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, pi - draft) per row, unnormalised (the sampler scales by the total), with the
    zero-residual fallback of `acceptance.residual`: pi itself where the mass is below ZERO_RESIDUAL.
    [rows, vocab] x 2 -> [rows, vocab]."""
    leftover = torch.clamp(pi - draft_probs, min=0.0)
    mass = leftover.sum(-1, keepdim=True)
    return torch.where(mass < ZERO_RESIDUAL, pi, leftover)


def residual_at(pi: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`residual_rows(pi, one_hot(tokens))` without the one-hot: a deterministic draft (q(x) = 1 at its token x)
    leaves pi with x's entry lowered by 1 (to 0 for any pi(x) <= 1); bit for bit the same numbers.
    pi [rows, vocab], tokens [rows] -> [rows, vocab]."""
    at_x = (pi.gather(-1, tokens[:, None]) - 1.0).clamp(min=0.0)
    leftover = pi.clamp(min=0.0).scatter(-1, tokens[:, None], at_x)
    mass = leftover.sum(-1, keepdim=True)
    return torch.where(mass < ZERO_RESIDUAL, pi, leftover)


def speculative_sample_rows(
    draft_tokens: torch.Tensor,  # [rows, k] int64 (padding past num_drafted[b]: any valid id)
    draft_probs: torch.Tensor | None,  # [rows, k, vocab]; None: deterministic drafts, q(x) = 1 at each token
    pi: torch.Tensor,  # [rows, k, vocab] target distribution at the drafted positions
    bonus_probs: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],  # [rows, k + 1, vocab]: row b's bonus
    num_drafted: Sequence[int],  # [rows] host ints                      comes from position num_drafted[b];
    draws: Draws | Sequence[torch.Generator],  # the rows' keyed draws   or a callable given the rows that need
    greedy: Sequence[bool] | None = None,  # [rows] temperature-0 rows    a bonus ([rows] bool), run only if any do
    stage: int = 0,  # added to the purposes (keyed.STAGED: a companion's own acceptance before the target's)
    greedy_argmax: bool = False,  # greedy rows' pi and bonus are scores (their logits) whose argmax decides
) -> RowsAcceptance:
    """Without draft distributions (`draft_probs` None: lookup, suffix, greedy and beam drafts) a token x is
    accepted when u < pi(x) and the residual is pi with x's entry lowered by 1, the numbers the one-hot gives,
    without building it (vLLM's rejection sampler treats such drafts alike).

    Greedy rows draw nothing: their draft and target distributions are one-hot, so a token is accepted exactly
    when pi gives it mass 1 (any u < 1 decides alike; they take 0.5), and the recovered or bonus token is the
    argmax. With `greedy_argmax` (the exact rule, whose pi is the target) their rows of pi and bonus may be any
    scores with the target's argmax, its logits: a drafted token is accepted where it is that argmax, and the
    next token is the argmax at the first rejection or after the draft, the outcome the one-hots give."""
    assert draft_tokens.ndim == 2 and pi.ndim == 3 and (draft_probs is None or draft_probs.ndim == 3)
    rows, k = draft_tokens.shape
    device = draft_tokens.device
    draws = as_draws(draws, rows, device)
    counts = torch.tensor(list(num_drafted), dtype=torch.long, device=device)  # [rows]
    greedy = list(greedy) if greedy is not None else [False] * rows
    greedy_mask = torch.tensor(greedy, device=device) if any(greedy) else None
    offsets = torch.arange(k + 1, device=device)
    if all(greedy):
        uniforms = torch.full((rows, k + 1), 0.5, dtype=torch.float64, device=device)
    else:
        uniforms = draws.uniforms(offsets[:k], ACCEPT + stage).to(device)  # [rows, k] at positions start + j
        if greedy_mask is not None:
            uniforms[greedy_mask] = 0.5
    if k:
        pi_at_x = pi.gather(-1, draft_tokens[..., None]).squeeze(-1).double()  # [rows, k]
        if draft_probs is None:  # q(x) = 1
            accepted = uniforms[:, :k] < pi_at_x
        else:  # u < pi/q written without the division; q(x) > 0 because x was drawn from q
            draft_at_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).double()  # [rows, k]
            accepted = uniforms[:, :k] * draft_at_x < pi_at_x  # [rows, k]
        if greedy_argmax and greedy_mask is not None:
            accepted = torch.where(greedy_mask[:, None], draft_tokens == argmax_last(pi), accepted)
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
    if greedy_argmax and all(greedy):  # scores: the argmax at the rejection, or the bonus's
        probs = torch.where(rejected[:, None], pi[index, at], bonus) if k else bonus
        next_tokens = argmax_last(probs)
    else:
        pi_at = pi[index, at] if k else None  # [rows, vocab] pi at each row's rejected position
        if k:
            recover = (residual_at(pi_at, draft_tokens[index, at]) if draft_probs is None
                       else residual_rows(pi_at, draft_probs[index, at]))  # [rows, vocab]
            probs = torch.where(rejected[:, None], recover, bonus)
        else:
            probs = bonus
        if all(greedy):
            next_tokens = argmax_last(probs)  # [rows]
        else:
            # the recovered (or bonus) token decides position start + num_accepted: its uniform is keyed there
            at_next = num_accepted[:, None]
            last = torch.where(rejected[:, None], draws.uniforms(at_next, RESIDUAL + stage).to(device),
                               draws.uniforms(at_next, BONUS + stage).to(device))  # [rows, 1]
            next_tokens = invert_cdf(probs, last)
            if greedy_mask is not None:
                if greedy_argmax and k:
                    probs = torch.where(rejected[:, None], pi_at, bonus)
                next_tokens = torch.where(greedy_mask, argmax_last(probs), next_tokens)
    both = torch.stack([num_accepted, next_tokens]).tolist()  # the one device-to-host copy
    return RowsAcceptance(num_accepted=both[0], next_tokens=both[1])


def accept_greedy(draft_tokens: Sequence[Sequence[int]], num_drafted: Sequence[int], target_logits: torch.Tensor
                  ) -> RowsAcceptance:
    """Temperature-0 rows under the exact rule, without any distribution: a drafted token is accepted when it is
    the target's argmax there, and the next token is the argmax after the accepted prefix. The same outcome as
    `speculative_sample_rows` with one-hot draft and target distributions (a greedy draft's token has q(x) = 1).
    draft_tokens: [rows][k] on the host (padding past num_drafted[b] is never read); target_logits
    [rows, k + 1, vocab]. One device op and one copy to the host: the comparisons are a few host integers."""
    best = argmax_last(target_logits).tolist()  # [rows][k + 1]
    num_accepted, next_tokens = [], []
    for tokens, count, argmaxes in zip(draft_tokens, num_drafted, best):
        n = 0
        while n < count and tokens[n] == argmaxes[n]:
            n += 1
        num_accepted.append(n)
        next_tokens.append(argmaxes[n])
    return RowsAcceptance(num_accepted=num_accepted, next_tokens=next_tokens)


def sample_rows(probs: torch.Tensor, draws: Draws, offset: int, greedy: Sequence[bool]) -> torch.Tensor:
    """The draft's token per row at offset `offset` of its step (position starts[b] + offset): keyed, so it does not
    depend on how long the batch-mates draft. Gumbel rows share the target's noise there (the coupling), rejection
    rows invert the CDF with u(DRAFT); greedy rows take the argmax. [rows, vocab] -> [rows]."""
    offsets = torch.full((probs.shape[0], 1), offset, dtype=torch.long, device=probs.device)
    return draws.sample(probs[:, None], offsets, greedy)[:, 0]


def accept_own_draws(draft_tokens: torch.Tensor, num_drafted: Sequence[int], target_probs: torch.Tensor,
                     draws: Draws, greedy: Sequence[bool]) -> RowsAcceptance:
    """Chains verified against the target's own draw at every position (`Draws.own`: the Gumbel-max token under the
    Gumbel coupling, the inverse CDF with u(BONUS) under the rejection coupling, the argmax at temperature 0): a
    drafted token is accepted while it equals that draw, and the draw at the first mismatch (or after the last
    drafted token) is the next token. Each committed token is the target's own draw at its position, so the row
    writes `ar`'s tokens for the same seed whatever was drafted; a drafted token x is accepted with probability
    p(x) for a deterministic draft, P(Gumbel argmaxes agree) for a Gumbel-coupled draft model.
    draft_tokens [rows, k] (padding past num_drafted[b]), target_probs [rows, k + 1, vocab]."""
    rows, k = draft_tokens.shape
    device = target_probs.device
    own = draws.own(target_probs, torch.arange(k + 1, device=device), greedy)  # [rows, k + 1]
    if k:
        counts = torch.tensor(list(num_drafted), dtype=torch.long, device=device)
        match = (draft_tokens.to(device) == own[:, :k]) & (torch.arange(k, device=device)[None] < counts[:, None])
        num_accepted = match.long().cumprod(1).sum(1)  # [rows]
    else:
        num_accepted = torch.zeros(rows, dtype=torch.long, device=device)
    next_tokens = own.gather(1, num_accepted[:, None])[:, 0]
    both = torch.stack([num_accepted, next_tokens]).tolist()  # the one device-to-host copy
    return RowsAcceptance(num_accepted=both[0], next_tokens=both[1])


def warped_and_raw(logits: torch.Tensor, configs: Sequence[SamplingConfig]) -> tuple[torch.Tensor, torch.Tensor]:
    """(`warp_rows(logits, configs)`, `unwarped(logits)`): one tensor for both where no row warps anything
    (`warps_nothing`: the same softmax), for readers of the raw distributions beside the warped ones."""
    probs = warp_rows(logits, configs)
    return probs, probs if all(warps_nothing(c) for c in configs) else unwarped(logits)


def warp_rows(logits: torch.Tensor, configs: Sequence[SamplingConfig], greedy_scores: bool = False
              ) -> torch.Tensor:
    """Warp row b of logits [rows, ..., vocab] with configs[b]; rows sharing a config warp together. With
    `greedy_scores` a greedy row keeps its logits (float32) in place of the one-hot at their argmax: for readers that
    take only a greedy row's argmax (the exact rule's acceptance), so no one-hot is built."""
    if len(set(configs)) == 1:
        return logits.float() if greedy_scores and configs[0].greedy else warp(logits, configs[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[SamplingConfig, list[int]] = {}
    for b, config in enumerate(configs):
        groups.setdefault(config, []).append(b)
    for config, members in groups.items():
        index = torch.tensor(members, device=logits.device)
        out[index] = logits[index].float() if greedy_scores and config.greedy else warp(logits[index], config)
    return out
