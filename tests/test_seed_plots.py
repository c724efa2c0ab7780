"""draftwise/bench/seed_plots.py (benchmarks/seed_plots.py) on small synthetic seed-table JSON: a PNG per seed, the
frontier, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftwise.bench import seed_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "seed_plots.py"


def _point(label: str, latency: float, pass_at_1: float, alpha: float | None = None) -> dict:
    p = {"label": label, "relative_latency": latency, "speedup": 1 / latency, "rejection_rate": 0.2,
         "deferral_rate": 0.1, "target_calls_per_token": 0.4, "pass_at_1": pass_at_1, "perplexity": 1.5}
    return p | ({"alpha": alpha} if alpha is not None else {})


def _bench_method(tps: float, ppl: float, pass_at_1: float, calls: float = 0.5) -> dict:
    return {"tokens_per_s": tps, "perplexity": ppl, "pass_at_1": pass_at_1, "target_calls_per_token": calls}


def write_tables(out: Path) -> None:
    machine = {"cpu": "test CPU"}
    config = {"target": "tiny-target", "draft": "tiny-draft"}
    curves = {"cascade:token-v3": [_point("cascade:token-v3@0", 0.9, 0.8, 0), _point("cascade:token-v3@0.5", 0.7, 0.75, 0.5)],
              "lossy": [_point("lossy@0", 1.1, 0.8, 0), _point("lossy@0.5", 0.8, 0.6, 0.5)]}
    summary = {"target": _point("ar", 1.0, 0.8), "draft_only": _point("draft-only", 0.4, 0.45), "curves": curves,
               "table2": {}}
    (out / "sweep-t1.json").write_text(json.dumps({"config": config, "machine": machine, "temperatures": {"1": summary}}))
    methods = {"ar": _bench_method(10, 1.6, 0.8, 1.0), "sd": _bench_method(8, 1.6, 0.8),
               "sprinter": _bench_method(12, 1.9, 0.7, 0.2)}
    for name in ("sprinter-t0.json", "sprinter-t1.json"):
        (out / name).write_text(json.dumps({"config": config, "machine": machine, "methods": methods}))
    mtad = {"ar": _bench_method(10, 1.6, 0.8, 1.0), "sd": _bench_method(8, 1.9, 0.7), "mtad": _bench_method(8.5, 1.5, 0.75)}
    (out / "mtad-t1.json").write_text(json.dumps({"config": config, "machine": machine, "methods": mtad}))
    batched = {label: {str(b): {"throughput_tok_s": tps * b ** 0.5} for b in (1, 4, 16)}
               for label, tps in (("ar", 10), ("sd", 8), ("sv", 9))}
    (out / "sv-batched-t1.json").write_text(json.dumps({"config": config, "machine": machine,
                                                        "batched": {"batch_sizes": [1, 4, 16], "methods": batched}}))


def test_every_seed_writes_a_png(tmp_path, capsys):
    write_tables(tmp_path)
    assert seed_plots.main([str(tmp_path)]) == 0
    for seed in seed_plots.SEEDS:
        png = tmp_path / f"seed-{seed}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, seed
    printed = capsys.readouterr().out
    # the frontier: the draft alone, token-v3@0.5 (0.7, 0.75), token-v3@0 (0.9, 0.8); lossy and ar (1.0, 0.8) are beaten
    assert "frontier (pass_at_1) draft alone (0.40, 0.45), cascade:token-v3@0.5 (0.70, 0.75), cascade:token-v3@0 (0.90, 0.8)\n" in printed
    assert "lossy" not in printed.split("frontier")[1].splitlines()[0]
    assert "mtad 1.06x sd, perplexity 1.500 (sd 1.900), pass@1 0.75 (sd 0.70)" in printed
    assert "sv against sd: B=1 1.12x, B=4 1.12x, B=16 1.12x" in printed


def test_frontier_keeps_only_unbeaten_points():
    points = [(1.0, 0.8, "a"), (0.5, 0.5, "b"), (0.7, 0.4, "c"), (0.9, 0.9, "d"), (1.2, 0.85, "e")]
    assert [p[2] for p in seed_plots.frontier(points)] == ["b", "d"]
    # lower-is-better quality (perplexity): the best is the smallest
    assert [p[2] for p in seed_plots.frontier(points, lower_is_better=True)] == ["b", "c"]


def test_missing_json_skips_that_seed(tmp_path, capsys):
    write_tables(tmp_path)
    (tmp_path / "sv-batched-t1.json").unlink()
    assert seed_plots.main([str(tmp_path), "--only", "sv,mtad"]) == 0
    assert "sv skipped" in capsys.readouterr().out
    assert not (tmp_path / "seed-sv.png").exists() and (tmp_path / "seed-mtad.png").exists()


@pytest.mark.parametrize("text, words", [
    ('{"methods": {"sd": ', "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"config": {}}', "no 'methods'"),
    ('{"methods": {"sd": {"tokens_per_s": 1}, "mtad": {"perplexity": 2}}}', "'mtad' has no tokens_per_s"),
])
def test_bad_json_is_one_line_error(tmp_path, text, words):
    (tmp_path / "mtad-t1.json").write_text(text)
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--only", "mtad"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert words in lines[0] and "mtad-t1.json" in lines[0]
    assert not (tmp_path / "seed-mtad.png").exists()


def test_unknown_seed_and_missing_folder(tmp_path, capsys):
    assert seed_plots.main([str(tmp_path), "--only", "cascade"]) == 2
    assert seed_plots.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "unknown seed(s) cascade" in err[0] and "no such folder" in err[1]
