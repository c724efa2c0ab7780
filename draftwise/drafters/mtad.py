"""MTAD and MTJD (the MTAD paper) on the batched engine: beam-search drafts over rows, joint verification.

`BeamRowsDrafter` proposes, for every row, the best of `W` beams over the row's drafting
limit, with the beam's cumulative joint log-probability `log q(x_{1:j})` for each prefix.
It runs over a *base* drafter that owns one cache row per request and follows the
engine's rows (admit, move, rewind, release): an independent draft model
(`ModelBeams`), the target's own weights in a cache of their own (MTJD), or an EAGLE
head (`drafters.eagle.EagleRowsDrafter`, whose state each beam carries).

One `propose`:
- **begin**: one forward feeds each row its pending tokens in its base cache row and
  scores the first beam token there;
- the first selection picks `W` candidates per row; the base rows are copied into
  `W` scratch rows each (rows `n .. n + n W - 1` of the same cache, so the prompt is
  never recomputed per beam);
- each later step feeds one token per scratch row (batch `n W`) and copies the
  scratch rows after their beams' parents (`PositionCache.copy_rows`), as
  transformers' beam search reorders its cache;
- the scratch rows are dropped at the end. Base rows never hold beam tokens: the
  next `begin` feeds the tokens the engine committed.

Selection per row, over the `W x V` joint scores `log q(beam) + log T(q)(x)`, `T` the
request's warping: sampled beams (temperature > 0) are drawn *without replacement*
with the Gumbel-top-k trick (equivalent to drawing one candidate at a time
proportionally to `p_beam`, eq. 2) with the row's own generator; at temperature 0 the
top `W` joint scores of the model's own log-probabilities (a one-hot warp would
leave a single candidate). Candidates of probability 0 (top-k below `W`, a peaked
warp) are dead beams: score -inf, never chosen over a live one.

MTAD verification (Algorithm 1, `rules.mtad.MTADRule.prefix`): the target scores the best beam in
the engine's one verification forward; the longest prefix `j` with
`min(1, p(x_{1:j}) / q(x_{1:j})) > tau` is kept, where earlier prefixes may fail, and
one token is sampled from the target at position `j + 1` (the engine's bonus). Both
joints use the same warping (at temperature 0 the models' own distributions). MTAD is
lossy by design: it aims at a higher joint likelihood (lower perplexity), not at the
target's distribution.

MTJD (Def. 3.1) is the same drafter over the target's weights with every beam token
kept (`AcceptDraftRule`): each step commits the best of `W` beams over `k` target
tokens and then the verification forward's own next token.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from draftwise.engine.sampler import warp_rows
from draftwise.drafters.base import ModelRowsDrafter, WrappingDrafter
from draftwise.engine.protocols import RowsDraft, empty_draft, pad_rows
from draftwise.errors import DraftwiseError
from draftwise.engine.sampling import SamplingConfig, _dropped, unwarped


def beam_candidates(logits: torch.Tensor, configs: Sequence[SamplingConfig], beams: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, vocab] logits -> (log-probabilities [rows, C], their tokens [rows, C]): the only next tokens a beam of
    each row can take, scored as `beam_log_probs` scores them (-inf pads a row with fewer).

    A temperature-0 row: its `beams` most likely tokens (the top `beams` joint scores over a beam's children are
    among them). A row with top-k on: its k tokens, warped among themselves (`_top_k_log_probs`). Any other row:
    the whole vocabulary. A beam step then selects among beams x C scores, not beams x vocabulary."""
    rows, vocab = logits.shape
    groups: dict[SamplingConfig, list[int]] = {}
    for b, config in enumerate(configs):
        groups.setdefault(config, []).append(b)
    parts = []
    for config, members in groups.items():
        part = logits[torch.tensor(members, device=logits.device)]
        if config.greedy:
            values, tokens = torch.topk(unwarped(part), min(beams, vocab), dim=-1)
            values = torch.log(values)
        elif 0 < config.top_k < vocab:
            values, tokens = _top_k_log_probs(part, config)
        else:
            values = torch.log(warp_rows(part, [config] * len(members)))
            tokens = torch.arange(vocab, device=logits.device).expand(len(members), vocab)
        parts.append((members, values, tokens))
    # at least `beams` columns: a row with fewer candidates keeps its dead beams (-inf), as over the vocabulary
    width = max([min(beams, vocab)] + [values.shape[1] for _, values, _ in parts])
    scores = torch.full((rows, width), float("-inf"), device=logits.device)
    ids = torch.zeros(rows, width, dtype=torch.long, device=logits.device)
    for members, values, tokens in parts:
        index = torch.tensor(members, device=logits.device)
        scores[index, : values.shape[1]] = values
        ids[index, : tokens.shape[1]] = tokens
    return scores, ids


def _top_k_log_probs(logits: torch.Tensor, config: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (then top-p) warping over the k most likely tokens alone: (log-probabilities, tokens) [rows, k],
    descending, -inf where top-p drops. A row whose k-th logit ties the next one (the full warp keeps every tied
    token) takes the whole vocabulary instead; then [rows, vocab]."""
    x = logits.float()
    if config.temperature != 1.0:
        x = x / config.temperature
    k = config.top_k
    values, tokens = torch.topk(x, k + 1, dim=-1)
    if bool((values[:, k - 1] == values[:, k]).any()):  # a tie at the cut: the full warp's answer
        probs = warp_rows(logits, [config] * logits.shape[0])
        return torch.log(probs), torch.arange(x.shape[1], device=x.device).expand_as(probs)
    probs = torch.softmax(values[:, :k], dim=-1)
    if config.top_p < 1.0:
        kept = probs.masked_fill(_dropped(probs, config.top_p), 0.0)
        probs = kept / kept.sum(-1, keepdim=True)
    return torch.log(probs), tokens[:, :k]


def beam_log_probs(logits: torch.Tensor, configs: Sequence[SamplingConfig]) -> torch.Tensor:
    """[rows, vocab] logits -> the log-probabilities beams are scored with (-inf where warped away): the model's own
    distribution for a temperature-0 row, the warped one otherwise (a top-k row's among its k tokens, as
    `beam_candidates` scores them)."""
    out = torch.log(unwarped(logits))
    warped = [b for b, c in enumerate(configs) if not c.greedy]
    if warped:
        scores, ids = beam_candidates(logits[warped], [configs[b] for b in warped], 1)
        part = torch.full((len(warped), out.shape[1]), float("-inf"), device=out.device)
        live = torch.isfinite(scores)  # padding columns hold token 0 at -inf: never written over a real score
        part[live.nonzero()[:, 0], ids[live]] = scores[live]
        out[warped] = part
    return out


def select_candidates(scores: torch.Tensor, n: int, configs: Sequence[SamplingConfig],
                      generators: Sequence[torch.Generator], drawing: Sequence[bool] | None = None) -> torch.Tensor:
    """[rows, C] joint log-scores -> [rows, n] indices: the top n (temperature 0) or n drawn without replacement
    (Gumbel-top-k, with each row's generator). -inf scores are chosen only when fewer than n are finite. A row not
    `drawing` (its beams are done) takes no random number, so its generator does not depend on its batch-mates.

    A drawing row takes one uniform per finite score, in index order: a warped row (top-k, top-p) has few (the
    Gumbel keys of a -inf score stay -inf, so drawing for them would change nothing but the cost)."""
    k = min(n, scores.shape[1])
    draws = [not c.greedy and (drawing is None or drawing[b]) for b, c in enumerate(configs)]
    if not all(draws):  # the greedy rows and those not drawing: the top k
        chosen = torch.topk(scores, k, dim=-1).indices
    else:
        chosen = torch.empty(scores.shape[0], k, dtype=torch.long, device=scores.device)
    for b, generator in enumerate(generators):
        if not draws[b]:
            continue
        live = torch.isfinite(scores[b]).nonzero().squeeze(1)  # ascending indices
        u = torch.rand(live.shape[0], generator=generator, device=scores.device, dtype=torch.float64)
        keys = scores[b, live].double() - torch.log(-torch.log(u.clamp_(min=1e-300)))
        top = live[torch.topk(keys, min(k, live.shape[0])).indices]
        if top.shape[0] < k:  # dead beams: any -inf candidates fill the rest
            dead = torch.ones(scores.shape[1], dtype=torch.bool, device=scores.device)
            dead[live] = False
            top = torch.cat([top, dead.nonzero().squeeze(1)[: k - top.shape[0]]])
        chosen[b] = top
    return chosen


class ModelBeams(ModelRowsDrafter):
    """A model's rows for beam search (a draft model's, or the target's weights in a cache of their own)."""

    def begin(self, rows, limits: Sequence[int]) -> tuple[torch.Tensor, None, list[int]]:
        """Feed each row its pending tokens (at most CATCH_UP: a row still catching up drafts nothing); returns
        the next-token logits [rows, vocab], no state, and the rows' drafting limits."""
        lengths = self.runner.lengths
        for b, row in enumerate(rows):  # a row holding its whole sequence feeds its last token again
            if lengths[b] >= len(row.sequence):
                self.runner.trim_row(b, len(row.sequence) - 1)
        feed, counts, limits = self.pending_feed(rows, limits)
        at = torch.tensor(counts, device=self.runner.device)[:, None] - 1
        return self.runner.forward_rows(feed, counts, logits_at=at).logits[:, -1], None, limits

    def beam_step(self, tokens: torch.Tensor, states: Any, begin: int) -> tuple[torch.Tensor, None]:
        ids = tokens.to(self.runner.device)[:, None]
        return self.runner.forward_rows(ids, [1] * ids.shape[0], begin=begin).logits[:, -1], None


class BeamRowsDrafter(WrappingDrafter):
    """MTAD's drafter (MTJD's over the target's weights): per row, the best of `num_beams` beams and its joint
    log-probabilities. See the module docstring."""

    def __init__(self, base: Any, vocab_size: int, num_beams: int) -> None:
        check_beams(num_beams)
        super().__init__(base)  # the rows follow the base's (admit / rewind / move_row / release)
        self.base = base  # ModelBeams or an EagleRowsDrafter: begin / beam_step
        self.vocab_size = vocab_size
        self.num_beams = num_beams
        self.device = base.runner.device

    @torch.inference_mode()
    def propose(self, rows, limits: Sequence[int]) -> RowsDraft:
        n, beams, vocab = len(rows), self.num_beams, self.vocab_size
        if max(limits, default=0) == 0:
            return empty_draft(n, vocab, self.device)
        logits, state, limits = self.base.begin(rows, limits)
        width = max(limits, default=0)
        if width == 0:
            return empty_draft(n, vocab, self.device)
        configs = [r.request.sampling for r in rows]
        generators = [r.generator for r in rows]
        cache = self.base.runner.cache
        scores, ids = beam_candidates(logits[:, :vocab], configs, beams)  # [rows, C] the first token's joint
        chosen = select_candidates(scores, beams, configs, generators,  # [rows, W'] W' = min(W, C)
                                   [limit > 0 for limit in limits])
        width_w = chosen.shape[1]
        parents = torch.zeros_like(chosen)
        tokens = ids.gather(1, chosen)
        scores = scores.gather(1, chosen).float()  # [rows, W']
        history, joints = tokens[:, :, None], scores[:, :, None]  # [rows, W', t]
        done_tokens: list[torch.Tensor | None] = [None] * n
        done_joint: list[torch.Tensor | None] = [None] * n
        self._finish(limits, 1, history, joints, scores, done_tokens, done_joint)
        if width > 1:  # every row's base row broadcast to its W' scratch rows
            cache.copy_rows([b for b in range(n) for _ in range(width_w)], n)
            if state is not None:
                state = state.repeat_interleave(width_w, 0)
        for t in range(1, width):
            logits, state = self.base.beam_step(tokens.flatten(), state, n)  # [rows W', vocab]
            step, ids = beam_candidates(logits[:, :vocab], [c for c in configs for _ in range(width_w)], width_w)
            size = step.shape[1]  # C: each beam's candidate children
            joint = (scores[:, :, None] + step.view(n, width_w, size)).flatten(1)  # [rows, W' C]
            chosen = select_candidates(joint, width_w, configs, generators, [t < limit for limit in limits])
            parents = torch.div(chosen, size, rounding_mode="floor")
            tokens = ids.view(n, width_w * size).gather(1, chosen)
            scores = joint.gather(1, chosen).float()
            history = torch.cat([history.gather(1, parents[:, :, None].expand(-1, -1, t)), tokens[:, :, None]], 2)
            joints = torch.cat([joints.gather(1, parents[:, :, None].expand(-1, -1, t)), scores[:, :, None]], 2)
            self._finish(limits, t + 1, history, joints, scores, done_tokens, done_joint)
            if t + 1 < width:  # the scratch rows follow their beams' parents
                sources = (n + torch.arange(n)[:, None] * width_w + parents.cpu()).flatten().tolist()
                cache.copy_rows(sources, n)
                if state is not None:
                    state = state.view(n, width_w, -1).gather(
                        1, parents[:, :, None].expand(-1, -1, state.shape[-1])).flatten(0, 1)
        cache.drop_rows(n)
        counts = [int(limit) for limit in limits]
        found = [t if t is not None else torch.zeros(0, dtype=torch.long, device=self.device) for t in done_tokens]
        draft_tokens, _ = pad_rows([t.tolist() for t in found])
        draft_tokens = draft_tokens.to(self.device)
        k = draft_tokens.shape[1]
        joint = torch.zeros(n, k, device=self.device)
        for b, values in enumerate(done_joint):
            if values is not None:
                joint[b, : values.shape[0]] = values
        return RowsDraft(draft_tokens, None, counts, joint=joint, vocab_size=vocab)  # one-hot: the beams' tokens

    @staticmethod
    def _finish(limits: Sequence[int], length: int, history: torch.Tensor, joints: torch.Tensor,
                scores: torch.Tensor, done_tokens: list, done_joint: list) -> None:
        """Rows whose limit is `length` keep their best beam now."""
        for b, limit in enumerate(limits):
            if limit == length:
                best = int(torch.argmax(scores[b]))
                done_tokens[b] = history[b, best]
                done_joint[b] = joints[b, best]


def check_beams(num_beams: int) -> None:
    if num_beams < 1:
        raise DraftwiseError(f"num_beams must be >= 1, got {num_beams}")
