"""`draftwise sweep`: cost-quality trade-off curves of lossy methods (Narasimhan et al. Figures 2-4, Table 2).

For each temperature, one benchmark run holds `ar` (the target alone: quality reference
and latency 1.0), `draft-only` (the draft alone) and every method at every alpha of its
grid, on the same prompts after the same warm-up. Each point reports quality (ROUGE-2,
BLEU, the target's perplexity, greedy agreement), latency relative to `ar` (seconds per
token over seconds per token of `ar` from the same run = 1 / speedup), rejection rate and
deferral rate. From the curves, Table 2's two views per method and quality metric:
- `speedup_at_target_quality`: the largest speedup among the points whose quality is at
  least the target's (perplexity: at most); None when no point reaches it;
- `best_quality_within_target_latency`: the best quality among the points no slower than
  the target (relative latency <= 1); None when every point is slower.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from draftwise.errors import DraftwiseError
from draftwise.bench.harness import BenchConfig, check_methods, run_bench
from draftwise.bench.labels import DRAFT_ONLY, parse_label

QUALITY_METRICS = ("pass_at_1", "rouge2", "bleu", "perplexity", "target_agreement")
LOWER_IS_BETTER = {"perplexity"}


@dataclass(frozen=True)
class SweepConfig:
    target: str
    methods: tuple[str, ...]  # labels without @alpha: cascade:token-v3, lossy, token-cascade, ...
    alpha_grid: tuple[float, ...]
    grids: dict[str, tuple[float, ...]] = field(default_factory=dict)  # per-label alpha grids
    draft: str | None = None
    temperatures: tuple[float, ...] = (1.0,)
    dataset: str = "spec-bench"
    categories: tuple[str, ...] = ("summarization", "translation")
    num_prompts: int = 16
    max_new_tokens: int = 64
    top_k: int = 0
    top_p: float = 1.0
    gamma: int = 4
    repeats: int = 1
    warmup: int = 1
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    threads: int = 0


def sweep_labels(config: SweepConfig) -> tuple[str, ...]:
    """ar, draft-only, then label@alpha for every method and alpha of its grid."""
    if not config.methods:
        raise DraftwiseError("no methods given")
    unknown = sorted(set(config.grids) - set(config.methods))
    if unknown:
        raise DraftwiseError(f"--grid given for {', '.join(unknown)}, which is not among --methods")
    labels = ["ar", DRAFT_ONLY]
    for label in config.methods:
        if "@" in label:
            raise DraftwiseError(f"method {label!r}: give alphas with --alpha-grid / --grid, not @")
        name, _ = parse_label(label)
        if name in ("ar", DRAFT_ONLY):
            continue
        grid = config.grids.get(label, config.alpha_grid)
        if not grid:
            raise DraftwiseError(f"method {label!r} has no alpha grid")
        labels.extend(f"{label}@{alpha:g}" for alpha in grid)
    check_methods(tuple(labels))
    return tuple(labels)


def run_sweep(config: SweepConfig, *, progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    labels = sweep_labels(config)
    runs: dict[str, Any] = {}
    machine: dict[str, Any] = {}
    from draftwise.models import registry

    # Cascades need a draft language model (unwarped q over the whole vocabulary): the registry's
    # independent draft by default, not its EAGLE head.
    draft = config.draft or registry.default_independent_draft(config.target)
    for temperature in config.temperatures:
        bench = BenchConfig(
            target=config.target, draft=draft, methods=labels, dataset=config.dataset,
            categories=config.categories, num_prompts=config.num_prompts, max_new_tokens=config.max_new_tokens,
            temperature=temperature, top_k=config.top_k, top_p=config.top_p, gamma=config.gamma,
            repeats=config.repeats, warmup=config.warmup, dtype=config.dtype, device=config.device,
            seed=config.seed, threads=config.threads, quality=True,
        )
        result = run_bench(bench, progress=progress)
        machine = result["machine"]
        runs[f"{temperature:g}"] = result
    return {
        "config": asdict(config) | {"labels": list(labels), "draft": draft},
        "machine": machine,
        "temperatures": {t: summarize_sweep(r["methods"], config) for t, r in runs.items()},
        "runs": runs,
    }


def summarize_sweep(methods: dict[str, dict], config: SweepConfig) -> dict[str, Any]:
    """Curves, references and Table 2 from one run's per-label metrics."""
    def point(label: str, m: dict) -> dict[str, Any]:
        speedup = m.get("speedup_vs_ar")
        p = {"label": label, "relative_latency": 1.0 / speedup if speedup else None, "speedup": speedup,
             "rejection_rate": m["rejection_rate"], "deferral_rate": m["deferral_rate"],
             "target_calls_per_token": m["target_calls_per_token"]}
        p.update({k: m[k] for k in QUALITY_METRICS if k in m})
        return p

    target, draft = point("ar", methods["ar"]), point(DRAFT_ONLY, methods[DRAFT_ONLY])
    curves: dict[str, list[dict]] = {}
    for label in config.methods:
        name, _ = parse_label(label)
        if name in ("ar", DRAFT_ONLY):
            continue
        grid = config.grids.get(label, config.alpha_grid)
        curves[label] = [point(f"{label}@{a:g}", methods[f"{label}@{a:g}"]) | {"alpha": a} for a in grid]
    metrics = [k for k in QUALITY_METRICS if k in target]
    return {"target": target, "draft_only": draft, "curves": curves, "table2": table2(curves, target, metrics)}


def _better_or_equal(metric: str, value: float, reference: float) -> bool:
    return value <= reference if metric in LOWER_IS_BETTER else value >= reference


def table2(curves: dict[str, list[dict]], target: dict, metrics: list[str]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for metric in metrics:
        out[metric] = {}
        for label, points in curves.items():
            scored = [p for p in points if p.get(metric) is not None and p["speedup"]]
            matching = [p for p in scored if _better_or_equal(metric, p[metric], target[metric])]
            fast = [p for p in scored if p["relative_latency"] <= 1.0]
            best_match = max(matching, key=lambda p: p["speedup"], default=None)
            pick = min if metric in LOWER_IS_BETTER else max
            best_fast = pick(fast, key=lambda p: p[metric], default=None)
            out[metric][label] = {
                "speedup_at_target_quality": best_match["speedup"] if best_match else None,
                "alpha_at_target_quality": best_match["alpha"] if best_match else None,
                "best_quality_within_target_latency": best_fast[metric] if best_fast else None,
                "alpha_best_quality": best_fast["alpha"] if best_fast else None,
            }
    return out


def format_sweep(result: dict[str, Any]) -> str:
    lines = []
    for t, summary in result["temperatures"].items():
        metrics = list(summary["table2"])
        lines.append(f"temperature {t}: target quality " + ", ".join(
            f"{k} {summary['target'][k]:.3g}" for k in metrics) + "; draft-only " + ", ".join(
            f"{k} {summary['draft_only'][k]:.3g}" for k in metrics) + f" at {summary['draft_only']['relative_latency']:.2f}x latency")
        header = ["method", "alpha", "latency", "reject", "defer"] + metrics
        rows = [header]
        for label, points in summary["curves"].items():
            for p in points:
                rows.append([label, f"{p['alpha']:g}", f"{p['relative_latency']:.2f}", f"{p['rejection_rate']:.2f}",
                             f"{p['deferral_rate']:.2f}"] + [f"{p[k]:.3g}" if p.get(k) is not None else "-" for k in metrics])
        lines.extend(_aligned(rows))
        rows = [["Table 2", "view"] + metrics]
        labels = list(summary["curves"])
        for label in labels:
            speed = [summary["table2"][k][label]["speedup_at_target_quality"] for k in metrics]
            best = [summary["table2"][k][label]["best_quality_within_target_latency"] for k in metrics]
            rows.append([label, "speedup at target quality"] + [f"{v:.2f}x" if v else "-" for v in speed])
            rows.append([label, "best quality, latency <= 1"] + [f"{v:.3g}" if v is not None else "-" for v in best])
        lines.extend(_aligned(rows))
        lines.append("")
    return "\n".join(lines)


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def plot_sweep(result: dict[str, Any], path) -> None:
    """Quality against latency relative to the target, one curve per method, one panel per
    (temperature, metric); the target's quality as a dashed line, the draft's as a dotted one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(result["temperatures"])
    metrics = list(next(iter(result["temperatures"].values()))["table2"])
    names = {"rouge2": "ROUGE-2 (summarization)", "bleu": "BLEU (translation)",
             "perplexity": "target perplexity (lower is better)", "target_agreement": "agreement with target greedy"}
    fig, axes = plt.subplots(len(temps), len(metrics), figsize=(4.2 * len(metrics), 3.6 * len(temps)), squeeze=False)
    for row, t in enumerate(temps):
        summary = result["temperatures"][t]
        for col, metric in enumerate(metrics):
            ax = axes[row][col]
            for label, points in summary["curves"].items():
                pts = sorted((p for p in points if p.get(metric) is not None and p["relative_latency"]),
                             key=lambda p: p["relative_latency"])
                ax.plot([p["relative_latency"] for p in pts], [p[metric] for p in pts], marker="o", markersize=3,
                        label=label)
            ax.axhline(summary["target"][metric], color="black", linestyle="--", linewidth=1, label="target only")
            ax.axhline(summary["draft_only"][metric], color="gray", linestyle=":", linewidth=1, label="draft only")
            ax.axvline(1.0, color="black", linewidth=0.5, alpha=0.5)
            if metric == "perplexity":
                ax.set_yscale("log")  # the draft alone can be orders of magnitude worse
            ax.set_xlabel("latency relative to target-only (s/token ratio)")
            ax.set_ylabel(names.get(metric, metric))
            ax.set_title(f"T = {t}", fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    cfg = result["config"]
    fig.suptitle(f"{cfg['target']} + {cfg['draft'] or 'default draft'} | gamma {cfg['gamma']} | "
                 f"{', '.join(cfg['categories'])} | {result['machine'].get('cpu', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_sweeps(results: list[dict]) -> dict:
    """Sweeps run separately per temperature (same config otherwise) as one result (`benchmarks/merge_sweeps.py`);
    a DraftwiseError when they differ in more than their temperatures."""
    base = results[0]
    same = {k: v for k, v in base["config"].items() if k != "temperatures"}
    for other in results[1:]:
        theirs = {k: v for k, v in other["config"].items() if k != "temperatures"}
        if theirs != same:
            raise DraftwiseError("these sweeps differ in more than their temperatures; refusing to merge")
    merged = {**base, "config": {**base["config"], "temperatures": []}, "temperatures": {}, "runs": {}}
    for r in results:
        merged["config"]["temperatures"] += r["config"]["temperatures"]
        merged["temperatures"].update(r["temperatures"])
        merged["runs"].update(r["runs"])
    return merged
