"""Warping and sampling: pure tensor functions, the same for every model.

Every distribution a method compares (target, draft, companion) goes through
`warp` with the same `SamplingConfig`, so ratios are taken between like and like.
Temperature 0 means greedy: the warped distribution is one-hot at the argmax
(the first index on ties, as `torch.argmax` and transformers' greedy search do).
So does any temperature below `GREEDY_BELOW` (1e-5, as vLLM): `is_greedy` is the one
place that decides it, and `SamplingConfig` stores such a temperature as 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftwise.errors import DraftwiseError


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy, as in vLLM: dividing logits by a tiny temperature overflows to inf (any
T below about 1.2e-38 made every logit inf or -inf, and softmax NaN or a wrong token), and long before that the
distribution is one-hot at the argmax in all but ties."""


def is_greedy(temperature: float) -> bool:
    """Whether `temperature` means greedy decoding: the one place this is decided (`SamplingConfig.greedy`, the
    registry's choice of draft head)."""
    return temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise DraftwiseError(f"temperature must be >= 0 (0, or below {GREEDY_BELOW:g}, means greedy), "
                                 f"got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise DraftwiseError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:  # also False for NaN
            raise DraftwiseError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}")
        if is_greedy(self.temperature):  # stored as 0: every reader (plans, profiles, trained files) sees greedy
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


SMALL_ARGMAX = 16384  # elements up to which PyTorch's own argmax is quicker than the two block passes (one head row:
# 29 against 109 microseconds, measured on Zen 3)


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`, the same indices (the first on ties; a NaN counts as the largest), faster on CPU for a
    vocabulary: PyTorch's argmax walks each row with its index in scalar steps, while a block maximum is vectorised.
    The block holding the first maximum is found from the blocks' maxima, then the first maximum inside it."""
    size = x.shape[-1]
    block = next((b for b in (256, 128, 64, 32) if size % b == 0 and size >= 8 * b), 0)
    if not block or x.device.type != "cpu" or x.numel() <= SMALL_ARGMAX:
        return x.argmax(-1)
    blocks = x.reshape(*x.shape[:-1], size // block, block)
    first = blocks.amax(-1).argmax(-1, keepdim=True)  # [..., 1] the first block holding the maximum
    inside = blocks.gather(-2, first[..., None].expand(*first.shape, block)).squeeze(-2).argmax(-1)
    return first.squeeze(-1) * block + inside


def warp(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Turn logits into the sampling distribution: temperature, then top-k, then top-p.

    logits: [..., vocab] (any float dtype). Returns float32 probabilities [..., vocab].
    The order (temperature, top-k, top-p) matches transformers' `generate`.
    """
    logits = logits.float()
    if config.greedy:
        return one_hot_argmax(logits)
    if config.temperature != 1.0:
        logits = logits / config.temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1.0:
        # with top-k on, its k tokens and one zero past them are all top-p needs to look at
        top_k_on = 0 < config.top_k < vocab
        probs = _top_p(probs, config.top_p, (config.top_k + 1,) if top_k_on else TOP_P_CANDIDATES)
    return probs


TOP_P_CANDIDATES = (128, 2048)  # top-p looks at this many likely tokens first (top-k off); then the full sort


def _dropped(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p on probabilities sorted in descending order: [..., n] -> [..., n] bool, True = dropped.

    A token is dropped when the mass strictly before it already reaches top_p; the most
    likely token is always kept.
    """
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    return drop_sorted


def _top_p_kept_full(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: sort the whole vocabulary. [rows, vocab] -> kept probabilities, unnormalised."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool).scatter(-1, order, _dropped(sorted_probs, top_p))
    return probs.masked_fill(drop, 0.0)


def _top_p_candidates(probs: torch.Tensor, top_p: float, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-p from the m most likely tokens of each row [rows, vocab]: (index [rows, m], their kept
    probabilities [rows, m] (0 = dropped), exact [rows] bool).

    A row's answer is `exact` (bit-identical to `_top_p_kept_full`) when
    - everything past the candidates is dropped: the candidates' last value group (the tokens
      tied with the smallest candidate, which may continue past the candidates) starts at a
      dropped position, and the mass before a position only grows, so every later position is
      dropped too. Or that smallest value is 0: then every token past the candidates is 0, and
      dropping it or not changes nothing;
    - no group of tied values straddles the cut: which tokens of such a group the full sort
      keeps depends on its (unstable) order of ties.
    The candidates' cumulative sums equal the first entries of the full row's (the CPU kernel
    sums sequentially), so the decisions before the cut are the same numbers.
    """
    values, index = torch.topk(probs, m, dim=-1)  # [rows, m], descending
    drop_sorted = _dropped(values, top_p)
    smallest = values[:, -1:]
    group_start = (values > smallest).sum(-1, keepdim=True)  # [rows, 1]
    rest_dropped = drop_sorted.gather(-1, group_start)[:, 0] | (smallest[:, 0] == 0)
    straddles = ((values[:, 1:] == values[:, :-1]) & (drop_sorted[:, 1:] != drop_sorted[:, :-1])).any(-1)
    return index, values.masked_fill(drop_sorted, 0.0), rest_dropped & ~straddles


def _top_p(probs: torch.Tensor, top_p: float, candidates: tuple[int, ...] = TOP_P_CANDIDATES) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, renormalised. [..., vocab].

    Sorting a whole vocabulary per row is slow on CPU, and a `torch.topk` of a few hundred tokens is cheap and
    usually holds the nucleus. So each row tries the candidate counts in turn (with top-k on, its k tokens and
    one zero past them), keeps the answer where it is provably the full sort's, and only the rows left over take
    the full sort (a flat row pays for the tries as well).
    """
    vocab = probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    kept: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # rows still without an answer; None = all of them
    for m in candidates:
        if not 0 < m < vocab:
            break
        pending = flat if rows is None else flat[rows]
        index, values, exact = _top_p_candidates(pending, top_p, m)
        if rows is None:  # first try: every row at once (wrong rows are overwritten below)
            kept = torch.zeros_like(flat).scatter_(-1, index, values)
            rows = (~exact).nonzero().squeeze(-1)
        else:
            kept[rows[exact]] = torch.zeros_like(pending[exact]).scatter_(-1, index[exact], values[exact])
            rows = rows[~exact]
        if rows.numel() == 0:
            break
    if kept is None:
        kept = _top_p_kept_full(flat, top_p)
    elif rows.numel():
        kept[rows] = _top_p_kept_full(flat[rows], top_p)
    return (kept / kept.sum(dim=-1, keepdim=True)).reshape(probs.shape)


def warps_nothing(config: SamplingConfig) -> bool:
    """Whether `warp` under `config` gives the model's own distribution, `unwarped`'s, bit for bit (temperature 1,
    no top-k, no top-p)."""
    return config.temperature == 1.0 and config.top_k == 0 and config.top_p == 1.0


def unwarped(logits: torch.Tensor) -> torch.Tensor:
    """The model's own distribution (temperature 1, no truncation): [..., vocab] float32.

    Deferral rules read these (Narasimhan et al. §C.1) while the mixture uses warped ones.
    """
    return torch.softmax(logits.float(), dim=-1)


def one_hot_argmax(scores: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> one-hot float32 at the argmax of the last dimension."""
    index = scores.argmax(dim=-1, keepdim=True)
    return torch.zeros(scores.shape, dtype=torch.float32, device=scores.device).scatter_(-1, index, 1.0)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row by inverting the CDF with one uniform per row.

    probs: [rows, vocab], non-negative (rows need not be normalised). Returns [rows] int64.
    The first index whose cumulative mass exceeds u * total is drawn, so a token of
    probability zero never is. On CPU this is much faster than `torch.multinomial` over a large vocabulary; the
    cumulative sum runs in float64 to keep rounding negligible.
    """
    assert probs.ndim == 2, probs.shape
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    return invert_cdf(probs, u)


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row at uniform u: probs [rows, vocab] (unnormalised), u [rows, 1] float64 -> [rows]."""
    cdf = torch.cumsum(probs.double(), dim=-1)  # [rows, vocab]
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [rows, 1]
    return index.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """The one generator of a request. seed=None draws a fresh seed (reported in stats)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator
