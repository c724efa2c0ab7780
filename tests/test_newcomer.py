"""The README's own examples, as a newcomer types them.

Fast: the first-steps commands on the default target (the README's block after "The default target, when
`--target` is left out") run through a real `draftwise` process (`subprocess`) whose registry names
(`smollm2-135m`, `-eagle`, `-draft`) point at tiny models, and the Python API example runs in-process on the same.
Slow: the same commands on the real default model. (The pair's commands need the pair's files: tests/test_readme.py
parses them with the real parser.)
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from newcomer_models import build, register, run_cli

README = Path(__file__).resolve().parent.parent / "README.md"


def _block(heading: str, language: str) -> str:
    text = README.read_text()
    assert heading in text, f"the README has no {heading!r}"
    section = text.split(heading, 1)[1]
    match = re.search(rf"```{language}\n(.*?)```", section, re.S)
    assert match, f"no {language} block after {heading!r}"
    return match.group(1)


DEFAULT_TARGET = "The default target, when `--target` is left out"
PYTHON_API = "## The Python API"


def first_steps() -> list[list[str]]:
    """The `draftwise ...` command lines of the README's first steps on the default target (comments dropped)."""
    commands = [shlex.split(line, comments=True) for line in _block(DEFAULT_TARGET, "bash").splitlines()]
    commands = [c for c in commands if c]
    assert commands and all(c[0] == "draftwise" for c in commands)
    return [c[1:] for c in commands]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    build(root)
    return root


@pytest.mark.parametrize("argv", first_steps(), ids=lambda argv: " ".join(argv)[:60])
def test_readme_first_steps_run(root, argv):
    proc = run_cli(root, argv)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    if "--json" in argv:
        import json

        assert json.loads(proc.stdout)["stats"]["new_tokens"] > 0
    elif "--version" in argv:
        assert proc.stdout.startswith("draftwise ")


def test_readme_cli_error_is_one_line(root):
    proc = run_cli(root, ["generate", "--temperature", "-1", "Hi"])
    assert proc.returncode == 2
    assert proc.stderr.startswith("draftwise: error:") and proc.stderr.count("\n") == 1, proc.stderr


def test_readme_python_example_runs(root, monkeypatch, capsys):
    register(root, monkeypatch.setitem)
    exec(compile(_block(PYTHON_API, "python"), str(README), "exec"), {})
    assert capsys.readouterr().out.strip()


@pytest.mark.slow
@pytest.mark.parametrize("argv", first_steps(), ids=lambda argv: " ".join(argv)[:60])
def test_readme_first_steps_on_the_real_model(argv):
    proc = subprocess.run([sys.executable, "-m", "draftwise", *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    if argv[-1] == "What is the capital of Germany?" and "--temperature" in argv:
        assert "Berlin" in proc.stdout


@pytest.mark.slow
def test_readme_python_example_on_the_real_model(capsys):
    exec(compile(_block(PYTHON_API, "python"), str(README), "exec"), {})
    assert "Berlin" in capsys.readouterr().out
