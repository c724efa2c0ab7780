"""Quality metrics and the trade-off sweep: hand-computed cases, labels, and one tiny end-to-end sweep."""

from __future__ import annotations

import json
import math

import pytest
import torch

from draftwise.bench.labels import parse_label
from draftwise.bench.metrics import RunRecord, quality_fields
from draftwise.bench.quality import corpus_bleu, rouge2, target_score
from draftwise.bench.sweep import SweepConfig, sweep_labels, table2
from draftwise.errors import DraftwiseError


def test_rouge2_hand_computed():
    # candidate bigrams: the cat, cat sat, sat on, on the, the mat (5); reference: the cat, cat is, is on,
    # on the, the mat (5); overlap: the cat, on the, the mat = 3 -> P = R = 3/5, F = 60
    assert rouge2("The cat sat on the mat.", "the cat is on the mat") == pytest.approx(60.0)
    # clipping: "a a a" has bigram (a, a) twice, the reference once -> P = 1/2, R = 1/1, F = 2/3
    assert rouge2("a a a", "a a") == pytest.approx(100 * 2 * 0.5 * 1.0 / 1.5)
    assert rouge2("", "the cat") == 0.0 and rouge2("one", "one") == 0.0  # no bigrams
    assert rouge2("Hello, World!", "hello world") == pytest.approx(100.0)  # case and punctuation


def test_corpus_bleu_matches_sacrebleu_extremes():
    refs = ["the quick brown fox jumps over the lazy dog"]
    assert corpus_bleu(refs, refs) == pytest.approx(100.0)
    assert corpus_bleu(["zzz yyy xxx www"], refs) == pytest.approx(0.0, abs=1e-9)
    assert corpus_bleu([], []) == 0.0


def test_target_score_is_teacher_forced_nll_and_agreement():
    from conftest import tiny_llama

    model = tiny_llama(0)
    prompt, output = [1, 2, 3], [4, 5, 6, 7]
    score = target_score(model, prompt, output, 64)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    nll, agree = 0.0, 0
    for i, token in enumerate(output):
        row = logits[len(prompt) - 1 + i]
        nll -= float(torch.log_softmax(row, -1)[token])
        agree += int(row.argmax()) == token
    assert score.tokens == 4 and score.agree == agree
    assert score.nll == pytest.approx(nll, rel=1e-5)


def test_quality_fields_hand_computed():
    def r(cat, nll, n, agree, text="", ref=None):
        return RunRecord(method="m", repeat=0, question_id=0, category=cat, new_tokens=n, wall_time_s=1.0,
                         target_calls=n, nll=nll, scored_tokens=n, agree=agree, text=text, reference=ref)

    fields = quality_fields([
        r("summarization", 2.0, 2, 1, "the cat sat", "the cat sat"),  # ROUGE-2 100
        r("summarization", 4.0, 2, 2, "a b", "c d"),  # ROUGE-2 0
        r("translation", 6.0, 4, 1, "the quick brown fox jumps", "the quick brown fox jumps"),
        r("qa", 0.0, 2, 2),
    ])
    assert fields["perplexity"] == pytest.approx(math.exp(12.0 / 10))
    assert fields["target_agreement"] == pytest.approx(6 / 10)
    assert fields["rouge2"] == pytest.approx(50.0)
    assert fields["bleu"] == pytest.approx(100.0)
    assert quality_fields([RunRecord("m", 0, 0, "qa", 1, 1.0, 1)]) == {}


def test_method_labels():
    assert parse_label("sd") == ("sd", {})
    assert parse_label("cascade:opt@0.25") == ("cascade", {"rule": "opt", "alpha": 0.25})
    assert parse_label("lossy@0.1") == ("lossy", {"alpha": 0.1})
    assert parse_label("draft-only") == ("draft-only", {})
    for bad, message in [("cascade:nope", "unknown cascade rule"), ("sd:opt", "has no 'rule' option"),
                         ("lossy@x", "not a number"), ("nope", "unknown method 'nope'"),
                         ("hf-assisted@0.1", "takes no"), ("lossy@1.5", "alpha must be in")]:
        with pytest.raises(DraftwiseError, match=message):
            parse_label(bad)


def test_sweep_labels_and_bad_grids():
    config = SweepConfig(target="t", methods=("cascade:token-v3", "lossy"), alpha_grid=(0.0, 0.5),
                         grids={"lossy": (0.2,)})
    assert sweep_labels(config) == ("ar", "draft-only", "cascade:token-v3@0", "cascade:token-v3@0.5", "lossy@0.2")
    with pytest.raises(DraftwiseError, match="not among --methods"):
        sweep_labels(SweepConfig(target="t", methods=("lossy",), alpha_grid=(0.1,), grids={"sd": (0.1,)}))
    with pytest.raises(DraftwiseError, match="not @"):
        sweep_labels(SweepConfig(target="t", methods=("lossy@0.1",), alpha_grid=(0.1,)))


def test_table2_hand_computed():
    target = {"rouge2": 10.0, "perplexity": 5.0}
    curves = {"m": [
        {"alpha": 0.0, "speedup": 0.8, "relative_latency": 1.25, "rouge2": 12.0, "perplexity": 4.0},
        {"alpha": 0.3, "speedup": 1.25, "relative_latency": 0.8, "rouge2": 10.5, "perplexity": 5.5},
        {"alpha": 0.6, "speedup": 2.0, "relative_latency": 0.5, "rouge2": 8.0, "perplexity": 9.0},
    ]}
    t = table2(curves, target, ["rouge2", "perplexity"])
    # ROUGE-2 >= 10 at alpha 0 and 0.3: the faster one is 1.25x; within latency 1: 0.3 and 0.6, best 10.5
    assert t["rouge2"]["m"] == {"speedup_at_target_quality": 1.25, "alpha_at_target_quality": 0.3,
                                "best_quality_within_target_latency": 10.5, "alpha_best_quality": 0.3}
    # perplexity <= 5 only at alpha 0 (0.8x); within latency 1 the lowest is 5.5
    assert t["perplexity"]["m"] == {"speedup_at_target_quality": 0.8, "alpha_at_target_quality": 0.0,
                                    "best_quality_within_target_latency": 5.5, "alpha_best_quality": 0.3}


def test_sweep_end_to_end_on_tiny_models(tmp_path):
    from conftest import save_pair

    from draftwise.bench.report import write_json
    from draftwise.bench.sweep import format_sweep, plot_sweep, run_sweep

    save_pair(tmp_path, window=2048)
    config = SweepConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"),
                         methods=("cascade:token-v3", "cascade:opt", "lossy", "token-cascade"), alpha_grid=(0.0, 0.9),
                         grids={"token-cascade": (0.2,)}, temperatures=(1.0, 0.5), num_prompts=2, max_new_tokens=6,
                         dtype="fp32")
    result = run_sweep(config)
    assert set(result["temperatures"]) == {"1", "0.5"}
    summary = result["temperatures"]["1"]
    assert set(summary["curves"]) == {"cascade:token-v3", "cascade:opt", "lossy", "token-cascade"}
    assert [p["alpha"] for p in summary["curves"]["lossy"]] == [0.0, 0.9]
    point = summary["curves"]["cascade:token-v3"][0]
    for key in ("relative_latency", "rejection_rate", "deferral_rate", "perplexity", "target_agreement", "rouge2",
                "bleu"):
        assert key in point, key
    assert summary["target"]["deferral_rate"] == 1.0  # ar: every token from the target
    assert set(summary["table2"]) == {"rouge2", "bleu", "perplexity", "target_agreement"}
    write_json(result, tmp_path / "sweep.json")
    assert json.loads((tmp_path / "sweep.json").read_text())["config"]["labels"][:2] == ["ar", "draft-only"]
    plot_sweep(result, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert "Table 2" in format_sweep(result)


def test_rouge1_and_rougeL_hand_computed():
    from draftwise.bench.quality import rouge_l, rouge_n

    # unigrams: cand {the, cat, sat, on, mat} x the twice; ref "the cat is on the mat": overlap the x2, cat, on, mat = 5
    assert rouge_n("the cat sat on the mat", "the cat is on the mat", 1) == pytest.approx(100 * 5 / 6)
    # LCS of [the cat sat on the mat] and [the cat is on the mat] = the cat on the mat (5): P = R = 5/6
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(100 * 5 / 6)
    assert rouge_l("a b c", "c b a") == pytest.approx(100 / 3)  # LCS length 1
    assert rouge_l("", "a") == 0.0


def test_pairwise_quality_against_a_reference_method():
    from draftwise.bench.metrics import pairwise_quality, report

    def r(method, qid, text, nll, n=4):
        return RunRecord(method=method, repeat=0, question_id=qid, category="qa", new_tokens=n, wall_time_s=1.0,
                         target_calls=n, nll=nll, scored_tokens=n, agree=0, text=text)

    sd = [r("sd", 1, "a b c d", 4.0), r("sd", 2, "e f g h", 8.0)]
    mine = [r("x", 1, "a b c d", 2.0), r("x", 2, "e f z z", 8.0)]  # wins 1, ties 2
    q = pairwise_quality(mine, sd)
    assert q["win_tie_rate"] == 1.0 and q["pairs"] == 2
    assert q["rouge1"] == pytest.approx((100 + 50) / 2)
    assert q["rouge2"] == pytest.approx((100 + 100 * 2 * (1 / 3) * (1 / 3) / (2 / 3)) / 2)
    worse = pairwise_quality([r("y", 1, "q", 40.0), r("y", 2, "e f g h", 8.0)], sd)
    assert worse["win_tie_rate"] == 0.5
    out = report(sd + mine, baseline="sd", compare_to="sd")
    assert "vs_sd" in out["x"] and "vs_sd" not in out["sd"] and out["x"]["speedup_vs_sd"] == pytest.approx(1.0)


def test_every_spec_bench_reference_becomes_text():
    from draftwise.bench.datasets import load_prompts
    from draftwise.bench.harness import reference_text

    prompts = load_prompts("spec-bench", split="all")
    texts = [reference_text(p) for p in prompts]
    assert all(t is None or (isinstance(t, str) and t) for t in texts)
    assert any(p.category == "rag" and t and "; " in t for p, t in zip(prompts, texts))  # list references joined
    assert sum(t is not None for t in texts) > 200
