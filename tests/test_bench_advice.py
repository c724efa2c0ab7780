"""Measured advice: `bench` names the fastest exact method and why (a verification's cost, timed in the run), keeps
it per (target, draft, machine) in the cache, and the default method follows that record, for this machine and
this pair only; a corrupt record is ignored with one line.

Tiny stand-ins under the registry's default names (`newcomer_models`); the records go to a temporary folder.
"""

from __future__ import annotations

import json
import warnings

import pytest

import draftwise
from draftwise import advice_record as record
from draftwise.bench import advice
from draftwise.errors import DraftwiseWarning
from draftwise.cli import main
from newcomer_models import DRAFT, EAGLE, TARGET, build, register

GREEDY = dict(temperature=0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("advice")
    build(root)
    return root


@pytest.fixture
def dirs(root, monkeypatch, tmp_path):
    monkeypatch.setattr(record, "advice_dir", lambda: tmp_path / "advice")
    monkeypatch.setattr(record, "_announced", set())
    monkeypatch.delenv("DRAFTWISE_ADVICE", raising=False)
    return register(root, monkeypatch.setitem)


def _results(speedups: dict[str, float], *, draft=EAGLE, gamma=4, options=None, temperature=0.0) -> dict:
    methods = {label: {"speedup_vs_ar": s, "mean_accepted_length": 1.0 if label == "ar" else 2.5}
               for label, s in speedups.items()}
    drafts = {label: (draft if label.split("/")[0] in ("sd", "hybrid") else None) for label in speedups}
    return {"config": {"target": TARGET, "draft": None, "gamma": gamma, "temperature": temperature,
                       "method_options": options or {}, "drafts": drafts, "prompts": ["1"], "max_new_tokens": 8},
            "methods": methods}


COSTS = {"k": 5, "verify_vs_k1": 1.9, "draft_vs_target": 0.42, "target_k1_ms": 80.0, "target_k_ms": 152.0}


def _record(results: dict, machine: dict | None = None):
    found = advice.advise(results, COSTS, machine or record.machine_signature())
    return advice.write_record(results, found)


# ------------------------------------------------------------------------------------------ the advice line

def test_the_fastest_exact_method_wins_with_why():
    found = advice.advise(_results({"ar": 1.0, "sd": 0.72, "suffix": 1.08, "lossy": 1.5}), COSTS, {"cpu": "x"})
    assert found["method"] == "suffix"  # lossy is faster, but not exact
    line = found["line"]
    assert line.startswith("fastest exact method here: suffix (1.08x ar); sd 0.72x"), line
    assert "lossy" not in line
    assert "a 5-token verification costs 1.90x one token" in line and "a draft token 0.42 of a target token" in line
    # sd's break-even: v + gamma * d = 1.9 + 4 * 0.42 = 3.58 tokens a target call, against the 2.5 it got
    assert "sd breaks even at 3.58 tokens a target call and got 2.50 (the forwards alone predict 0.70x; it ran " \
        "0.72x" in line, line


def test_ar_wins_when_nothing_beats_it_and_a_tie_goes_to_ar():
    assert advice.advise(_results({"ar": 1.0, "sd": 0.72, "suffix": 0.97}), COSTS, {})["method"] == "ar"
    assert advice.advise(_results({"ar": 1.0, "suffix": 1.0}), COSTS, {})["method"] == "ar"
    line = advice.advise(_results({"ar": 1.0, "sd": 0.72, "suffix": 0.97}), COSTS, {})["line"]
    assert line.startswith("fastest exact method here: ar; suffix 0.97x, sd 0.72x:"), line


def test_a_method_that_accepted_nothing_cannot_win_on_noise():
    # measured on the pair while other work shared the 2 cores: suffix drafted nothing that was accepted (1.00
    # token a target call, ar's work) and still read 1.28x ar
    results = _results({"ar": 1.0, "suffix": 1.28, "sd": 0.31})
    results["methods"]["suffix"]["mean_accepted_length"] = 1.0
    found = advice.advise(results, COSTS, {})
    assert found["method"] == "ar"
    assert found["line"].startswith("fastest exact method here: ar; suffix 1.28x (no draft accepted: noise), sd 0.31x")
    results["methods"]["suffix"]["mean_accepted_length"] = 1.2  # the control: accepted drafts, a real win
    assert advice.advise(results, COSTS, {})["method"] == "suffix"


def test_only_runs_the_default_could_repeat_are_candidates():
    # a label with options, a method given --option, or another gamma is not what the default would run
    assert advice.advise(_results({"ar": 1.0, "sd/gamma=3": 1.4, "suffix": 1.1}), COSTS, {})["method"] == "suffix"
    # where nothing but ar is left there is no advice at all (and no record): ar would be "fastest" only by
    # having no rival, and would replace what an earlier run found
    assert advice.advise(_results({"ar": 1.0, "suffix": 1.1}, options={"suffix": {"max_depth": 8}}), COSTS,
                         {}) is None
    assert advice.advise(_results({"ar": 1.0, "suffix": 1.1}, gamma=6), COSTS, {}) is None
    assert advice.advise(_results({"ar": 1.0, "sd": 1.29, "sprinter": 1.42}, gamma=3), COSTS, {}) is None
    assert advice.advise(_results({"sd": 1.1, "suffix": 1.2}), COSTS, {}) is None  # no ar, no ratio


# ------------------------------------------------------------------------------- the default follows a record

def test_a_record_makes_the_default_follow_it(dirs):
    from draftwise.plan import default_method

    ar = draftwise.generate(TARGET, "the cat", method="ar", **GREEDY)
    assert default_method(TARGET, None) == "sd"  # the negative control: no record, today's rule
    path = _record(_results({"ar": 1.0, "sd": 0.8, "prompt-lookup": 1.2}))
    assert path is not None and path.is_file()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        g = draftwise.generate(TARGET, "the cat", **GREEDY)
        again = draftwise.generate(TARGET, "the cat", **GREEDY)
    assert g.stats["method"] == "prompt-lookup" and again.stats["method"] == "prompt-lookup"
    assert g.token_ids == ar.token_ids
    notices = [w for w in seen if issubclass(w.category, record.AdviceNotice)]
    assert len(notices) == 1, [str(w.message) for w in seen]  # said the first time only
    assert "using 'prompt-lookup', the fastest exact method measured on this machine" in str(notices[0].message)
    assert draftwise.generate(TARGET, "the cat", method="sd", **GREEDY).stats["method"] == "sd"  # asked by name


def test_a_record_of_another_machine_or_pair_is_ignored(dirs):
    from draftwise.plan import default_method

    other = {**record.machine_signature(), "cpu": "Another CPU", "flags": ["avx2"]}
    path = _record(_results({"ar": 1.0, "sd": 0.8, "suffix": 1.2}), machine=other)
    assert path.is_file() and default_method(TARGET, None) == "sd"
    fewer = {**record.machine_signature(), "threads": record.machine_signature()["threads"] + 1}
    _record(_results({"ar": 1.0, "sd": 0.8, "suffix": 1.2}), machine=fewer)
    assert default_method(TARGET, None) == "sd"
    # a record of the pair (target, the independent draft) does not speak for (target, the head)
    _record(_results({"ar": 1.0, "sd": 0.8, "suffix": 1.2}, draft=DRAFT))
    assert default_method(TARGET, None) == "sd"
    assert default_method(TARGET, DRAFT) == "suffix"  # that pair, asked with its draft: followed
    # another machine's record copied under this machine's name (a shared cache) is not followed either
    mine = record.record_path({"target": record.model_identity(TARGET), "draft": record.model_identity(EAGLE),
                               "machine": record.machine_signature(), "regime": "greedy"})
    mine.write_text(path.read_text())
    assert default_method(TARGET, None) == "sd"
    # a greedy bench does not decide for sampling
    _record(_results({"ar": 1.0, "sd": 0.8, "suffix": 1.2}))
    assert default_method(TARGET, None) == "suffix" and default_method(TARGET, None, 1.0) == "sd"


def test_a_record_follows_the_weights_not_the_name(dirs, monkeypatch, tmp_path):
    from draftwise.models import registry
    from draftwise.plan import default_method

    _record(_results({"ar": 1.0, "sd": 0.8, "suffix": 1.2}))
    assert default_method(TARGET, None) == "suffix"
    other = tmp_path / "other-target"
    other.mkdir()
    monkeypatch.setitem(registry._ENTRIES, TARGET, registry.RegistryEntry(
        name=TARGET, role="target", description="other weights", resolve=lambda: other, cached=lambda: "ready"))
    assert default_method(TARGET, None) == "sd"


@pytest.mark.parametrize("content, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
])
def test_a_corrupt_record_is_ignored_with_one_line(dirs, content, why):
    from draftwise.plan import default_method

    path = _record(_results({"ar": 1.0, "sd": 0.8, "suffix": 1.2}))
    path.write_text(content)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert default_method(TARGET, None) == "sd"
    lines = [str(w.message) for w in seen if issubclass(w.category, DraftwiseWarning)]
    assert len(lines) == 1 and why in lines[0] and str(path) in lines[0] and "\n" not in lines[0], lines


def test_a_record_naming_an_inexact_or_unknown_method_is_ignored(dirs):
    from draftwise.plan import default_method

    path = _record(_results({"ar": 1.0, "sd": 0.8, "suffix": 1.2}))
    record = json.loads(path.read_text())
    for method, why in (("lossy", "not exact"), ("warp-drive", "not a draftwise method")):
        path.write_text(json.dumps({**record, "method": method}))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert default_method(TARGET, None) == "sd"
        assert any(why in str(w.message) for w in seen), [str(w.message) for w in seen]


def test_cli_generate_follows_the_record_and_a_corrupt_one_is_one_line(dirs, capsys):
    argv = ["generate", "--max-tokens", "6", "--ignore-eos", "the cat"]
    assert main(argv + ["--method", "ar"]) == 0
    ar = capsys.readouterr().out
    path = _record(_results({"ar": 1.0, "sd": 0.8, "suffix": 1.2}))
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out == ar
    assert out.err.startswith("draftwise: using 'suffix', the fastest exact method measured on this machine"), out.err
    assert "warning" not in out.err.splitlines()[0]
    path.write_text("{")
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out == ar and "Traceback" not in out.err
    assert [line for line in out.err.splitlines() if "advice" in line] == \
        [line for line in out.err.splitlines() if line.startswith("draftwise: warning: ignoring the method advice")]
    assert len([line for line in out.err.splitlines() if "advice" in line]) == 1, out.err


def test_advice_off_by_environment(dirs, monkeypatch):
    from draftwise.plan import default_method

    _record(_results({"ar": 1.0, "sd": 0.8, "suffix": 1.2}))
    monkeypatch.setenv("DRAFTWISE_ADVICE", "0")
    assert default_method(TARGET, None) == "sd"


# ------------------------------------------------------------------------------------ bench measures and records

def test_bench_ends_with_the_advice_and_records_it(dirs, capsys, tmp_path):
    from draftwise.plan import default_method

    out_json = tmp_path / "bench.json"
    code = main(["bench", "--methods", "ar,sd,suffix,lossy", "--num-prompts", "2", "--max-new-tokens", "6",
                 "--repeats", "1", "--warmup", "0", "--dtype", "fp32", "--categories", "qa", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    results = json.loads(out_json.read_text())
    found = results["advice"]
    assert found["method"] in ("ar", "sd", "suffix")  # never lossy, whatever its speed
    costs = found["costs"]
    assert costs["k"] == 5 and costs["target_k1_ms"] > 0 and costs["verify_vs_k1"] > 0
    assert "draft_vs_target" not in costs  # sd drafted with the EAGLE head: no draft model forward to time
    lines = out.splitlines()
    advice_line = next(i for i, line in enumerate(lines) if line.startswith("fastest exact method here: "))
    assert f"a 5-token verification costs {costs['verify_vs_k1']:.2f}x one token" in lines[advice_line]
    assert lines[advice_line + 1].startswith("recorded in ")
    assert found["record"] == str(record.record_path({
        "target": record.model_identity(TARGET), "draft": record.model_identity(EAGLE),
        "machine": record.machine_signature(), "regime": "greedy"}))
    assert default_method(TARGET, None) == found["method"]


def test_bench_times_a_draft_model_against_the_target(dirs):
    from draftwise.bench.harness import BenchConfig, run_bench

    results = run_bench(BenchConfig(target=TARGET, draft=DRAFT, methods=("ar", "sd"), num_prompts=1,
                                    max_new_tokens=4, repeats=1, warmup=0, dtype="fp32", categories=("qa",)))
    costs = results["advice"]["costs"]
    assert costs["draft_k1_ms"] > 0 and costs["draft_vs_target"] > 0
    assert "a draft token" in results["advice"]["line"]
    off = run_bench(BenchConfig(target=TARGET, methods=("ar", "suffix"), num_prompts=1, max_new_tokens=4, repeats=1,
                                warmup=0, dtype="fp32", categories=("qa",), advice=False))
    assert "advice" not in off
