"""Warping and sampling: pure tensor functions, the same for every model.

Every distribution a method compares (target, draft, companion) goes through
`warp` with the same `SamplingConfig`, so ratios are taken between like and like.
Temperature 0 means greedy: the warped distribution is one-hot at the argmax
(the first index on ties, as `torch.argmax` and transformers' greedy search do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import DraftwiseError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise DraftwiseError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise DraftwiseError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:  # also False for NaN
            raise DraftwiseError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
        probs = _top_p(probs, config.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    # Keep the smallest set of most likely tokens whose mass reaches top_p: a token
    # is dropped when the mass strictly before it (in descending order) already does.
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False  # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def unwarped(logits: torch.Tensor) -> torch.Tensor:
    """The model's own distribution (temperature 1, no truncation): [..., vocab] float32.

    Deferral rules read these (seed 003 §C.1) while the mixture uses warped ones.
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
    probability zero never is. On CPU this is ~10x faster than `torch.multinomial`
    over a 49k vocabulary; the cumulative sum runs in float64 to keep rounding negligible.
    """
    assert probs.ndim == 2, probs.shape
    cdf = torch.cumsum(probs.double(), dim=-1)  # [rows, vocab]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
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
