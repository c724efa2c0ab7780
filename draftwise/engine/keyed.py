"""Counter-based randomness: every random number a request uses is a hash of (seed, position, purpose, index).

A request's draws are not taken from a stream (`torch.Generator`), where a number depends on how many came before:
that count follows the batch (how far the batch drafted, whether a row caught up on its prompt in this step or
the next), so a seeded answer changed with load. Here the uniform deciding anything about the token at absolute
sequence position t (prompt included) is `uniform(seed, t, purpose, index)`, whatever happened before.

Purposes (one per kind of decision, so that no two decisions share a number):
- DRAFT: the draft's sample at t (rejection coupling; inverse CDF of the draft's distribution);
- ACCEPT: the acceptance uniform of the drafted token at t (Algorithm 4: accept when u * q(x) < pi(x));
- RESIDUAL: the recovered token at t after a rejection; BONUS: the bonus token at t (and `ar`'s token under the
  rejection coupling);
- GUMBEL: the Gumbel noise G_t(v) of every vocabulary entry v at t (the drafter-invariant coupling below);
- STAGED (+ the above): staged speculative decoding's own acceptance between draft and companion.

Two couplings of draft and target (`Draws.gumbel`, per row):
- *rejection* (Leviathan et al.; Narasimhan et al. Algorithm 4): the draft samples x_t by inverse CDF with
  u(DRAFT), the target accepts it with u(ACCEPT) < pi(x)/q(x), else recovers with u(RESIDUAL); a bonus with
  u(BONUS). Keyed this way a row's answer does not depend on its batch-mates, but it still depends on *which*
  positions were drafted (a drafted position commits a token by the residual, a bonus position by the target), so on
  the draft length a step chose and on what the drafter proposed.
- *Gumbel* (drafter-invariant; Daliri et al. 2024, "Coupling without communication and drafter-invariant
  speculative decoding"): the target's token at t is argmax_v(log p_t(v) + G_t(v)), a draw from p_t (the Gumbel-max
  trick), G_t keyed by (seed, t). The draft samples argmax_v(log q_t(v) + G_t(v)) with the same G_t, a drafted token
  is accepted iff it equals the target's, and the first mismatch commits the target's. Every committed token is the
  target's Gumbel argmax, so the answer is `ar`'s with the same seed (which draws its tokens the same way), whatever
  the drafter, the draft length, the batch or other requests' history. Exact at any temperature, top-k and top-p;
  a draft token is accepted with probability P(argmax(log q + G) = argmax(log p + G)) >= (1 - TV) / (1 + TV)
  (TV = total variation distance of p and q; Daliri et al. Theorem), against 1 - TV for rejection sampling.

Everything is computed in torch, vectorised over rows and positions, on the rows' device: splitmix64's finaliser on
int64 lanes (multiplication wraps modulo 2**64; right shifts are made logical by a mask).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from draftwise.engine.sampling import argmax_last, invert_cdf

DRAFT, ACCEPT, RESIDUAL, BONUS, GUMBEL = 1, 2, 3, 4, 5
STAGED = 8  # added to ACCEPT / RESIDUAL / BONUS for staged decoding's companion step
COUPLINGS = ("gumbel", "rejection")


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 lanes."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (a bijection of 64-bit words) on int64 lanes."""
    z = z ^ _shr(z, 30)
    z = z * _M1
    z = z ^ _shr(z, 27)
    z = z * _M2
    return z ^ _shr(z, 31)


def keys(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """The key of (seed, position, purpose): seeds [rows] int64, positions [rows, n] int64 -> [rows, n] int64."""
    base = mix(seeds + _GOLDEN)[:, None]  # [rows, 1]
    return mix(base + mix(positions * 16 + purpose + _GOLDEN))


def to_unit(z: torch.Tensor) -> torch.Tensor:
    """int64 words -> float64 uniforms in (0, 1): the top 53 bits, plus half a step (never 0, never 1)."""
    return (_shr(z, 11).double() + 0.5) * (2.0 ** -53)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """[rows, n] float64 uniforms for (seed, position, purpose)."""
    return to_unit(mix(keys(seeds, positions, purpose)))


BLOCK = 64  # vocabulary entries per block of the lazy Gumbel-max (a power of two)


def _block_noise(seeds: torch.Tensor, positions: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          torch.Tensor]:
    """Per block of BLOCK entries: its key [rows, n, blocks] int64, the least of its Exp(1) draws (an Exp(BLOCK)
    draw, float64) and where in the block it sits (uniform, from the key's low bits, disjoint from the 53 bits
    the draw reads)."""
    block_keys = mix(keys(seeds, positions, GUMBEL)[..., None]
                     + torch.arange(1, blocks + 1, dtype=torch.long, device=seeds.device) * _GOLDEN)
    least = -torch.log(to_unit(block_keys)) / BLOCK
    return block_keys, least, block_keys & (BLOCK - 1)


def _within(block_keys: torch.Tensor, least: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The Exp(1) draws of whole blocks: block keys, least and argmin [m] -> [m, BLOCK] float64: the least at its
    place, least + an Exp(1) draw keyed by (block key, entry) elsewhere (the memoryless property: above their
    minimum the others are independent Exp(1))."""
    entry = mix(mix(block_keys + _GOLDEN)[:, None]
                + torch.arange(1, BLOCK + 1, dtype=torch.long, device=block_keys.device) * _GOLDEN)
    e = least[:, None] - torch.log(to_unit(entry))
    return e.scatter_(1, at[:, None], least[:, None])


def exponentials(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """E(v) for every vocabulary entry v (iid Exp(1); -log E(v) is the Gumbel noise G_t(v)), keyed by (seed,
    position, v): seeds [rows], positions [rows, n] -> [rows, n, vocab] float64. The draws are built block by block
    (`_block_noise`, `_within`) so that `gumbel_argmax` can skip blocks; this full form is its reference."""
    blocks = -(-vocab // BLOCK)
    block_keys, least, at = _block_noise(seeds, positions, blocks)
    e = _within(block_keys.reshape(-1), least.reshape(-1), at.reshape(-1))
    return e.reshape(*least.shape[:2], blocks * BLOCK)[..., :vocab]


def gumbel_argmax(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """argmax_v(log probs(v) + G(v)) = argmax_v probs(v) / E(v), E keyed by (seed, position): probs [rows, n,
    vocab] (unnormalised; zero entries are never chosen), seeds [rows], positions [rows, n] -> [rows, n] int64. A
    draw from norm(probs), and the same function of E for the target and the draft (the coupling).

    Lazy, exact: E(v) >= its block's least draw m_b, so a block whose largest probability over m_b is below the
    best score already seen (each block's argmin entry, p / m_b) cannot hold the winner and its draws are never
    computed. About one block in a few hundred is opened: the vocabulary-wide cost is a maximum per block."""
    rows, n, vocab = probs.shape
    blocks = -(-vocab // BLOCK)
    device = probs.device
    padded = probs.float()
    if blocks * BLOCK != vocab:
        padded = F.pad(padded, (0, blocks * BLOCK - vocab))
    padded = padded.reshape(rows, n, blocks, BLOCK)
    block_keys, least, at = _block_noise(seeds.to(device), positions.to(device), blocks)  # [rows, n, blocks]
    at_prob = padded.gather(-1, at[..., None])[..., 0].double()
    best, best_block = (at_prob / least).max(-1)  # [rows, n]: the best argmin entry
    tokens = best_block * BLOCK + at.gather(-1, best_block[..., None])[..., 0]
    largest = padded.amax(-1).double()  # [rows, n, blocks]
    opened = ((largest > 0) & (largest >= best[..., None] * least)).nonzero()  # [m, 3]: row, position, block
    if opened.numel():
        r, i, b = opened.unbind(1)
        e = _within(block_keys[r, i, b], least[r, i, b], at[r, i, b])  # [m, BLOCK]
        score, entry = (padded[r, i, b].double() / e).max(-1)  # [m]
        flat = r * n + i
        top = best.reshape(-1).clone().scatter_reduce_(0, flat, score, "amax")  # [rows * n]
        wins = score >= top[flat]
        wins &= score > best.reshape(-1)[flat]
        tokens = tokens.reshape(-1).index_put_((flat[wins],), (b * BLOCK + entry)[wins]).reshape(rows, n)
    return tokens


def seeds_tensor(seeds: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor([_signed(int(s)) for s in seeds], dtype=torch.long, device=device)


class Draws:
    """The keyed randomness of a step's rows: row b's seed, the absolute position of the first token this step
    decides for it (`starts[b]`: the length of its sequence, the pending token included) and its coupling
    (`gumbel[b]`). Offsets count from the start: offset j is position starts[b] + j."""

    def __init__(self, seeds: Sequence[int], starts: Sequence[int], gumbel: Sequence[bool],
                 device: torch.device | str, streams: Sequence[torch.Generator] | None = None) -> None:
        self.streams = streams  # the rows' torch.Generators, for a caller that indexes the draws (`draws[b]`)
        self.seeds = [int(s) for s in seeds]
        self.starts = [int(s) for s in starts]
        self.gumbel = [bool(g) for g in gumbel]
        self.device = torch.device(device)
        self._seeds_t = seeds_tensor(self.seeds, self.device)
        self._starts_t = torch.tensor(self.starts, dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        return len(self.seeds)

    def subset(self, index: Sequence[int]) -> "Draws":
        return Draws([self.seeds[i] for i in index], [self.starts[i] for i in index],
                     [self.gumbel[i] for i in index], self.device,
                     None if self.streams is None else [self.streams[i] for i in index])

    def positions(self, offsets: torch.Tensor) -> torch.Tensor:
        """[rows, n] offsets -> absolute positions."""
        return self._starts_t[:, None] + offsets.to(self.device)

    def uniforms(self, offsets: torch.Tensor, purpose: int) -> torch.Tensor:
        """[rows, n] float64 uniforms at offsets [rows, n] (or [n], the same for every row)."""
        if offsets.ndim == 1:
            offsets = offsets[None].expand(len(self), -1)
        return uniforms(self._seeds_t, self.positions(offsets), purpose)

    def own(self, probs: torch.Tensor, offsets: torch.Tensor, greedy: Sequence[bool]) -> torch.Tensor:
        """The target's own draw at each offset: probs [rows, n, vocab] (greedy rows: any scores, read for their
        argmax), offsets [rows, n] -> [rows, n]. Gumbel rows: argmax(log p + G); rejection rows: inverse CDF with u(BONUS) (`ar`'s draw under
        that coupling); greedy rows: the argmax."""
        return self._draw(probs, offsets, greedy, BONUS)

    def sample(self, probs: torch.Tensor, offsets: torch.Tensor, greedy: Sequence[bool]) -> torch.Tensor:
        """The draft's draw at each offset (the same shapes as `own`): Gumbel rows with the target's G (the
        coupling), rejection rows by inverse CDF with u(DRAFT)."""
        return self._draw(probs, offsets, greedy, DRAFT)

    def _draw(self, probs: torch.Tensor, offsets: torch.Tensor, greedy: Sequence[bool], purpose: int
              ) -> torch.Tensor:
        rows, n, vocab = probs.shape
        if offsets.ndim == 1:
            offsets = offsets[None].expand(rows, -1)
        greedy = list(greedy)
        if all(greedy):
            return argmax_last(probs)
        gumbel = [b for b in range(rows) if self.gumbel[b] and not greedy[b]]
        plain = [b for b in range(rows) if not self.gumbel[b] and not greedy[b]]
        device = probs.device
        seeds, positions = self._seeds_t.to(device), self.positions(offsets).to(device)
        if len(gumbel) == rows:  # one kind of row: no copies of the distributions
            return gumbel_argmax(probs, seeds, positions)
        if len(plain) == rows:
            return invert_cdf(probs.reshape(-1, vocab), uniforms(seeds, positions, purpose).reshape(-1, 1)
                              ).reshape(rows, n)
        out = argmax_last(probs)  # [rows, n]: greedy rows keep it
        if gumbel:
            index = torch.tensor(gumbel, device=device)
            out[index] = gumbel_argmax(probs[index], seeds[index], positions[index])
        if plain:
            index = torch.tensor(plain, device=device)
            u = uniforms(seeds[index], positions[index], purpose)  # [m, n]
            out[index] = invert_cdf(probs[index].reshape(-1, vocab), u.reshape(-1, 1)).reshape(len(plain), n)
        return out

    def generator(self, b: int, purpose: int = 0) -> torch.Generator:
        """A torch.Generator for row b's decisions at its start position that need a stream (a beam search's
        Gumbel-top-k, a reference implementation in a test): seeded by the key of (seed, start, purpose)."""
        key = keys(self._seeds_t[b: b + 1].cpu(), torch.tensor([[self.starts[b]]]), 64 + purpose)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(key) & ((1 << 63) - 1))
        return generator

    def __getitem__(self, b: int) -> torch.Generator:
        """Row b's stream (its request's torch.Generator, numbers taken in order) where the rows gave theirs, else
        `generator(b)`: for code written against streams (a reference walk in a test, a beam search)."""
        return self.streams[b] if self.streams is not None else self.generator(b)


def row_draws(rows: Sequence, device: torch.device | str) -> Draws:
    """The keyed draws of a step's rows (engine `Row`s): each row's seed, the position of the first token the step
    decides (its sequence's length: the prompt, the committed tokens and the pending one) and its coupling."""
    return Draws([r.seed for r in rows], [len(r.sequence) for r in rows], [r.gumbel for r in rows], device,
                 [r.generator for r in rows])


def fresh_seed() -> int:
    """A seed for a request that gave none (reported in its stats, so its answer can be reproduced)."""
    import secrets

    return secrets.randbits(63)


def as_draws(draws, rows: int, device: torch.device | str) -> Draws:
    """`Draws`, or (for callers that still hold streams) a sequence of torch.Generators: each gives a fresh seed
    from its stream and starts at position 0, with the rejection coupling."""
    if isinstance(draws, Draws):
        return draws
    generators = list(draws)
    assert len(generators) == rows, (len(generators), rows)
    seeds = [int(torch.randint(0, 2 ** 62, (1,), generator=g, device=g.device)) for g in generators]
    return Draws(seeds, [0] * rows, [False] * rows, device)
