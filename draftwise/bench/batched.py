"""`draftwise bench --batch-sizes 1,4,16,32`: throughput and latency of the batched engine.

For each method and each batch size B, every prompt is submitted at once to
`generate(target, prompts, max_batch_size=B)` (continuous batching: at most B rows
decode together, a finished row is replaced by the next waiting prompt). The wall
time of the whole call is the run's time. After a warm-up, runs are interleaved
(repeat -> batch size -> method) so drift hits every method alike.

Metrics per method and batch size (pure functions below, hand-checked in tests):
- throughput_tok_s: total new tokens / wall time of the whole batch run, per repeat;
  the reported value is the median over repeats.
- latency_p50_s / p90 / p99: percentiles (linear interpolation, numpy's default) of the
  requests' `wall_time_s` (submit -> finish, queueing included) within a repeat; the
  reported value is the median over repeats. `ttft_p50_s` likewise for time to first token.
- tpot_p50_ms: time per output token after the first (vLLM's TPOT), per request
  (wall_time_s - time_to_first_token_s) / (new_tokens - 1), its p50 within a repeat, median over repeats: the
  decode phase alone. Goodput over a short answer is mostly prefill (every method prefills the same prompts,
  speculative ones the draft's too); TPOT shows what the decoding steps cost. None where no request has 2+ tokens.
- mean_accepted_length: sum of new tokens / sum of target calls (verification steps each
  request took part in), all requests and repeats (`ar` = 1.0).
- verified_per_committed: decode-phase tokens fed to the target per committed token,
  sum(target_tokens - (prompt_tokens - 1)) / sum(new_tokens); prefill feeds every prompt
  token but the last, which the first verification step feeds (`ar` = 1.0; speculative
  methods pay for rejected draft tokens here).
- speedup_vs_ar: throughput / `ar`'s throughput at the same batch size (same run);
  speedup_vs_ar_b1: throughput / `ar`'s throughput at batch size 1. None where `ar`
  (or batch size 1) is not in the run.
- identical_to_ar_b1 (temperature 0 only): fraction of requests whose tokens equal
  `ar`'s at batch 1, repeat 0 (batch invariance and exactness at once).
- verify_saved_vs_sd: 1 - verified_per_committed / `sd`'s at the same batch size: the
  verification compute a method saves against plain SD per committed token (Kim et al.
  Table 3, in verified tokens rather than TFLOPs: the same target forward either way).
- drafted_per_committed: drafted tokens (before any select phase) per committed token.
- fairness (Kim et al. §7.6): per request, drafted tokens verified per verification step;
  the mean over requests and the mean of the five lowest.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np

from draftwise.errors import DraftwiseError

STAT_KEYS = ("new_tokens", "target_calls", "target_tokens", "prompt_tokens", "wall_time_s",
             "time_to_first_token_s", "drafted", "accepted", "finish_reason", "proposed")


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """`--batch-sizes 1,4,16,32` -> (1, 4, 16, 32): positive integers, no repeats, order kept."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or not all(parts):
        raise DraftwiseError(f"--batch-sizes takes comma-separated integers >= 1 (e.g. 1,4,16,32), got {text!r}")
    sizes = []
    for part in parts:
        try:
            value = int(part)
        except ValueError:
            raise DraftwiseError(f"--batch-sizes: {part!r} is not an integer (e.g. 1,4,16,32)") from None
        if value < 1:
            raise DraftwiseError(f"--batch-sizes: batch sizes must be >= 1, got {value}")
        sizes.append(value)
    if len(set(sizes)) != len(sizes):
        raise DraftwiseError(f"--batch-sizes: a batch size is listed twice in {text!r}")
    return tuple(sizes)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("no values")
    return float(np.percentile(values, q))


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Metrics of one method at one batch size. `runs`: one per repeat, each
    {"wall_time_s": the whole batch run, "requests": [per-request stats], "energy_j": optional}."""
    if not runs:
        raise ValueError("no runs to summarize")
    throughput = [sum(r["new_tokens"] for r in run["requests"]) / run["wall_time_s"] for run in runs]
    latency = {q: statistics.median(percentile([r["wall_time_s"] for r in run["requests"]], q) for run in runs)
               for q in (50, 90, 99)}
    ttfts = [[r["time_to_first_token_s"] for r in run["requests"] if r.get("time_to_first_token_s") is not None]
             for run in runs]
    tpots = [[(r["wall_time_s"] - r["time_to_first_token_s"]) / (r["new_tokens"] - 1) * 1e3 for r in run["requests"]
              if r.get("time_to_first_token_s") is not None and r["new_tokens"] > 1] for run in runs]
    requests = [r for run in runs for r in run["requests"]]
    new = sum(r["new_tokens"] for r in requests)
    calls = sum(r["target_calls"] for r in requests)
    decode_fed = sum(r["target_tokens"] - (r["prompt_tokens"] - 1) for r in requests)
    drafted = sum(r.get("drafted", 0) for r in requests)
    energy = [run["energy_j"] / max(sum(r["new_tokens"] for r in run["requests"]), 1) for run in runs
              if run.get("energy_j") is not None]
    proposed = sum(r["proposed"] if r.get("proposed") is not None else r.get("drafted", 0) for r in requests)
    per_step = sorted(r.get("drafted", 0) / r["target_calls"] for r in runs[0]["requests"] if r["target_calls"])
    finish: dict[str, int] = {}
    for r in requests:
        reason = r.get("finish_reason") or "unknown"
        finish[reason] = finish.get(reason, 0) + 1
    return {
        "throughput_tok_s": statistics.median(throughput),
        "throughput_tok_s_per_repeat": throughput,
        "wall_time_s_per_repeat": [run["wall_time_s"] for run in runs],
        "latency_p50_s": latency[50], "latency_p90_s": latency[90], "latency_p99_s": latency[99],
        "ttft_p50_s": statistics.median(percentile(t, 50) for t in ttfts) if all(ttfts) else None,
        "tpot_p50_ms": statistics.median(percentile(t, 50) for t in tpots) if all(tpots) else None,
        "mean_accepted_length": new / calls if calls else 0.0,
        "verified_per_committed": decode_fed / new if new else 0.0,
        "acceptance_rate": sum(r.get("accepted", 0) for r in requests) / drafted if drafted else None,
        "drafted_per_committed": proposed / new if new else 0.0,
        "fairness": {"mean_verified_per_step": statistics.fmean(per_step) if per_step else 0.0,
                     "bottom5_verified_per_step": statistics.fmean(per_step[:5]) if per_step else 0.0},
        "requests": len(runs[0]["requests"]),
        "new_tokens": new,
        "target_calls": calls,
        "finish_reasons": finish,
        "energy_j_per_token": statistics.median(energy) if energy else None,
    }


def batched_report(runs: dict[tuple[str, int], list[dict[str, Any]]], methods: tuple[str, ...],
                   batch_sizes: tuple[int, ...], *, compare_identical: bool = False) -> dict[str, Any]:
    """{"batch_sizes", "reference", "methods": {label: {str(B): metrics}}}; speed ratios against `ar`."""
    out: dict[str, Any] = {label: {} for label in methods}
    for label in methods:
        for b in batch_sizes:
            out[label][str(b)] = summarize_runs(runs[(label, b)])
    ar = out.get("ar")
    ar_b1 = ar["1"]["throughput_tok_s"] if ar and "1" in ar else None
    reference = {}
    if compare_identical and ("ar", 1) in runs:
        reference = {i: r.get("token_ids") for i, r in enumerate(runs[("ar", 1)][0]["requests"])}
    for label in methods:
        for b in batch_sizes:
            m = out[label][str(b)]
            m["speedup_vs_ar"] = m["throughput_tok_s"] / ar[str(b)]["throughput_tok_s"] if ar else None
            m["speedup_vs_ar_b1"] = m["throughput_tok_s"] / ar_b1 if ar_b1 else None
            sd = out.get("sd", {}).get(str(b))
            m["verify_saved_vs_sd"] = (1.0 - m["verified_per_committed"] / sd["verified_per_committed"]
                                       if sd and sd["verified_per_committed"] else None)
            if reference:
                mine = runs[(label, b)][0]["requests"]
                m["identical_to_ar_b1"] = sum(r.get("token_ids") == reference[i] for i, r in enumerate(mine)) / len(mine)
    return {"batch_sizes": list(batch_sizes), "reference": "ar" if ar else None, "methods": out}


def _request_stats(generation: Any) -> dict[str, Any]:
    stats = {key: generation.stats.get(key) for key in STAT_KEYS}
    stats["token_ids"] = list(generation.token_ids)
    return stats


def run_batched(config: Any, target: Any, draft_of: dict[str, Any], encoded: list[list[int]], *,
                meter: Any = None, progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Every method at every batch size on the same prompts (token ids); see the module docstring."""
    import torch

    from draftwise.api import Generation, generate
    from draftwise.methods import METHODS
    from draftwise.engine.sampling import SamplingConfig
    from draftwise.bench.labels import DRAFT_ONLY, run_options

    def run(label: str, b: int, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[Any]:
        name, options = run_options(label, config.method_options, config.gamma)
        model, draft = target, draft_of[label]
        if name == DRAFT_ONLY:
            model, draft, name = draft, None, "ar"
        out = generate(model, [list(p) for p in prompts], draft=draft if METHODS[name].needs_draft else None,
                       method=name, max_new_tokens=max_new_tokens, temperature=config.temperature,
                       top_k=config.top_k, top_p=config.top_p, seed=seed, max_batch_size=b, **options)
        return [out] if isinstance(out, Generation) else out

    if config.warmup:  # allocator, kernels and first-call caches, at every batch size's shapes
        for b in config.batch_sizes:
            for label in config.methods:
                run(label, b, encoded[: min(b, len(encoded))], min(16, config.max_new_tokens), 0)

    runs: dict[tuple[str, int], list[dict[str, Any]]] = {(m, b): [] for m in config.methods for b in config.batch_sizes}
    for repeat in range(config.repeats):
        for b in config.batch_sizes:
            for label in config.methods:
                before = meter.read() if meter else 0.0
                start = time.perf_counter()
                generations = run(label, b, encoded, config.max_new_tokens, config.seed + 1000 * repeat)
                wall = time.perf_counter() - start
                energy = None
                if meter:
                    if target.device.type == "cuda":
                        torch.cuda.synchronize(target.device)
                    energy = meter.joules_between(before, meter.read())
                runs[(label, b)].append({"wall_time_s": wall, "energy_j": energy,
                                         "requests": [_request_stats(g) for g in generations]})
                if progress:
                    progress(1)
    report = batched_report(runs, config.methods, config.batch_sizes,
                            compare_identical=SamplingConfig(config.temperature).greedy)
    for (label, b), method_runs in runs.items():  # keep the per-request stats (not the token ids) of repeat 0
        report["methods"][label][str(b)]["per_request"] = [
            {k: v for k, v in r.items() if k != "token_ids"} for r in method_runs[0]["requests"]]
    return report


def format_batched_table(batched: dict[str, Any]) -> str:
    """One row per method and batch size."""
    rows = [("method", "batch", "goodput tok/s", "vs ar", "vs ar@1", "p50 lat s", "p90 lat s", "p99 lat s",
             "TPOT p50 ms", "mean acc len", "acc rate", "verified/tok", "saved vs sd", "identical")]
    for label, by_b in batched["methods"].items():
        for b, m in by_b.items():
            rows.append((
                label, b, f"{m['throughput_tok_s']:.1f}",
                f"{m['speedup_vs_ar']:.2f}x" if m.get("speedup_vs_ar") is not None else "-",
                f"{m['speedup_vs_ar_b1']:.2f}x" if m.get("speedup_vs_ar_b1") is not None else "-",
                f"{m['latency_p50_s']:.2f}", f"{m['latency_p90_s']:.2f}", f"{m['latency_p99_s']:.2f}",
                f"{m['tpot_p50_ms']:.0f}" if m.get("tpot_p50_ms") is not None else "-",
                f"{m['mean_accepted_length']:.2f}",
                f"{m['acceptance_rate']:.2f}" if m.get("acceptance_rate") is not None else "-",
                f"{m['verified_per_committed']:.2f}",
                f"{m['verify_saved_vs_sd']:+.0%}" if m.get("verify_saved_vs_sd") is not None else "-",
                f"{m['identical_to_ar_b1']:.2f}" if m.get("identical_to_ar_b1") is not None else "-",
            ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
