"""One PNG per seed from the JSON that benchmarks/seed_tables.sh writes (nothing is re-measured).

    python benchmarks/seed_plots.py out/seed-tables-pair            # every seed whose JSON is there
    python benchmarks/seed_plots.py out/seed-tables-pair --only mtad

Written beside the JSON:
- seed-cascades.png: the cascades' quality-latency frontier (sweep-cascades.json, else sweep-t*.json): every
  method's points, latency relative to `ar` against pass@1 (else the sweep's first quality metric), the
  frontier over all points (the target and the draft alone included: the cascades' end points) as a step line;
- seed-sprinter.png: SPRINTER's speed against quality (sprinter-t*.json): tokens/s relative to `sd` against
  pass@1 (else target perplexity), each point labelled with its target calls per token;
- seed-mtad.png: MTAD's target perplexity against speed relative to `sd` (mtad-t1.json, mtad-ablation-t1.json);
- seed-sv.png: SV's goodput (committed tokens/s) by batch size (sv-batched-t*.json), one line per method.
A seed without its JSON is skipped with a line saying so; a file that is not such JSON stops the script with a
one-line error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

SEEDS = ("cascades", "sprinter", "mtad", "sv")
LOWER_IS_BETTER = {"perplexity"}
QUALITY_NAMES = {"pass_at_1": "HumanEval pass@1", "perplexity": "target perplexity (lower is better)",
                 "rouge2": "ROUGE-2", "bleu": "BLEU", "target_agreement": "agreement with target greedy"}


class PlotError(Exception):
    """A file that is not the JSON a plot needs: reported as one line."""


def load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise PlotError(f"{path}: cannot read ({error.strerror or error})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PlotError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise PlotError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def need(data: Any, path: Path, *keys: str) -> Any:
    """data[k1][k2]... or a PlotError naming the missing key."""
    for depth, key in enumerate(keys):
        if not isinstance(data, dict) or key not in data:
            raise PlotError(f"{path}: not a seed-table result (no {'.'.join(keys[: depth + 1])!r})")
        data = data[key]
    return data


def _temperature(path: Path) -> str:
    match = re.search(r"-t([0-9.]+)\.json$", path.name)
    return match.group(1) if match else path.stem


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def frontier(points: list[tuple[float, float, str]], lower_is_better: bool = False) -> list[tuple[float, float, str]]:
    """The points no other point beats on both axes: lower latency (x) and better quality (y)."""
    best: list[tuple[float, float, str]] = []
    for x, y, label in sorted(points, key=lambda p: (p[0], p[1] if lower_is_better else -p[1])):
        if not best or (y < best[-1][1] if lower_is_better else y > best[-1][1]):
            best.append((x, y, label))
    return best


def _title(data: dict[str, Any]) -> str:
    cfg, machine = data.get("config", {}), data.get("machine", {})
    parts = [str(cfg.get("target", "")), "+ " + str(cfg.get("draft") or "")]
    prompts = len(cfg["prompts"]) if isinstance(cfg.get("prompts"), list) else cfg.get("num_prompts")
    if prompts:
        parts.append(f"| {prompts} prompts")
    if machine.get("cpu"):
        parts.append(f"| {machine['cpu']}")
    return "\n" + " ".join(p for p in parts if p.strip("+ |"))


def _panels(items: list, width: float, draw: Callable[[Any, Any], list[str]], title: str, png: Path) -> list[str]:
    """One panel per item, side by side, `width` inches each: `draw(ax, item)` fills a panel and returns its note
    lines; every panel gets a grid, the figure `title`, and it is written to `png`. Returns the notes."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(items), figsize=(width * len(items), 4.2), squeeze=False)
    notes = []
    for ax, item in zip(axes[0], items):
        notes += draw(ax, item)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return notes


# --- cascades ------------------------------------------------------------------------------------------------------

def cascades_data(out: Path) -> tuple[dict[str, Any], Path] | None:
    merged = out / "sweep-cascades.json"
    if merged.exists():
        return load(merged), merged
    parts = sorted(out.glob("sweep-t*.json"))
    if not parts:
        return None
    temperatures: dict[str, Any] = {}
    first = load(parts[0])
    for path in parts:
        temperatures.update(need(load(path), path, "temperatures"))
    return {**first, "temperatures": temperatures}, parts[0]


def plot_cascades(data: dict[str, Any], path: Path, png: Path) -> list[str]:
    temps = need(data, path, "temperatures")
    if not isinstance(temps, dict) or not temps:
        raise PlotError(f"{path}: no temperatures in the sweep")

    def draw(ax, item: tuple[str, Any]) -> list[str]:
        t, summary = item
        target = need(summary, path, "target")
        curves = need(summary, path, "curves")
        metric = "pass_at_1" if target.get("pass_at_1") is not None else next(
            (k for k in ("rouge2", "bleu", "perplexity", "target_agreement") if target.get(k) is not None), None)
        if metric is None:
            raise PlotError(f"{path}: temperature {t} has no quality metric")
        lower = metric in LOWER_IS_BETTER
        everything = []
        for label, points in curves.items():
            pts = sorted((p["relative_latency"], p[metric], p.get("label", label)) for p in points
                         if p.get("relative_latency") is not None and p.get(metric) is not None)
            everything += pts
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", markersize=4, alpha=0.8, label=label)
        draft = summary.get("draft_only") or {}
        references = [(1.0, target[metric], "ar")] + ([(draft["relative_latency"], draft[metric], "draft alone")]
                                                      if draft.get(metric) is not None and draft.get("relative_latency")
                                                      else [])
        front = frontier(everything + references, lower)  # the two models alone are the cascades' end points
        if front:
            ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="black", linewidth=1,
                    label="frontier")
        ax.plot([1.0], [target[metric]], "k*", markersize=10, label="target alone (ar)")
        if len(references) > 1:
            ax.plot([references[1][0]], [references[1][1]], "kx", markersize=8, label="draft alone")
        ax.axvline(1.0, color="gray", linewidth=0.6, linestyle=":")
        ax.set_xlabel("latency relative to ar (same run)")
        ax.set_ylabel(QUALITY_NAMES.get(metric, metric))
        if lower:
            ax.set_yscale("log")
        ax.set_title(f"T = {t}", fontsize=9)
        ax.legend(fontsize=6)
        return [f"T={t}: frontier ({metric}) " + ", ".join(f"{lab} ({x:.2f}, {y:.3g})" for x, y, lab in front)]

    return _panels(list(temps.items()), 5.2, draw, "Speculative cascades: quality against latency" + _title(data), png)


# --- bench tables (sprinter, mtad) ---------------------------------------------------------------------------------

def _methods(data: dict[str, Any], path: Path) -> dict[str, dict]:
    methods = need(data, path, "methods")
    if not isinstance(methods, dict) or not methods:
        raise PlotError(f"{path}: no methods")
    for label, m in methods.items():
        if not isinstance(m, dict) or not isinstance(m.get("tokens_per_s"), (int, float)):
            raise PlotError(f"{path}: method {label!r} has no tokens_per_s")
    return methods


def _vs_sd(methods: dict[str, dict], path: Path) -> dict[str, float]:
    if "sd" not in methods or not methods["sd"]["tokens_per_s"]:
        raise PlotError(f"{path}: no sd column to compare with")
    base = methods["sd"]["tokens_per_s"]
    return {label: m["tokens_per_s"] / base for label, m in methods.items()}


def plot_sprinter(files: list[Path], png: Path) -> list[str]:
    def draw(ax, path: Path) -> list[str]:
        methods = _methods(load(path), path)
        speed = _vs_sd(methods, path)
        metric = "pass_at_1" if all(m.get("pass_at_1") is not None for m in methods.values()) else "perplexity"
        if any(m.get(metric) is None for m in methods.values()):
            raise PlotError(f"{path}: a method has neither pass_at_1 nor perplexity")
        for label, m in methods.items():
            marker = "s" if label.startswith("sprinter") else "o"
            ax.plot([speed[label]], [m[metric]], marker, markersize=6)
            ax.annotate(f"{label} ({m.get('target_calls_per_token', 0):.2f} calls/tok)", (speed[label], m[metric]),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axvline(1.0, color="gray", linewidth=0.6, linestyle=":")
        ax.set_xlabel("tokens/s relative to sd (same run)")
        ax.set_ylabel(QUALITY_NAMES.get(metric, metric))
        ax.set_title(f"T = {_temperature(path)}", fontsize=9)
        best = max((lab for lab in methods if lab.startswith("sprinter")), key=lambda lab: speed[lab], default=None)
        if best is None:
            return []
        return [f"T={_temperature(path)}: fastest SPRINTER {best} {speed[best]:.2f}x sd, {metric} "
                f"{methods[best][metric]:.3g} (sd {methods['sd'][metric]:.3g})"]

    return _panels(files, 5.2, draw, "SPRINTER: speed against quality" + _title(load(files[0])), png)


def plot_mtad(files: list[Path], png: Path) -> list[str]:
    def draw(ax, path: Path) -> list[str]:
        methods = _methods(load(path), path)
        speed = _vs_sd(methods, path)
        for label, m in methods.items():
            if m.get("perplexity") is None:
                raise PlotError(f"{path}: method {label!r} has no perplexity")
            marker = "s" if label.startswith(("mtad", "mtjd")) else "o"
            ax.plot([speed[label]], [m["perplexity"]], marker, markersize=6)
            text = label + (f", pass@1 {m['pass_at_1']:.2f}" if m.get("pass_at_1") is not None else "")
            ax.annotate(text, (speed[label], m["perplexity"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axvline(1.0, color="gray", linewidth=0.6, linestyle=":")
        ax.axhline(methods["sd"]["perplexity"], color="gray", linewidth=0.6, linestyle=":")
        ax.set_xlabel("tokens/s relative to sd (same run)")
        ax.set_ylabel("target perplexity (lower is better)")
        ax.set_title(path.stem, fontsize=9)
        if "mtad" not in methods:
            return []
        m, sd = methods["mtad"], methods["sd"]
        return [f"{path.name}: mtad {speed['mtad']:.2f}x sd, perplexity {m['perplexity']:.3f} "
                f"(sd {sd['perplexity']:.3f})" + (f", pass@1 {m['pass_at_1']:.2f} (sd {sd['pass_at_1']:.2f})"
                                                  if m.get("pass_at_1") is not None
                                                  and sd.get("pass_at_1") is not None else "")]

    return _panels(files, 5.6, draw, "MTAD: target perplexity against speed" + _title(load(files[0])), png)


def plot_sv(files: list[Path], png: Path) -> list[str]:
    def draw(ax, path: Path) -> list[str]:
        methods = need(load(path), path, "batched", "methods")
        if not isinstance(methods, dict) or not methods:
            raise PlotError(f"{path}: no batched methods")
        for label, by_batch in methods.items():
            try:
                pts = sorted((int(b), float(m["throughput_tok_s"])) for b, m in by_batch.items())
            except (AttributeError, KeyError, TypeError, ValueError):
                raise PlotError(f"{path}: method {label!r} has no throughput_tok_s per batch size") from None
            ax.plot([b for b, _ in pts], [v for _, v in pts], "o-" if label in ("sv", "sd") else "o--",
                    linewidth=2 if label == "sv" else 1, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("goodput (committed tokens/s)")
        ax.set_title(f"T = {_temperature(path)}", fontsize=9)
        ax.legend(fontsize=6)
        if "sv" not in methods or "sd" not in methods:
            return []
        ratios = ", ".join(f"B={b} {m['throughput_tok_s'] / methods['sd'][b]['throughput_tok_s']:.2f}x"
                           for b, m in methods["sv"].items() if b in methods["sd"])
        return [f"T={_temperature(path)}: sv against sd: {ratios}"]

    return _panels(files, 5.2, draw, "Speculative Verification: goodput by batch size" + _title(load(files[0])), png)


def plot_seed(seed: str, out: Path) -> tuple[Path | None, list[str]]:
    """Draw one seed's PNG from the JSON in `out`; (None, [why]) when its JSON is not there."""
    png = out / f"seed-{seed}.png"
    if seed == "cascades":
        found = cascades_data(out)
        if found is None:
            return None, ["no sweep-cascades.json or sweep-t*.json"]
        return png, plot_cascades(found[0], found[1], png)
    patterns = {"sprinter": ["sprinter-t*.json"], "mtad": ["mtad-t1.json", "mtad-ablation-t1.json"],
                "sv": ["sv-batched-t*.json"]}[seed]
    files = [p for pattern in patterns for p in sorted(out.glob(pattern))]
    if not files:
        return None, ["no " + " or ".join(patterns)]
    draw = {"sprinter": plot_sprinter, "mtad": plot_mtad, "sv": plot_sv}[seed]
    return png, draw(files, png)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the seed tables' folder (e.g. out/seed-tables-pair)")
    parser.add_argument("--only", default=",".join(SEEDS), help=f"comma-separated, from: {', '.join(SEEDS)}")
    args = parser.parse_args(argv)
    out = Path(args.out)
    seeds = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in seeds if s not in SEEDS]
    try:
        if unknown:
            raise PlotError(f"unknown seed(s) {', '.join(unknown)}; choose from {', '.join(SEEDS)}")
        if not out.is_dir():
            raise PlotError(f"{out}: no such folder")
        for seed in seeds:
            png, notes = plot_seed(seed, out)
            if png is None:
                print(f"seed plots: {seed} skipped ({notes[0]})")
                continue
            print(f"seed plots: {png}")
            for note in notes:
                print(f"  {note}")
    except PlotError as error:
        print(f"seed plots: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
