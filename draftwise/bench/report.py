"""Reporting benchmark results: a console table, JSON written atomically, a plot."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from draftwise.atomic import atomic_path, write_json  # noqa: F401  write_json: the harness's writer is atomic's


QUALITY_COLUMNS = (("pass_at_1", "pass@1"), ("perplexity", "ppl"), ("target_agreement", "agree"), ("rougeL_ref", "ROUGE-L ref"),
                   ("rouge2", "ROUGE-2"), ("bleu", "BLEU"), ("energy_j_per_token", "J/tok"))


def format_table(results: dict[str, Any]) -> str:
    methods = results["methods"]
    quality = [(k, h) for k, h in QUALITY_COLUMNS if any(m.get(k) is not None for m in methods.values())]
    rows = [("method", "tok/s", "speedup", "mean acc len", "accept rate", "target calls/tok", "identical")
            + tuple(h for _, h in quality)]
    for name, m in methods.items():
        rows.append((
            name, f"{m['tokens_per_s']:.1f}",
            f"{m['speedup_vs_ar']:.2f}x" if m.get("speedup_vs_ar") is not None else "-",
            f"{m['mean_accepted_length']:.2f}", f"{m['acceptance_rate']:.2f}" if m["drafted"] else "-",
            f"{m['target_calls_per_token']:.3f}",
            f"{m['identical_to_ar']:.2f}" if "identical_to_ar" in m else "-",
        ) + tuple(f"{m[k]:.3g}" if m.get(k) is not None else "-" for k, _ in quality))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    energy = results.get("energy")
    if energy and not energy.get("available"):
        lines.append(f"energy: unavailable ({energy.get('reason', 'no counter')})")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str | os.PathLike) -> None:
    """Two panels: speedup vs ar and mean accepted length, per method and category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods = list(results["methods"])
    categories = list(next(iter(results["methods"].values()))["per_category"])
    groups = categories + ["overall"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(groups) * max(1, len(methods)) / 2), 8), sharex=True)
    width = 0.8 / max(len(methods), 1)
    x = np.arange(len(groups))
    for panel, (key, label) in zip(axes, [("speedup_vs_ar", "speedup vs ar (tokens/s ratio)"),
                                          ("mean_accepted_length", "mean accepted length (tokens / target call)")]):
        for j, method in enumerate(methods):
            m = results["methods"][method]
            values = [(m["per_category"].get(c, {}).get(key) or 0.0) for c in categories] + [m.get(key) or 0.0]
            panel.bar(x + (j - (len(methods) - 1) / 2) * width, values, width, label=method)
        panel.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        panel.set_ylabel(label)
        panel.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=min(len(methods), 4), fontsize=8)
    axes[1].set_xticks(x, groups, rotation=30, ha="right")
    cfg = results["config"]
    fig.suptitle(f"{cfg['target']} | T={cfg['temperature']} gamma={cfg['gamma']} | {results['machine'].get('cpu', '')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_batched(results: dict[str, Any], path: str | os.PathLike) -> None:
    """Throughput (tokens/s over the whole batch run) against batch size, one line per method; written
    atomically (a temporary file in the same folder, then renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batched = results["batched"]
    sizes = batched["batch_sizes"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, by_b in batched["methods"].items():
        ax.plot(sizes, [by_b[str(b)]["throughput_tok_s"] for b in sizes], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("max batch size")
    ax.set_ylabel("goodput (committed tokens/s, whole batch)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    cfg = results["config"]
    ax.set_title(f"{cfg['target']} | {len(cfg['prompts'])} prompts, {cfg['max_new_tokens']} new tokens, "
                 f"T={cfg['temperature']} gamma={cfg['gamma']}\n{results['machine'].get('cpu', '')}", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_path(path, suffix=path.suffix) as tmp:
            fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".").lower() or None)
    finally:
        plt.close(fig)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def baseline_table(results: dict, labels: list[str] | None = None, baseline: str = "sd") -> str:
    """The MTAD paper's Table 4 columns from bench JSON: tokens/s, speed against `baseline` (same run) and `ar`,
    block efficiency, acceptance, target perplexity (and against the baseline's), ROUGE-L, energy per token (or
    why there is none). Nothing is recomputed."""
    methods = results["methods"]
    base = methods.get(baseline, {}).get("tokens_per_s")
    rows = [("method", "tok/s", f"vs {baseline}", "vs ar", "block eff.", "accept", "ppl", "ppl vs sd", "ROUGE-L ref",
             "J/token")]
    sd_ppl = methods.get(baseline, {}).get("perplexity")
    for name in labels or list(methods):
        m = methods[name]
        rows.append((
            name, _fmt(m["tokens_per_s"], ".2f"), _fmt(m["tokens_per_s"] / base if base else None, ".2f"),
            _fmt(m.get("speedup_vs_ar"), ".2f"), _fmt(m.get("block_efficiency", m["mean_accepted_length"]), ".3f"),
            _fmt(m["acceptance_rate"] if m["drafted"] else None, ".3f"), _fmt(m.get("perplexity"), ".3f"),
            _fmt(m["perplexity"] / sd_ppl - 1 if sd_ppl and m.get("perplexity") else None, "+.1%"),
            _fmt(m.get("rougeL_ref"), ".2f"), _fmt(m.get("energy_j_per_token"), ".3g"),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    energy = results.get("energy", {})
    if not energy.get("available", False):
        lines.append(f"energy: unavailable ({energy.get('reason', 'not measured')})")
    return "\n".join(lines)


def setting(label: str, key: str) -> float | None:
    match = re.search(rf"/{key}=([0-9.]+)", label)
    return float(match.group(1)) if match else None


def plot_mtad_ablation(results: dict, path: str) -> None:
    """Block efficiency and target perplexity against the beams (`mtad/num_beams=W` columns) and against tau
    (`mtad/tau=T`), beside `sd`'s perplexity (the MTAD paper Table 7, Figure 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, xlabel in [(axes[0], "num_beams", "beams W (tau 0.5)"), (axes[1], "tau", "tau (4 beams)")]:
        points = sorted((setting(n, key), m) for n, m in methods.items() if setting(n, key) is not None)
        xs = [x for x, _ in points]
        ax.plot(xs, [m["block_efficiency"] for _, m in points], "o-", label="block efficiency")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens per target call")
        twin = ax.twinx()
        twin.plot(xs, [m["perplexity"] for _, m in points], "s--", color="tab:red", label="target perplexity")
        if "sd" in methods:
            twin.axhline(methods["sd"]["perplexity"], color="tab:red", linewidth=0.8, linestyle=":", label="sd ppl")
        twin.set_ylabel("target perplexity")
        ax.legend(loc="upper left", fontsize=8)
        twin.legend(loc="upper right", fontsize=8)
    fig.suptitle("MTAD ablations (the MTAD paper Table 7, Figure 3)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_tokens(a_path: str, b_path: str) -> int:
    """Whether two `benchmarks/greedy_tokens.py` files hold the same tokens, a line per method and mode (alone,
    batched); 1 when any differ or a method is in one file only, else 0."""
    a, b = (json.load(open(p))["tokens"] for p in (a_path, b_path))
    differ = 0
    for label in sorted(set(a) | set(b)):
        if label not in a or label not in b:
            print(f"{label}: only in {a_path if label in a else b_path}")
            differ += 1
            continue
        for mode in ("alone", "batched"):
            same = sum(x == y for x, y in zip(a[label][mode], b[label][mode]))
            total = len(a[label][mode])
            print(f"{label:14s} {mode:8s} identical {same}/{total}")
            differ += same != total
    return 1 if differ else 0
