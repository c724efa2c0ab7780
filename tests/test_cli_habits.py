"""The command line's habits from the ecosystem: suggestions for typos, `--max-tokens`, `serve MODEL`, defaults in
every --help, quiet broken pipes and errors worded as flags."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from draftwise.cli import as_flags, build_parser, main


def _exit_message(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1  # one line
    return err


def test_an_unknown_flag_gets_the_closest_flag_of_its_subcommand(capsys):
    err = _exit_message(capsys, ["generate", "--max-tokns", "3", "hi"])
    assert err.startswith("draftwise generate: error: unrecognized arguments: --max-tokns")
    assert "did you mean '--max-tokens'?" in err
    err = _exit_message(capsys, ["bench", "--tempreature", "0"])
    assert "did you mean '--temperature'?" in err
    # nothing close: no suggestion, only the flag
    err = _exit_message(capsys, ["generate", "--zzzzzz", "hi"])
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_a_mistyped_subcommand_or_choice_gets_the_closest(capsys):
    assert "invalid choice: 'genrate' (did you mean 'generate'?)" in _exit_message(capsys, ["genrate", "hi"])
    assert "invalid choice: 'sdd' (did you mean 'sd'?)" in _exit_message(capsys, ["generate", "--method", "sdd", "x"])


def test_a_mistyped_model_name_gets_the_closest_registry_name(capsys):
    for argv in (["generate", "--method", "ar", "--target", "smollm2-13m", "hi"],  # what loading says
                 ["generate", "--method", "sd", "--target", "smollm2-13m", "hi"],  # asked before the draft
                 ["serve", "smollm2-13m", "--port", "0"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "did you mean 'smollm2-135m'?" in err and "Traceback" not in err, argv
    # a hub id without an owner that is nowhere near a registry name gets no suggestion from the registry
    from draftwise.errors import did_you_mean

    assert did_you_mean("gpt2", ["smollm2-135m", "qwen2.5-coder-1.5b"]) == ""


def test_max_tokens_is_an_alias_of_max_new_tokens():
    parser = build_parser()
    assert parser.parse_args(["generate", "--max-tokens", "5", "x"]).max_new_tokens == 5
    assert parser.parse_args(["bench", "--max-tokens", "7"]).max_new_tokens == 7
    assert parser.parse_args(["generate", "--max-new-tokens", "9", "x"]).max_new_tokens == 9


def test_serve_takes_the_model_as_a_positional_as_vllm_does(capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "./model.gguf", "--port", "0"])
    assert args.model == "./model.gguf" and args.target is None
    assert parser.parse_args(["serve"]).model is None
    # both, naming different models: one line, before any weight loads
    assert main(["serve", "smollm2-135m", "--target", "qwen2.5-coder-1.5b"]) == 2
    assert "MODEL 'smollm2-135m' and --target 'qwen2.5-coder-1.5b' name two targets" in capsys.readouterr().err
    # the positional is the target: a missing file is reported as the target
    assert main(["serve", "./no-such-model.gguf", "--port", "0"]) == 2
    assert "'./no-such-model.gguf' not found" in capsys.readouterr().err


def test_every_help_shows_every_default():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if not action.option_strings or any(action.default is none for none in (None, False, argparse.SUPPRESS)):
                continue
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            help_text = sub._get_formatter()._expand_help(action) if action.help else ""
            assert "default" in help_text, (name, action.option_strings)
        assert "--help" in text
    bench = " ".join(subparsers.choices["bench"].format_help().split())
    assert "--num-prompts NUM_PROMPTS default:" in bench and "--temperature TEMPERATURE default: 0.0" in bench


def test_a_closed_pipe_ends_quietly():
    """`draftwise methods | head -1`: the reader leaves; no BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    code = "import sys; from draftwise.cli import main; sys.exit(main(['methods']))"
    proc = subprocess.run([sys.executable, "-c", code], stdout=write, stderr=subprocess.PIPE, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stderr == "" and proc.returncode == 141


def test_api_words_become_flags_on_the_command_line():
    generate = argparse.Namespace(command="generate")
    message = ("method 'sd' needs a draft model and the registry has none: pass draft=... (--draft), or use "
               "method='ar' or 'prompt-lookup', which need none")
    assert as_flags(message, generate) == ("method 'sd' needs a draft model and the registry has none: pass "
                                           "--draft DRAFT, or use --method ar or 'prompt-lookup', which need none")
    assert as_flags("max_new_tokens must be an integer >= 1, got 0", generate) == \
        "--max-new-tokens must be an integer >= 1, got 0"
    assert as_flags("pass temperature=0", generate) == "pass --temperature 0"
    # names that are no flag of the command, and paths, stay as they are
    assert as_flags("kv_budget_mb must be > 0 in /tmp/my_model", generate) == "kv_budget_mb must be > 0 in /tmp/my_model"


def test_the_command_line_reports_an_api_error_in_flags(capsys):
    assert main(["generate", "--max-tokens", "0", "hi"]) == 2
    assert capsys.readouterr().err.strip() == "draftwise: error: --max-new-tokens must be an integer >= 1, got 0"


def test_methods_are_grouped_by_need_one_line_each(capsys):
    import draftwise
    from draftwise.cli.generate import method_groups

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    groups = method_groups()
    assert sorted(sum(groups.values(), [])) == sorted(draftwise.METHODS)  # every method, once
    first = {name: need for need, names in groups.items() for name in names}
    needs = list(groups)
    assert first["ar"] == first["suffix"] == first["prompt-lookup"] == needs[0]
    assert first["sd"] == first["mtad"] == needs[1]
    assert first["seq-cascade"] == needs[2]
    assert first["sprinter"] == first["sv"] == first["specdec++"] == needs[3]
    for need, names in groups.items():
        block = out.split(need, 1)[1].split("\n\n", 1)[0].strip().splitlines()
        assert [line.split()[0] for line in block] == names
        for line, name in zip(block, names):
            assert draftwise.METHODS[name].summary in line
    assert "--alpha" not in out  # the options are one flag away
    assert main(["methods", "--options"]) == 0 and "--alpha (default" in capsys.readouterr().out


def test_a_mistyped_method_gets_the_closest_in_the_api_and_the_bench(capsys):
    import draftwise
    from draftwise.errors import DraftwiseError

    with pytest.raises(DraftwiseError, match=r"unknown method 'prompt-lokup' \(did you mean 'prompt-lookup'\?\)"):
        draftwise.generate("smollm2-135m", "hi", method="prompt-lokup")
    assert main(["bench", "--methods", "ar,sufix"]) == 2
    assert "unknown method(s) sufix (did you mean 'suffix'?)" in capsys.readouterr().err
