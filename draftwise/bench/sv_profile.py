"""`draftwise profile-sv`: build the profile Speculative Verification reads (Kim et al. §4, §7.4, A.2).

1. Run plain SD (every drafted token verified) on profiling prompts, which are disjoint from
   the evaluation prompts (the Spec-Bench training split), with the companion reading every
   draft. For each drafted token record S, A (Def. D.1-D.2), X = min(1, pi(t) / q(t)) (the
   exact rule's acceptance probability), whether it was accepted, the draft-target
   similarity sum_v min(q(v), p(v)) and its position.
2. Estimate P(accept | S, A) with equal-width and adaptive (quantile) bins (Def. D.8), and
   report H(X), H(X | S, A) and I(X; S, A) at several resolutions (Table 1), I(X; S) (B.1), and
   the correlation of draft-companion with draft-target similarity (Table 8).
3. Profile the target's verification latency on this machine as a function of the rows in the
   batch and the tokens each verifies, and the draft's and companion's forwards (D.10).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch

from draftwise.drafters.base import ModelRowsDrafter
from draftwise.engine.core import Engine
from draftwise.engine.protocols import RowsDraft
from draftwise.engine.rows import Request, Row
from draftwise.errors import DraftwiseError
from draftwise.rules.acceptance import ExactRule
from draftwise.models.runner import ModelRunner, draft_runner
from draftwise.engine.sampling import SamplingConfig, unwarped
from draftwise.drafters.companion import CompanionRowsDrafter
from draftwise.drafters.ngram_companion import NgramCompanion, companion_runner
from draftwise.selectors.selection import indicator_pair
from draftwise.selectors.sv import (AcceptanceTable, LatencyModel, SVProfile, acceptance_probability, bucket, discretise, equal_edges,
                 information_gain, quantile_edges)

X_BINS = 10  # X (an acceptance probability in [0, 1]) is discretised in this many equal bins for entropies
ADAPTIVE_BINS = 16  # per axis: up to 16 x 16 cells at the samples' quantiles
EQUAL_BINS = 10
LATENCY_ROWS = (1, 2, 4, 8, 16, 32)
FIELDS = ("s", "a", "x", "accepted", "s_target", "position")


class RecordingSelector:
    """Verifies every drafted token (plain SD) and records one sample per drafted token."""

    discards = False
    observes = True

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {f: [] for f in FIELDS}
        self._sa: tuple[torch.Tensor, torch.Tensor] | None = None

    def limits(self, rows: Sequence[Row], limits: list[int]) -> list[int]:
        return limits

    def select(self, rows: Sequence[Row], draft: RowsDraft) -> list[int]:
        self._sa = indicator_pair(rows, draft)
        return list(draft.counts)

    def observe(self, rows, draft, target_probs, target_logits, num_accepted) -> None:
        k = draft.width
        if k == 0 or self._sa is None:
            return
        s, a = self._sa
        x = acceptance_probability(draft.probs, target_probs[:, :k], draft.tokens)
        greedy = torch.tensor([r.request.sampling.greedy for r in rows], device=x.device)[:, None, None]
        q = torch.where(greedy, draft.draft_raw, draft.probs) if draft.draft_raw is not None else draft.probs
        p = torch.where(greedy, unwarped(target_logits[:, :k]), target_probs[:, :k])
        s_target = torch.minimum(q, p).sum(-1)
        host = torch.stack([s.double(), a.double(), x.double(), s_target.double()]).tolist()
        for b in range(len(rows)):
            for i in range(draft.counts[b]):
                self.samples["s"].append(host[0][b][i])
                self.samples["a"].append(host[1][b][i])
                self.samples["x"].append(host[2][b][i])
                self.samples["s_target"].append(host[3][b][i])
                # 1 accepted, 0 rejected, -1 never decided (after the row's first rejection)
                self.samples["accepted"].append(1 if i < num_accepted[b] else 0 if i == num_accepted[b] else -1)
                self.samples["position"].append(i)
        self._sa = None


def collect_samples(target: Any, draft: Any, companion: Any, prompts: Sequence[Sequence[int]], *,
                    sampling: SamplingConfig, gamma: int, max_new_tokens: int, batch_size: int, vocab_size: int,
                    eos_token_ids: frozenset[int], seed: int = 0, progress: Any = None) -> dict[str, list[float]]:
    """Plain SD over the prompts with the companion reading every draft; one sample per drafted token."""
    recorder = RecordingSelector()
    inner = ModelRowsDrafter(draft_runner(draft, vocab_size=vocab_size), vocab_size,
                             eos_token_ids=eos_token_ids, keep_raw=True)
    if isinstance(companion, NgramCompanion):  # its corpus must not hold the answers being profiled
        companion = companion.without_answers_to(prompts)
    drafter = CompanionRowsDrafter(inner, companion_runner(companion, vocab_size=vocab_size), vocab_size)
    engine = Engine(ModelRunner(target.model, vocab_size=vocab_size, rows=0), drafter, ExactRule(), gamma=gamma,
                    max_batch_size=batch_size, method="sd", stream_text=False, selector=recorder)
    for i, ids in enumerate(prompts):
        engine.submit(Request(prompt_ids=tuple(ids), sampling=sampling, max_new_tokens=max_new_tokens,
                              eos_token_ids=eos_token_ids, seed=seed + i))
    done = 0
    while engine.has_work:
        for event in engine.step():
            if event.finished:
                done += 1
                if progress is not None:
                    progress(done, len(prompts), len(recorder.samples["x"]))
    return recorder.samples


def information_report(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Table 1 (H(X), H(X | S, A), I(X; S, A) per resolution), B.1 (I(X; S)), Table 8 (correlation)."""
    s = torch.tensor(samples["s"], dtype=torch.float64)
    a = torch.tensor(samples["a"], dtype=torch.float64)
    x_value = torch.tensor(samples["x"], dtype=torch.float64)
    x = discretise(x_value, X_BINS)
    out: dict[str, Any] = {"samples": len(x), "x_bins": X_BINS, "mean_x": float(x_value.mean()) if len(x) else None,
                           "resolutions": {}}
    if len(x) < 2:
        raise DraftwiseError(f"only {len(x)} drafted tokens were profiled: give more prompts or tokens")
    for n in (5, 10, 20):
        edges = equal_edges(n)
        cell = bucket(s, edges) * n + bucket(a, edges)
        out["resolutions"][f"{n}x{n}"] = information_gain(x, cell, X_BINS, n * n)
    s_edges, a_edges = quantile_edges(s, ADAPTIVE_BINS), quantile_edges(a, ADAPTIVE_BINS)
    na = len(a_edges) - 1
    cell = bucket(s, s_edges) * na + bucket(a, a_edges)
    cells = (len(s_edges) - 1) * na
    adaptive = information_gain(x, cell, X_BINS, cells)
    adaptive["bins"] = cells
    out["resolutions"]["adaptive"] = adaptive
    out["I_X_S_10"] = information_gain(x, bucket(s, equal_edges(10)), X_BINS, 10)
    decided = torch.tensor(samples["accepted"]) >= 0
    if bool(decided.any()):  # the 0/1 outcome at the positions the rule decided
        outcome = torch.tensor(samples["accepted"])[decided]
        out["accepted_outcome_adaptive"] = information_gain(outcome, cell[decided], 2, cells)
    s_target = torch.tensor(samples["s_target"], dtype=torch.float64)
    if len(s) > 2 and float(s.std()) > 0 and float(s_target.std()) > 0:
        out["corr_S_draft_companion_vs_draft_target"] = float(torch.corrcoef(torch.stack([s, s_target]))[0, 1])
    positions = torch.tensor(samples["position"])
    out["mean_x_by_position"] = [float(x_value[positions == i].mean()) for i in range(int(positions.max()) + 1)]
    return out


def fit_tables(samples: dict[str, list[float]]) -> dict[str, AcceptanceTable]:
    s = torch.tensor(samples["s"], dtype=torch.float64)
    a = torch.tensor(samples["a"], dtype=torch.float64)
    x = torch.tensor(samples["x"], dtype=torch.float64)
    return {
        "adaptive": AcceptanceTable.fit(s, a, x, quantile_edges(s, ADAPTIVE_BINS), quantile_edges(a, ADAPTIVE_BINS)),
        "equal": AcceptanceTable.fit(s, a, x, equal_edges(EQUAL_BINS), equal_edges(EQUAL_BINS)),
    }


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _filled(runner: ModelRunner, rows: int, context: int, vocab: int) -> None:
    """Empty the runner's cache, then give each of `rows` rows `context` tokens (one forward)."""
    generator = torch.Generator().manual_seed(0)
    runner.cache.drop_rows(0)
    prompt = torch.randint(0, vocab, (rows, context), generator=generator)
    runner.forward_rows(prompt, [context] * rows, logits_at=torch.zeros(rows, 1, dtype=torch.long))


def _timed_forward(runner: ModelRunner, rows: int, width: int, context: int, repeats: int, vocab: int, *,
                   long_row: bool = False) -> float:
    """Median latency of one forward feeding `width` tokens to each of `rows` rows that hold `context` tokens
    (logits at every fed position, as verification asks); `long_row`: only the last row feeds `width`, the
    others one token. The rows must hold their context already (`_filled`): each timed forward is trimmed off
    again, so one fill serves every width."""
    generator = torch.Generator().manual_seed(width)
    feed = torch.randint(0, vocab, (rows, width), generator=generator)
    counts = [1] * (rows - 1) + [width] if long_row else [width] * rows

    def once() -> None:
        runner.forward_rows(feed, counts)
        for b in range(rows):
            runner.trim_row(b, context)

    return _median_ms(once, repeats)


def measure_latency(target: Any, draft: Any, companion: Any | None, *, gamma: int, vocab_size: int,
                    rows: Sequence[int] = LATENCY_ROWS, context: int = 256, repeats: int = 5,
                    ) -> LatencyModel:
    """Assumption D.10 on this machine: verification latency per (rows, tokens per row), and with one long row
    when the runner packs ragged rows; one drafting forward per rows; the companion's forward over gamma + 1
    tokens per rows."""
    verify, verify_long, draft_ms, companion_ms = [], [], [], []
    t_runner = ModelRunner(target.model, vocab_size=vocab_size, rows=0)
    packed = t_runner.packing
    d_runner = draft_runner(draft, vocab_size=vocab_size)
    c_runner = companion_runner(companion, vocab_size=vocab_size) if companion is not None else None
    with torch.inference_mode():
        for r in rows:  # each runner's rows filled once per batch size (a fill of 16 rows is most of a minute)
            for runner in (t_runner, d_runner, c_runner):
                if runner is not None:
                    _filled(runner, r, context, vocab_size)
            verify.append([_timed_forward(t_runner, r, n, context, repeats, vocab_size) for n in range(1, gamma + 2)])
            if packed:
                verify_long.append([verify[-1][0]] + [
                    _timed_forward(t_runner, r, n, context, repeats, vocab_size, long_row=True) if r > 1
                    else verify[-1][n - 1] for n in range(2, gamma + 2)])
            draft_ms.append(_timed_forward(d_runner, r, 1, context, repeats, vocab_size))
            companion_ms.append(_timed_forward(c_runner, r, gamma + 1, context, repeats, vocab_size)
                                if c_runner is not None else 0.0)
    return LatencyModel(list(rows), verify, draft_ms, companion_ms, verify_long if packed else None, packed=packed)


def build_profile(samples: dict[str, list[float]], latency: LatencyModel, setting: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> SVProfile:
    report = information_report(samples)
    report.update(extra or {})
    return SVProfile(setting=setting, tables=fit_tables(samples), latency=latency, report=report)
