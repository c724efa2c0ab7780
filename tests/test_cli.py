"""The command line, through `draftwise.cli.main([...])` (and once as a real subprocess)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

import draftwise
from conftest import save_pair
from draftwise.cli import main




@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny target and a tiny draft saved as Hugging Face directories (with the tiny tokenizer)."""
    target, draft = save_pair(tmp_path_factory.mktemp("models"))
    return {"target": target, "draft": draft}


def _run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------- methods

def test_methods_lists_every_method_and_option(capsys):
    code, out, err = _run(capsys, ["methods", "--options"])
    assert code == 0 and err == ""
    for method in draftwise.METHODS.values():
        assert method.name in out
        assert method.summary in out
        for option in method.options:
            assert f"--{option.name.replace('_', '-')} (default {option.default})" in out
    # the common options with their defaults (from the API signature)
    assert "gamma=4" in out and "temperature=0.0" in out and "max_new_tokens=128" in out


def test_methods_json(capsys):
    code, out, _ = _run(capsys, ["methods", "--json"])
    assert code == 0
    data = json.loads(out)
    assert set(data) == set(draftwise.METHODS)
    for name, method in draftwise.METHODS.items():
        entry = data[name]
        assert entry["exact"] == method.exact
        assert entry["greedy_only"] == method.greedy_only
        assert entry["drafter"] == method.drafter
        assert {k: v["default"] for k, v in entry["options"].items()} == {o.name: o.default for o in method.options}


# ---------------------------------------------------------------- generate

@pytest.mark.parametrize("ignore_eos", [False, True])
def test_generate_prints_text(capsys, model_dirs, ignore_eos):
    argv = ["generate", "--target", model_dirs["target"], "--method", "ar", "--temperature", "0",
            "--max-new-tokens", "5", *(["--ignore-eos"] if ignore_eos else []), "the cat"]
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    expected = draftwise.generate(
        model_dirs["target"], "the cat", method="ar", temperature=0, max_new_tokens=5, ignore_eos=ignore_eos
    )
    if ignore_eos:
        assert expected.text
    assert out == expected.text + "\n"


def test_generate_json(capsys, model_dirs):
    argv = ["generate", "--target", model_dirs["target"], "--method", "ar", "--temperature", "0",
            "--max-new-tokens", "5", "--json", "-", "the cat"]
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    data = json.loads(out)
    assert {"text", "token_ids", "stats"} <= set(data)
    assert isinstance(data["text"], str)
    assert 1 <= len(data["token_ids"]) <= 5
    assert data["stats"]["new_tokens"] == len(data["token_ids"])
    assert data["stats"]["method"] == "ar"
    assert data["rates"]["mean_accepted_length"] == 1.0


def test_generate_sd_with_draft(capsys, model_dirs):
    argv = ["generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--method", "sd",
            "--gamma", "3", "--temperature", "0", "--max-new-tokens", "8", "--ignore-eos", "--json", "-", "the cat"]
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    data = json.loads(out)
    assert data["stats"]["method"] == "sd"
    assert len(data["token_ids"]) == 8
    assert len(data["stats"]["accepted_per_position"]) == 3
    assert data["stats"]["draft_calls"] > 0
    greedy = draftwise.generate(
        model_dirs["target"], "the cat", method="ar", temperature=0, max_new_tokens=8, ignore_eos=True
    )
    assert data["token_ids"] == greedy.token_ids  # exact at temperature 0


def test_generate_sampling_flags_and_seed(capsys, model_dirs):
    argv = ["generate", "--target", model_dirs["target"], "--method", "prompt-lookup", "--max-ngram", "2",
            "--temperature", "0.8", "--top-k", "10", "--top-p", "0.9", "--seed", "7", "--max-new-tokens", "6",
            "--ignore-eos", "--json", "-", "the cat sat on the mat"]
    first = _run(capsys, argv)
    second = _run(capsys, argv)
    assert first[0] == second[0] == 0
    a, b = json.loads(first[1]), json.loads(second[1])
    assert a["token_ids"] == b["token_ids"]
    assert a["stats"]["seed"] == 7
    expected = draftwise.generate(
        model_dirs["target"], "the cat sat on the mat", method="prompt-lookup", max_ngram=2, temperature=0.8,
        top_k=10, top_p=0.9, seed=7, max_new_tokens=6, ignore_eos=True,
    )
    assert a["token_ids"] == expected.token_ids


def test_generate_prompt_from_stdin(capsys, monkeypatch, model_dirs):
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat"))
    argv = ["generate", "--target", model_dirs["target"], "--method", "ar", "--temperature", "0",
            "--max-new-tokens", "5", "--ignore-eos", "-", "--json"]
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    data = json.loads(out)
    expected = draftwise.generate(
        model_dirs["target"], "the cat", method="ar", temperature=0, max_new_tokens=5, ignore_eos=True
    )
    assert data["token_ids"] == expected.token_ids
    assert data["stats"]["prompt_tokens"] == len(draftwise.load_model(model_dirs["target"]).tokenizer("the cat")["input_ids"])


def test_generate_stop_flag(capsys, model_dirs):
    base = ["generate", "--target", model_dirs["target"], "--method", "ar", "--temperature", "0",
            "--max-new-tokens", "20", "--ignore-eos", "--json", "-"]
    # the tiny model's text depends on the CPU's arithmetic: take the first prompt whose text has a usable stop
    for prompt in ["the cat", "the mat", "a dog", "on the", "sat cat", "the dog sat"]:
        code, out, _ = _run(capsys, base + [prompt])
        full = json.loads(out)["text"]
        stop = next((full[i : i + 2] for i in range(2, len(full) - 1)
                     if "\ufffd" not in full[i : i + 2] and full[i : i + 2].strip() == full[i : i + 2]
                     and "\x00" not in full[i : i + 2] and full.find(full[i : i + 2]) == i), None)
        if stop is not None:
            break
    else:
        raise AssertionError("no prompt gave a text with a usable stop string")
    code, out, err = _run(capsys, base + ["--stop", "zzzz", "--stop", stop, prompt])
    assert code == 0, err
    data = json.loads(out)
    assert data["text"] == full[: full.find(stop)]
    assert data["stats"]["finish_reason"] == "stop"


# ---------------------------------------------------------------- bad flags

@pytest.mark.parametrize("flags, message", [
    (["--method", "ar", "--top-p", "1.5"], "--top-p"),
    (["--method", "ar", "--top-p", "0"], "--top-p"),
    (["--method", "ar", "--temperature", "-1"], "temperature"),
    (["--method", "ar", "--temperature", "nan"], "temperature"),
    (["--method", "sd", "--draft", "DRAFT", "--alpha", "0.2"], "no option 'alpha'"),
    (["--method", "ar", "--max-ngram", "2"], "no option 'max_ngram'"),
    (["--method", "sd", "--draft", "DRAFT", "--gamma", "0"], "gamma"),
    (["--method", "lossy-greedy", "--draft", "DRAFT", "--temperature", "1"], "greedy decoding only"),
    (["--method", "lossy", "--draft", "DRAFT", "--alpha", "1.0"], "alpha"),
    (["--method", "ar", "--max-new-tokens", "0"], "--max-new-tokens"),
], ids=[
    "top-p=1.5", "top-p=0", "temperature=-1", "temperature=nan", "alpha-on-sd", "max-ngram-on-ar", "gamma=0",
    "lossy-greedy-at-t1", "lossy-alpha=1", "max-new-tokens=0",
])
def test_bad_flags_exit_2_before_loading(capsys, model_dirs, tmp_path, flags, message):
    # the target does not even exist: the flag check must come first and name the flag's problem
    missing = str(tmp_path / "missing-model")
    flags = [model_dirs["draft"] if f == "DRAFT" else f for f in flags]
    code, out, err = _run(capsys, ["generate", "--target", missing, *flags, "the cat"])
    assert code == 2
    assert out == ""
    assert err.startswith("draftwise: error:")
    assert message in err
    assert "missing-model" not in err


def test_sd_without_a_draft_names_the_draft_and_a_missing_target_names_the_target(capsys, model_dirs, tmp_path):
    code, out, err = _run(capsys, ["generate", "--target", model_dirs["target"], "--method", "sd", "the cat"])
    assert code == 2 and "needs a draft model" in err
    code, out, err = _run(capsys, ["generate", "--target", str(tmp_path / "missing-model"), "--method", "sd", "the cat"])
    assert code == 2 and "not found" in err and "needs a draft" not in err


def test_missing_model_exit_2(capsys, tmp_path):
    code, out, err = _run(capsys, ["generate", "--target", str(tmp_path / "nope"), "--method", "ar", "the cat"])
    assert code == 2
    assert "draftwise: error:" in err and "nope" in err


def test_empty_prompt_exit_2(capsys, model_dirs):
    code, _, err = _run(capsys, ["generate", "--target", model_dirs["target"], "--method", "ar", ""])
    assert code == 2
    assert "prompt is empty" in err


@pytest.mark.parametrize("argv", [
    ["generate", "--target", "x", "--method", "nope", "the cat"],  # argparse choices
    ["generate", "--target", "x", "--gamma", "two", "the cat"],  # argparse type
    ["frobnicate"],  # unknown subcommand
    [],  # a subcommand is required
])
def test_argparse_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_console_entry_point_runs():
    """`python -m draftwise methods` in a fresh process; the `draftwise` script is the same `main`."""
    proc = subprocess.run(
        [sys.executable, "-m", "draftwise", "methods"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for name in draftwise.METHODS:
        assert name in proc.stdout
    # the installed console script points at the same function (checked without a second slow start-up)
    scripts = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name == "draftwise"}
    if scripts:
        assert scripts["draftwise"].load() is main


def test_bench_rejects_unknown_method_category_and_dataset(capsys):
    from draftwise.cli import main

    for argv, expected in (
        (["--methods", "ar,warp"], "unknown method"),
        (["--categories", "poetry"], "unknown Spec-Bench category"),
        (["--dataset", "mmlu"], "unknown dataset"),
        (["--option", "lossy:alpha"], "METHOD:NAME=VALUE"),
        (["--option", "lossy:gamma=3"], "has no option 'gamma'"),
    ):
        assert main(["bench", "--target", "/nonexistent", *argv]) == 2
        assert expected in capsys.readouterr().err


def test_models_lists_the_registry(capsys, tmp_path, monkeypatch):
    from draftwise.cli import main

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m " in out and "smollm2-135m-eagle" in out and str(tmp_path) in out
    # the shipped verifiers and stop heads, with the method and sampling setting each serves
    assert "smollm2-135m-draft-sprinter-t1 verifier   ready" in out
    assert "--method specdec++ for smollm2-135m with smollm2-135m-draft at temperature 0" in out


def test_an_interrupted_command_ends_with_one_line_and_exit_130(capsys, monkeypatch):
    import draftwise.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt  # what Ctrl-C, or train-data's SIGTERM handler, raises inside a command

    monkeypatch.setitem(cli._COMMANDS, "methods", interrupted)
    assert main(["methods"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "draftwise: interrupted" and "Traceback" not in err
