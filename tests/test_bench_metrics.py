"""Benchmark arithmetic on hand-computed cases, and the Spec-Bench split."""

from __future__ import annotations

import pytest

from draftwise.bench.datasets import CATEGORIES, expand_categories, load_prompts
from draftwise.bench.metrics import RunRecord, identical_fraction, report, summarize
from draftwise.errors import DraftwiseError


def rec(method, repeat, qid, cat, new, wall, calls, drafted=0, accepted=0, acc_pos=(), dra_pos=(), ids=()):
    return RunRecord(method=method, repeat=repeat, question_id=qid, category=cat, new_tokens=new, wall_time_s=wall,
                     target_calls=calls, drafted=drafted, accepted=accepted, accepted_per_position=list(acc_pos),
                     drafted_per_position=list(dra_pos), token_ids=list(ids))


def test_summarize_hand_computed():
    records = [
        # repeat 0: 30 tokens in 3 s -> 10 tok/s; repeat 1: 30 in 2 s -> 15; repeat 2: 30 in 6 s -> 5
        rec("sd", 0, 1, "qa", 10, 1.0, 4, drafted=12, accepted=6, acc_pos=(3, 2, 1), dra_pos=(4, 4, 4)),
        rec("sd", 0, 2, "qa", 20, 2.0, 6, drafted=18, accepted=14, acc_pos=(6, 5, 3), dra_pos=(6, 6, 6)),
        rec("sd", 1, 1, "qa", 30, 2.0, 10, drafted=30, accepted=20, acc_pos=(10, 6, 4), dra_pos=(10, 10, 10)),
        rec("sd", 2, 1, "qa", 30, 6.0, 10, drafted=30, accepted=20, acc_pos=(10, 6, 4), dra_pos=(10, 10, 10)),
    ]
    m = summarize(records)
    assert m["tokens_per_s_per_repeat"] == [10.0, 15.0, 5.0]
    assert m["tokens_per_s"] == 10.0  # median
    assert m["mean_accepted_length"] == pytest.approx(90 / 30)
    assert m["acceptance_rate"] == pytest.approx(60 / 90)
    assert m["accepted_per_position"] == pytest.approx([29 / 30, 19 / 30, 12 / 30])
    assert m["target_calls_per_token"] == pytest.approx(30 / 90)


def test_report_speedup_against_ar_from_the_same_run():
    records = [
        rec("ar", 0, 1, "qa", 10, 1.0, 10, ids=[1, 2]), rec("ar", 0, 2, "rag", 10, 1.0, 10, ids=[3]),
        rec("sd", 0, 1, "qa", 10, 0.5, 4, drafted=8, accepted=6, ids=[1, 2]),
        rec("sd", 0, 2, "rag", 10, 1.0, 5, drafted=8, accepted=5, ids=[9]),
    ]
    out = report(records, compare_identical=True)
    assert out["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert out["ar"]["mean_accepted_length"] == pytest.approx(1.0)
    assert out["sd"]["tokens_per_s"] == pytest.approx(20 / 1.5)
    assert out["sd"]["speedup_vs_ar"] == pytest.approx((20 / 1.5) / 10)
    assert out["sd"]["per_category"]["qa"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert out["sd"]["per_category"]["rag"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert out["sd"]["identical_to_ar"] == 0.5
    assert identical_fraction(records[2:], records[:2]) == 0.5


def test_eval_and_train_splits_are_disjoint_and_fixed():
    ev, tr = load_prompts(split="eval"), load_prompts(split="train")
    assert len(ev) + len(tr) == 480 and not {p.question_id for p in ev} & {p.question_id for p in tr}
    assert {p.category for p in ev} == set(CATEGORIES)
    assert [p.question_id for p in load_prompts(num_prompts=32)] == [p.question_id for p in load_prompts(num_prompts=32)]


def test_training_prompts_never_include_evaluation_prompts():
    from draftwise.training.data import build_prompts

    eval_texts = {p.text for p in load_prompts(split="eval")}
    prompts = build_prompts(num_fortunes=0)  # fortunes are not Spec-Bench text; the rest is checked here
    assert {p.source for p in prompts} == {"spec-bench", "human-eval"} and len(prompts) == 384 + 164
    assert not eval_texts & {p.text for p in prompts}


def test_german_and_docstring_sources_ask_spec_bench_shaped_tasks_with_stable_ids(tmp_path, monkeypatch):
    from draftwise.training import data

    german = tmp_path / "de"
    german.mkdir()
    (german / "sprueche").write_text("Wer zuletzt lacht, lacht am besten.\n%\nKurz.\n%\nDer Weg ist das Ziel, "
                                     "sagte der Wanderer.\n%\n", encoding="utf-8")
    (german / "sprueche.dat").write_bytes(b"\x00\x01")
    monkeypatch.setattr(data, "GERMAN_FORTUNE_DIR", german)
    package = tmp_path / "pkg"
    (package / "tests").mkdir(parents=True)
    long_doc = " ".join(["Frobnicate the widget."] * 40)
    (package / "mod.py").write_text(f'"""{long_doc}"""\ndef f():\n    """short"""\n'
                                    f'class C:\n    """{long_doc} Again."""\n', encoding="utf-8")
    (package / "tests" / "test_mod.py").write_text(f'"""{long_doc} Test."""\n', encoding="utf-8")
    (package / "broken.py").write_text("def (:\n", encoding="utf-8")
    assert data.read_docstrings([package]) == [long_doc, long_doc + " Again."]  # not tests/, not "short"
    monkeypatch.setattr(data, "read_docstrings", lambda: [long_doc, long_doc + " Again."])
    prompts = [p for p in data.build_prompts(num_fortunes=0, num_german=5, num_docs=5) if p.source in ("german", "docs")]
    by_source = {s: [p for p in prompts if p.source == s] for s in ("german", "docs")}
    assert sorted(p.text for p in by_source["german"]) == [  # "Kurz." is under 20 characters
        "Translate German to English: Der Weg ist das Ziel, sagte der Wanderer.",
        "Translate German to English: Wer zuletzt lacht, lacht am besten."]
    assert {p.category for p in by_source["german"]} == {"translation"}
    assert [p.category for p in by_source["docs"]] == ["summarization", "rag"]
    assert all(long_doc in p.text for p in by_source["docs"])
    again = data.build_prompts(num_fortunes=0, num_german=1, num_docs=1)  # an id names its text, not its rank
    uids = {p.uid: p.text for p in prompts}
    assert all(uids[p.uid] == p.text for p in again if p.source in ("german", "docs"))
    monkeypatch.setattr(data, "GERMAN_FORTUNE_DIR", tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="fortunes-de"):
        data.build_prompts(num_fortunes=0, num_german=1)


def test_round_robin_covers_every_task():
    chosen = load_prompts(num_prompts=12)
    tasks = {"mt_bench" if p.category in expand_categories(["mt_bench"]) else p.category for p in chosen}
    assert tasks == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}


def test_bad_dataset_category_method_give_clear_errors():
    with pytest.raises(DraftwiseError, match="unknown dataset 'nope'.*spec-bench"):
        load_prompts("nope")
    with pytest.raises(DraftwiseError, match="unknown Spec-Bench category 'poetry'.*translation"):
        load_prompts(categories=["poetry"])
    from draftwise.bench.harness import check_methods

    with pytest.raises(DraftwiseError, match="unknown method.*hf-assisted"):
        check_methods(("warp-speed",))


def test_run_bench_end_to_end_on_tiny_models(tmp_path):
    """The harness on tiny saved models: JSON layout, and exact methods identical to ar in fp32."""
    from conftest import save_pair

    from draftwise.bench.harness import BenchConfig, run_bench
    from draftwise.bench.report import format_table, write_json

    save_pair(tmp_path, window=2048)
    config = BenchConfig(
        target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), num_prompts=3, max_new_tokens=8,
        methods=("ar", "sd", "prompt-lookup", "hf-assisted", "prompt-lookup-hf"), repeats=2, dtype="fp32",
        categories=("qa", "translation"),
    )
    results = run_bench(config)
    assert set(results) == {"config", "machine", "energy", "methods", "advice"}
    energy = results["energy"]  # a reading, or why there is none: never an invented number
    assert energy["available"] == all(m["energy_j_per_token"] is not None for m in results["methods"].values())
    assert energy["available"] or energy["reason"]
    assert results["config"]["draft"] == str(tmp_path / "draft")
    for name, m in results["methods"].items():
        assert m["tokens_per_s"] > 0 and len(m["tokens_per_s_per_repeat"]) == 2
        assert set(m["per_category"]) == {"qa", "translation"}
        assert m["identical_to_ar"] == 1.0, name  # fp32, temperature 0: every exact method reproduces ar
    assert results["methods"]["ar"]["mean_accepted_length"] == 1.0
    assert results["methods"]["sd"]["draft_calls_per_token"] > 0
    write_json(results, tmp_path / "out" / "bench.json")
    assert "prompt-lookup-hf" in format_table(results)


def test_hf_assisted_drafts_exactly_gamma_tokens_per_step(tmp_path):
    """The external reference must run at the same gamma: transformers reads it from the assistant's config."""
    from conftest import tiny_llama

    import draftwise
    from draftwise.bench.harness import BenchConfig, _hf_run

    target = draftwise.load_model(tiny_llama(0, layers=2))
    draft = draftwise.load_model(tiny_llama(0, layers=2))  # drafting for itself: every draft token is accepted
    config = BenchConfig(target="t", gamma=3, max_new_tokens=12, temperature=0.0)
    out = _hf_run("hf-assisted", target, draft, [1, 2, 3, 4], config, 0)
    assert out["new_tokens"] == 12
    # 12 tokens at 4 per step (3 accepted + 1 bonus) = 3 target calls, 3 draft calls each.
    assert out["target_calls"] == 3 and out["draft_calls"] == 9


def test_a_label_sets_its_own_gamma():
    """`sd/gamma=2` drafts 2 tokens a step in a run whose --gamma is 3; a method that drafts no gamma tokens, or a
    gamma out of range, is refused by name."""
    from conftest import tiny_llama

    import draftwise
    from draftwise.bench.harness import BenchConfig, _draftwise_run
    from draftwise.bench.labels import parse_label, run_options

    assert parse_label("sd/gamma=2") == ("sd", {"gamma": 2})
    assert run_options("sd/gamma=2", {"sd": {"tree_nodes": 0}}, 3) == ("sd", {"gamma": 2, "tree_nodes": 0})
    assert run_options("sd", {}, 3) == ("sd", {"gamma": 3})
    for bad, match in [("ar/gamma=2", "does not draft gamma tokens"), ("mtjd/gamma=2", r"draft length is /k=N"),
                       ("sd/gamma=x", "not a whole number"), ("sd/gamma=0", "gamma must be 1..32"),
                       ("sd/gamma=2/gamma=3", "given twice")]:
        with pytest.raises(DraftwiseError, match=match):
            parse_label(bad)
    target = draftwise.load_model(tiny_llama(0, layers=2))
    draft = draftwise.load_model(tiny_llama(0, layers=2))  # drafting for itself: every draft token is accepted
    config = BenchConfig(target="t", gamma=3, max_new_tokens=12, temperature=0.0)
    for label, per_step in (("sd", 4), ("sd/gamma=2", 3)):
        out = _draftwise_run(label, target, draft, [1, 2, 3, 4], config, 0)
        assert out["new_tokens"] == 12 and out["target_calls"] == 12 // per_step, label
        assert len(out["drafted_per_position"]) >= per_step - 1 and sum(out["drafted_per_position"][per_step - 1:]) == 0


def test_a_prompt_mix_written_here_is_answered_elsewhere_in_its_order(tmp_path, capsys):
    """train-data --write-prompts then --prompts: the answers are to exactly the file's prompts (filtered by
    --sources, cut by --limit, in the file's order), and a damaged file is a one-line error naming its line."""
    from newcomer_models import build

    from draftwise.cli import main
    from draftwise.training.answers import read_answers
    from draftwise.training.data import TrainPrompt, read_prompt_mix, write_prompt_mix

    build(tmp_path)  # a tiny chat target: train-data asks the target as a chat model
    mix = [TrainPrompt(f"u{i}", "docs" if i % 2 else "magpie", "qa", f"question {i}?") for i in range(6)]
    write_prompt_mix(tmp_path / "mix.jsonl", mix)
    assert read_prompt_mix(tmp_path / "mix.jsonl") == mix
    out = tmp_path / "answers"
    args = ["train-data", "--target", str(tmp_path / "target"), "--answers", "--out", str(out), "--dtype", "fp32",
            "--prompts", str(tmp_path / "mix.jsonl"), "--max-new-tokens", "3", "--batch-size", "2"]
    assert main(args + ["--sources", "docs", "--limit", "2"]) == 0
    assert sorted(a.uid for a in read_answers(out)) == ["u1", "u3"]  # --sources filters, then --limit cuts: the first two docs prompts
    assert main(args) == 0  # the rest; finished uids are skipped
    assert sorted(a.uid for a in read_answers(out)) == [f"u{i}" for i in range(6)]
    assert main(["train-data", "--target", str(tmp_path / "target"), "--out", str(tmp_path / "again.jsonl"),
                 "--dtype", "fp32", "--prompts", str(tmp_path / "mix.jsonl"), "--limit", "3",
                 "--write-prompts", str(tmp_path / "cut.jsonl")]) == 0
    assert read_prompt_mix(tmp_path / "cut.jsonl") == mix[:3]
    (tmp_path / "bad.jsonl").write_text('{"uid": "a", "source": "docs", "category": "qa", "text": "x"}\n{"uid": 1}\n')
    capsys.readouterr()
    assert main(args[:-6] + ["--prompts", str(tmp_path / "bad.jsonl")]) != 0
    err = capsys.readouterr().err.strip()
    assert "bad.jsonl, line 2: not a prompt record" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert main(args[:-6] + ["--prompts", str(tmp_path / "missing.jsonl")]) != 0
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(args + ["--keep-answers", str(tmp_path / "kept")]) != 0  # kept answers are a --features run's
    err = capsys.readouterr().err.strip()
    assert "--keep-answers" in err and "--features" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "kept").exists()


def test_interleaved_timing_runs_cases_round_by_round_after_untimed_warmup():
    from draftwise.bench.timing import interleaved, medians

    calls: list[str] = []
    seconds = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=2,
                          after=lambda name: calls.append(f"after-{name}"))
    assert calls == ["a", "after-a", "b", "after-b"] * 5
    assert [len(v) for v in seconds.values()] == [3, 3] and all(t >= 0 for v in seconds.values() for t in v)
    assert set(medians(seconds)) == {"a", "b"}
    with pytest.raises(ValueError):
        interleaved({"a": lambda: None}, rounds=0)


def test_once_calls_each_case_once_in_order_and_keeps_its_result():
    from draftwise.bench.timing import once

    calls = []
    runs = once({"b": lambda: calls.append("b") or 2, "a": lambda: calls.append("a") or 1})
    assert calls == ["b", "a"] and list(runs) == ["b", "a"]
    assert [result for _, result in runs.values()] == [2, 1]
    assert all(seconds >= 0 for seconds, _ in runs.values())


def test_the_scripts_speculation_summary_reports_what_summarize_reports():
    """bench.scripts.speculation (tune_head, output_vocab) and metrics.summarize define mean accepted length the same
    way: new tokens over target calls. A SPRINTER-like run (steps without a target call) tells the two definitions
    apart: (accepted + steps) / steps would give 2.5 here, against 10 / 5 = 2.0."""
    from draftwise.bench import scripts

    stats = [dict(steps=4, accepted=6, drafted=8, target_calls=3, new_tokens=6, accepted_per_position=[3, 2],
                  drafted_per_position=[4, 4]),
             dict(steps=0, accepted=0, drafted=0, target_calls=2, new_tokens=4, accepted_per_position=[],
                  drafted_per_position=[])]
    records = [RunRecord(method="m", repeat=0, question_id=i, category="c", new_tokens=s["new_tokens"], wall_time_s=1.0,
                         target_calls=s["target_calls"], drafted=s["drafted"], accepted=s["accepted"])
               for i, s in enumerate(stats)]
    ours, theirs = scripts.speculation(stats), summarize(records)
    assert ours["mean_accepted_length"] == theirs["mean_accepted_length"] == 2.0
    assert ours["target_calls_per_token"] == theirs["target_calls_per_token"]
    assert ours["acceptance_rate"] == theirs["acceptance_rate"]
