"""Speculative Verification (Kim et al.): a companion model decides how many drafted
tokens the target verifies, across a batch.

The pieces, each named after the paper:

- `indicators`: for each drafted token t, S = sum_v min(P_d(v), P_c(v)) (Def. D.1) and
  A = min(1, P_c(t) / P_d(t)) (Def. D.2), from the draft's and the companion's distributions at
  the same position. Sampling rows use the distributions the tokens were drawn from; greedy rows
  use the unwarped (temperature-1) ones, since one-hot distributions carry no information.
- `AcceptanceTable`: P(accept | S, A) estimated by binning profiled samples (Def. D.8), with
  equal-width or adaptive (quantile) bins. The profiled quantity X is the target's acceptance
  probability of the drafted token, min(1, pi(t) / P_d(t)), whose mean in a bin estimates the
  bin's acceptance rate with less variance than the 0/1 outcome.
- `expected_accepted`: E(N | gamma) (Def. D.4).
- `LatencyModel`: the target's verification latency on this machine, profiled as a function of
  the rows in the batch and the tokens each verifies (Assumption D.10), plus the step's fixed
  drafting cost.
- `schedule`: §5's batch scheduler. Every row verifies its bonus position; drafted tokens are
  added one at a time, from any row, highest marginal gain in expected committed tokens first,
  while the batch's estimated goodput (committed tokens per second) rises.

SV only chooses *which prefix* of each draft the target sees; the choice reads draft-side
information only (draft, companion), so the verified tokens go through the exact speculative
sampling rule and the output keeps the target's distribution. Dropped tokens are discarded.

Goodput counts committed tokens: a row that verifies gamma' drafted tokens commits
1 + N of them (N accepted plus the recovered or bonus token), so verifying nothing still
commits one token per row and the scheduler compares against plain decoding.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from draftwise.errors import DraftwiseError

PROFILE_VERSION = 1
SETTING_KEYS = ("target", "draft", "companion", "temperature", "top_p", "top_k")
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "weights" / "sv-profiles"


def profile_setting(target: str, draft: str | None, companion: str | None, sampling: Any) -> dict[str, Any]:
    """What a profile is valid for: the three models and the sampling setting (greedy: temperature 0)."""
    greedy = sampling.greedy
    return {"target": target, "draft": draft, "companion": companion,
            "temperature": 0.0 if greedy else float(sampling.temperature),
            "top_p": 1.0 if greedy else float(sampling.top_p), "top_k": 0 if greedy else int(sampling.top_k)}


def shipped_profile(setting: dict[str, Any], keys: Sequence[str] = SETTING_KEYS) -> Path | None:
    """The shipped profile (draftwise/weights/sv-profiles/) built for this setting, if any."""
    if not SHIPPED_DIR.is_dir():
        return None
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        try:
            if SVProfile.load(path).mismatch(setting, keys) is None:
                return path
        except DraftwiseError:
            continue
    return None


# ---------------------------------------------------------------- indicators (Def. D.1, D.2)

def indicators(draft_probs: torch.Tensor, companion_probs: torch.Tensor, tokens: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """S and A per drafted token: [rows, k, vocab] x 2, [rows, k] -> ([rows, k], [rows, k])."""
    similarity = torch.minimum(draft_probs, companion_probs).sum(-1)
    q_d = draft_probs.gather(-1, tokens[..., None]).squeeze(-1)
    q_c = companion_probs.gather(-1, tokens[..., None]).squeeze(-1)
    ratio = torch.where(q_d > 0, q_c / q_d.clamp(min=1e-30), torch.ones_like(q_d))
    return similarity.clamp(0.0, 1.0), ratio.clamp(max=1.0)


def acceptance_probability(draft_probs: torch.Tensor, target_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """X = min(1, pi(t) / q(t)): the probability the exact rule accepts drafted token t. [rows, k]."""
    q = draft_probs.gather(-1, tokens[..., None]).squeeze(-1)
    p = target_probs.gather(-1, tokens[..., None]).squeeze(-1)
    return torch.where(q > 0, p / q.clamp(min=1e-30), torch.ones_like(q)).clamp(max=1.0)


# ---------------------------------------------------------------- E(N | gamma) (Def. D.4)

def prob_accepted_exactly(p: Sequence[float], gamma: int) -> list[float]:
    """P_gamma(N = i) for i = 0 .. gamma, with p[i] the acceptance probability of drafted token i + 1
    given the ones before it were accepted (eq. 3)."""
    if not 0 <= gamma <= len(p):
        raise ValueError(f"gamma must be in [0, {len(p)}], got {gamma}")
    out, survive = [], 1.0
    for i in range(gamma):
        out.append(survive * (1.0 - p[i]))
        survive *= p[i]
    out.append(survive)
    return out


def expected_accepted(p: Sequence[float]) -> list[float]:
    """E(N | gamma) for gamma = 0 .. len(p) (eq. 4): the sum over i <= gamma of prod_{j <= i} p_j."""
    out, total, survive = [0.0], 0.0, 1.0
    for value in p:
        survive *= value
        total += survive
        out.append(total)
    return out


# ---------------------------------------------------------------- information (Table 1)

def entropy(counts: torch.Tensor) -> float:
    """Shannon entropy in bits of a histogram (any shape; empty cells ignored)."""
    counts = counts.double().flatten()
    total = counts.sum()
    if total <= 0:
        return 0.0
    probs = counts[counts > 0] / total
    return float(-(probs * probs.log2()).sum())


def _joint(x: torch.Tensor, cell: torch.Tensor, x_bins: int, cells: int) -> torch.Tensor:
    """[cells, x_bins] counts of paired samples."""
    joint = torch.zeros(cells, x_bins, dtype=torch.float64)
    joint.index_put_((cell.long(), x.long()), torch.ones(len(x), dtype=torch.float64), accumulate=True)
    return joint


def conditional_entropy(x: torch.Tensor, cell: torch.Tensor, x_bins: int, cells: int) -> float:
    """H(X | cell) in bits from paired samples of discrete X (0 .. x_bins - 1) and a cell index."""
    joint = _joint(x, cell, x_bins, cells)
    return entropy(joint) - entropy(joint.sum(1))


def information_gain(x: torch.Tensor, cell: torch.Tensor, x_bins: int, cells: int) -> dict[str, float]:
    """H(X), H(X | cell) and I(X; cell) = H(X) - H(X | cell), in bits, plug-in and with the
    Miller-Madow correction (the plug-in estimate of I is biased upwards by about
    (occupied cells - 1)(X bins - 1) / (2 n ln 2))."""
    n = len(x)
    joint = _joint(x, cell, x_bins, cells)
    h_x = entropy(joint.sum(0))
    h_cond = entropy(joint) - entropy(joint.sum(1))
    occupied_joint = int((joint > 0).sum())
    occupied_cells = int((joint.sum(1) > 0).sum())
    occupied_x = int((joint.sum(0) > 0).sum())
    # Miller-Madow: H_mm = H + (occupied - 1) / (2 n ln 2), applied to H(X), H(X, C) and H(C)
    scale = 1.0 / (2.0 * max(n, 1) * math.log(2.0))
    h_x_mm = h_x + (occupied_x - 1) * scale
    h_cond_mm = h_cond + (occupied_joint - occupied_cells) * scale
    return {
        "H_X": h_x, "H_X_given": h_cond, "I": h_x - h_cond,
        "H_X_mm": h_x_mm, "H_X_given_mm": h_cond_mm, "I_mm": h_x_mm - h_cond_mm,
        "samples": n, "cells_occupied": occupied_cells,
    }


def discretise(values: torch.Tensor, bins: int) -> torch.Tensor:
    """Values in [0, 1] -> equal-width bin index 0 .. bins - 1 (1.0 falls in the last bin)."""
    return (values.clamp(0.0, 1.0) * bins).long().clamp(max=bins - 1)


# ---------------------------------------------------------------- P(accept | S, A) (Def. D.8)

def equal_edges(bins: int) -> list[float]:
    return [i / bins for i in range(bins + 1)]


def quantile_edges(values: torch.Tensor, bins: int) -> list[float]:
    """Adaptive edges: bin boundaries at the samples' quantiles (denser data, narrower bins), duplicates
    merged (A has a point mass at 1), always spanning [0, 1]."""
    qs = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    edges = torch.quantile(values.double(), qs).tolist()
    edges[0], edges[-1] = 0.0, 1.0
    merged = [edges[0]]
    for e in edges[1:]:
        if e > merged[-1] + 1e-9:
            merged.append(e)
    if merged[-1] < 1.0:
        merged.append(1.0)
    return merged


def bucket(values: torch.Tensor, edges: Sequence[float]) -> torch.Tensor:
    """Bin index of each value for the given edges (first bin closed on the left, last on the right)."""
    inner = torch.tensor(list(edges[1:-1]), dtype=values.dtype, device=values.device)
    return torch.bucketize(values, inner, right=True)


@dataclass
class AcceptanceTable:
    """Mean acceptance probability per (S bin, A bin) cell; sparse cells shrink towards the global mean."""

    s_edges: list[float]
    a_edges: list[float]
    mean: list[list[float]]  # [S bins][A bins] estimated P(accept | cell)
    count: list[list[int]]

    PRIOR_WEIGHT = 5.0  # pseudo-samples of the global mean added to every cell

    @classmethod
    def fit(cls, s: torch.Tensor, a: torch.Tensor, x: torch.Tensor, s_edges: Sequence[float],
            a_edges: Sequence[float]) -> "AcceptanceTable":
        if len(x) == 0:
            raise DraftwiseError("no profiled drafted tokens to estimate P(accept | S, A) from")
        ns, na = len(s_edges) - 1, len(a_edges) - 1
        cell = bucket(s.double(), s_edges) * na + bucket(a.double(), a_edges)
        total = torch.zeros(ns * na, dtype=torch.float64).index_add_(0, cell, x.double())
        count = torch.zeros(ns * na, dtype=torch.float64).index_add_(0, cell, torch.ones_like(x, dtype=torch.float64))
        prior = float(x.double().mean())
        mean = (total + cls.PRIOR_WEIGHT * prior) / (count + cls.PRIOR_WEIGHT)
        return cls(list(map(float, s_edges)), list(map(float, a_edges)),
                   mean.view(ns, na).tolist(), count.view(ns, na).long().tolist())

    def overall_mean(self) -> float:
        """The mean acceptance over every profiled token (the prior `fit` shrank the cells towards): each cell's
        mean is (its sum + w x the overall mean) / (its count + w), so the overall mean is the cells' means
        weighted by count + w."""
        w = self.PRIOR_WEIGHT
        cells = [(m, c + w) for ms, cs in zip(self.mean, self.count) for m, c in zip(ms, cs)]
        return sum(m * c for m, c in cells) / sum(c for _, c in cells)

    def cells(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return bucket(s.double(), self.s_edges) * (len(self.a_edges) - 1) + bucket(a.double(), self.a_edges)

    def lookup(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Estimated acceptance probability for each (S, A) pair: same shape as s, float64."""
        table = torch.tensor(self.mean, dtype=torch.float64, device=s.device).flatten()
        return table[self.cells(s, a)]

    def to_dict(self) -> dict[str, Any]:
        return {"s_edges": self.s_edges, "a_edges": self.a_edges, "mean": self.mean, "count": self.count}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AcceptanceTable":
        return cls(list(data["s_edges"]), list(data["a_edges"]), [list(r) for r in data["mean"]],
                   [list(r) for r in data["count"]])


# ---------------------------------------------------------------- latency (Assumption D.10)

def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation, linear extrapolation past the ends."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0]) if xs[0] else ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class LatencyModel:
    """Profiled step latency in milliseconds, per batch size `rows`.

    verify[i] = [target forward where each of rows[i] rows feeds n tokens, for n = 1 ..];
    verify_long[i] = [the same when one row feeds w tokens and the others one, for w = 1 ..];
    draft[i] = one drafting forward (one token a row); companion[i] = the companion's forward over
    a whole draft.

    `packed` (the runner skips padding, `ModelRunner.packing`): position-wise work follows the total
    of tokens, attention still the longest row, so a batch costs verify at its mean tokens per row
    plus what one long row adds (verify_long less verify at the same total). Unpacked, a batch pays
    for rows x its longest row: verify at the longest row."""

    rows: list[int]
    verify: list[list[float]]
    draft: list[float]
    companion: list[float]
    verify_long: list[list[float]] | None = None
    packed: bool = False

    def _at(self, table: list[list[float]], n_rows: int, per_row: float) -> float:
        at_rows = [_interp(range(1, len(v) + 1), v, per_row) for v in table]
        return _interp(self.rows, at_rows, n_rows)

    def verify_ms(self, counts: Sequence[int]) -> float:
        """Target verification latency for a batch whose row b feeds counts[b] tokens (>= 1)."""
        n_rows, longest = len(counts), max(counts)
        if not self.packed or self.verify_long is None:
            return max(self._at(self.verify, n_rows, longest), 1e-6)
        mean = sum(counts) / n_rows
        extra = self._at(self.verify_long, n_rows, longest) - self._at(self.verify, n_rows, (n_rows - 1 + longest) / n_rows)
        return max(self._at(self.verify, n_rows, mean) + max(extra, 0.0), 1e-6)

    def draft_ms(self, n_rows: int) -> float:
        return max(_interp(self.rows, self.draft, n_rows), 0.0)

    def companion_ms(self, n_rows: int) -> float:
        return max(_interp(self.rows, self.companion, n_rows), 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "verify_ms": self.verify, "verify_long_ms": self.verify_long,
                "draft_ms": self.draft, "companion_ms": self.companion, "packed": self.packed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LatencyModel":
        long = data.get("verify_long_ms")
        return cls(list(data["rows"]), [list(v) for v in data["verify_ms"]], list(data["draft_ms"]),
                   list(data["companion_ms"]), [list(v) for v in long] if long else None,
                   bool(data.get("packed", False)))


# ---------------------------------------------------------------- §5: the batch scheduler

def schedule(p: Sequence[Sequence[float]], cost: Callable[[list[int]], float],
             before_draw: Sequence[Sequence[float]] | None = None) -> list[int]:
    """How many drafted tokens each row verifies.

    p[r][i]: estimated acceptance probability of row r's drafted token i + 1 given the ones
    before it were accepted. cost(counts): estimated step time when row r verifies counts[r]
    drafted tokens (plus its bonus position, always verified: no row starves).

    before_draw[r][i]: the estimate for token i + 1 as known before that token was drawn. When
    given, the decision to verify token i + 1 reads it (and the actual p of the tokens before),
    never the token itself: a selection that depends on the very token it verifies would bias
    it away from the draft distribution the exact rule divides by, and the output away from
    the target's. After the token is added, its actual p carries the row's survival on.

    Greedy (§5): start from nothing drafted verified; repeatedly add the drafted token with the
    highest marginal gain in expected committed tokens (prod_{j<=i} p[r][j], only the next token
    of each row is a candidate, so selections stay prefixes) while the estimated goodput
    (expected committed tokens / cost) rises. A row whose next token would lower goodput is
    closed; the others may still add cheaper tokens (with padding, tokens below the longest
    row's width cost nothing).
    """
    rows = len(p)
    chosen = [0] * rows
    survive = [1.0] * rows
    expected = float(rows)  # every row commits its recovered or bonus token
    best = expected / cost(chosen)
    open_rows = {r for r in range(rows) if len(p[r]) > 0}
    while open_rows:
        score = before_draw if before_draw is not None else p
        gain, r = max((survive[r] * float(score[r][chosen[r]]), r) for r in open_rows)
        trial = list(chosen)
        trial[r] += 1
        value = (expected + gain) / cost(trial)
        if value <= best:
            open_rows.discard(r)  # its later tokens gain less and cost no less
            continue
        chosen, expected, best = trial, expected + gain, value
        survive[r] *= float(p[r][chosen[r] - 1])
        if chosen[r] == len(p[r]):
            open_rows.discard(r)
    return chosen


def best_single_length(p: Sequence[float], cost: Callable[[int], float]) -> int:
    """One request alone (§5, Figure 2): grow gamma' while (1 + E(N | gamma')) / Latency(gamma') rises."""
    expected = expected_accepted(p)
    best, best_value = 0, (1.0 + expected[0]) / cost(0)
    for gamma in range(1, len(p) + 1):
        value = (1.0 + expected[gamma]) / cost(gamma)
        if value <= best_value:
            break
        best, best_value = gamma, value
    return best


# ---------------------------------------------------------------- the profile file

@dataclass
class SVProfile:
    """What `draftwise profile-sv` writes and `sv` reads: the setting it was built for, P(accept | S, A)
    tables, the latency model, and the information figures."""

    setting: dict[str, Any]  # target, draft, companion, temperature, top_p, top_k, gamma
    tables: dict[str, AcceptanceTable]  # "adaptive", "equal"
    latency: LatencyModel
    report: dict[str, Any] = field(default_factory=dict)

    def table(self, bins: str) -> AcceptanceTable:
        if bins not in self.tables:
            raise DraftwiseError(f"this SV profile has bins {', '.join(sorted(self.tables))}, not {bins!r}")
        return self.tables[bins]

    def mismatch(self, setting: dict[str, Any], keys: Sequence[str] = None) -> str | None:
        """The first setting this profile was not built for, as 'key=theirs, not mine' (None: it fits)."""
        for key in keys or SETTING_KEYS:
            mine, theirs = self.setting.get(key), setting.get(key)
            if key in ("temperature", "top_p") and mine is not None and theirs is not None:
                same = math.isclose(float(mine), float(theirs), rel_tol=0, abs_tol=1e-9)
            else:
                same = mine == theirs
            if not same:
                return f"was built for {key}={mine!r}, not {theirs!r}"
        return None

    def check(self, setting: dict[str, Any], path: Any = "the profile", keys: Sequence[str] = None) -> None:
        """Refuse a profile built for another target, draft, companion or sampling setting."""
        problem = self.mismatch(setting, keys)
        if problem:
            raise DraftwiseError(f"SV profile {path} {problem}: make one for this setting with `draftwise profile-sv`")

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, "setting": self.setting,
                "tables": {k: t.to_dict() for k, t in self.tables.items()},
                "latency": self.latency.to_dict(), "report": self.report}

    def save(self, path: str | os.PathLike) -> None:
        """Atomic: written to a temporary file beside `path`, then renamed over it."""
        from draftwise.atomic import write_json

        write_json(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SVProfile":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DraftwiseError(f"SV profile {path} does not exist; make one with `draftwise profile-sv`") from None
        except (OSError, ValueError) as err:
            raise DraftwiseError(f"SV profile {path} is not readable JSON: {err}") from None
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise DraftwiseError(f"{path} is not a draftwise SV profile (version {PROFILE_VERSION})")
        try:
            return cls(dict(data["setting"]), {k: AcceptanceTable.from_dict(t) for k, t in data["tables"].items()},
                       LatencyModel.from_dict(data["latency"]), dict(data.get("report", {})))
        except (KeyError, TypeError, ValueError) as err:
            raise DraftwiseError(f"SV profile {path} is incomplete ({err!r}); make it again with `draftwise profile-sv`") from None
