"""MTAD tables from `draftwise bench` JSON (the MTAD paper Table 4, Table 7, Figure 3).

    python benchmarks/mtad_tables.py benchmarks/results/mtad-t1.json \
        --ablation benchmarks/results/mtad-ablation-t1.json --plot benchmarks/results/mtad-ablation-t1.png \
        --out benchmarks/results/mtad-t1.txt

Table 4: tokens/s, speedup against `sd` (same run), block efficiency (tokens per target
call), target perplexity, ROUGE-L against the references, energy per token (or why there
is none). The ablation file holds `mtad/num_beams=W` and `mtad/tau=T` columns next to `sd`.
Nothing is recomputed: every number is read from the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict, labels: list[str] | None = None, baseline: str = "sd") -> str:
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


def _setting(label: str, key: str) -> float | None:
    match = re.search(rf"/{key}=([0-9.]+)", label)
    return float(match.group(1)) if match else None


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, xlabel in [(axes[0], "num_beams", "beams W (tau 0.5)"), (axes[1], "tau", "tau (4 beams)")]:
        points = sorted((_setting(n, key), m) for n, m in methods.items() if _setting(n, key) is not None)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("main", help="bench JSON with sd, bild, mtad, mtjd")
    parser.add_argument("--ablation", help="bench JSON with mtad/num_beams=... and mtad/tau=... columns")
    parser.add_argument("--plot", help="PNG of the ablations")
    parser.add_argument("--out", help="also write the tables here")
    args = parser.parse_args()
    results = json.loads(Path(args.main).read_text())
    cfg = results["config"]
    parts = [f"Table 4 style: {len(cfg['prompts'])} prompts x {cfg['repeats']} repeats, {cfg['max_new_tokens']} new "
             f"tokens, T={cfg['temperature']} top-k {cfg['top_k']} top-p {cfg['top_p']}, gamma {cfg['gamma']}",
             table(results)]
    if args.ablation:
        ablation = json.loads(Path(args.ablation).read_text())
        names = list(ablation["methods"])
        beams = [n for n in names if _setting(n, "num_beams") is not None]
        taus = [n for n in names if _setting(n, "tau") is not None]
        acfg = ablation["config"]
        parts += [f"\nAblations: {len(acfg['prompts'])} prompts x {acfg['repeats']} repeat(s), {acfg['max_new_tokens']} "
                  "new tokens; number of beams (Table 7)", table(ablation, ["sd"] + beams),
                  "\nthreshold tau (Figure 3)", table(ablation, ["sd"] + taus)]
        if args.plot:
            plot(ablation, args.plot)
    text = "\n".join(parts)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
