"""The README a newcomer reads: short, free of the project's bookkeeping, and every command in it parses as the
command line and the API understand it; the commands that run on the default model (SmolLM2, the tests' own) run as
written."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _commands(text: str) -> list[list[str]]:
    """Each shell command of the bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in _blocks(text, "bash"):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if words:
                out.append(words)
    return out


def test_the_readme_is_short_and_free_of_bookkeeping():
    assert len(README.splitlines()) <= 300
    for page, text in [("README.md", README)] + [(p.name, p.read_text(encoding="utf-8")) for p in DOCS]:
        for pattern in (r"\bissues? \d+", r"\(issue", r"this stop", r"\ba miss\b", r"stops ago", r"this session"):
            assert not re.search(pattern, text, flags=re.I), (page, pattern)


def test_the_readme_installs_with_the_venv_activated():
    commands = [" ".join(c) for c in _commands(README)]
    assert commands[:2] == ["make install", "source .venv/bin/activate"]


def test_every_draftwise_command_in_the_readme_parses():
    from draftwise.cli import build_parser

    parser = build_parser()
    commands = [c[1:] for c in _commands(README) if c[0] == "draftwise"]
    assert len(commands) >= 8
    for argv in commands:
        args = parser.parse_args([str(Path(a).expanduser()) if a.startswith("~") else a for a in argv])
        assert args.command, argv


def _fast_commands() -> list[list[str]]:
    """The README's `draftwise models` and `draftwise generate` lines on the default model: no --target (the pair
    is a 1.6 GB download and minutes of decoding), so a test can run them as a user types them."""
    return [c for c in _commands(README) if c[0] == "draftwise" and c[1] in ("models", "generate") and "--target" not in c]


def test_the_readme_has_fast_commands_to_run():
    assert len(_fast_commands()) >= 3, _fast_commands()


@pytest.mark.parametrize("argv", _fast_commands(), ids=" ".join)
def test_the_fast_readme_commands_run_as_written(argv):
    env = dict(os.environ, DRAFTWISE_PROGRESS="0", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "draftwise", *argv[1:]], capture_output=True, text=True,
                          timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    if "capital of Germany" in " ".join(argv):  # the first answer a newcomer sees is right (T=0 by default)
        assert "Berlin" in done.stdout, done.stdout


def test_every_make_target_in_the_readme_exists():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for command in _commands(README):
        if command[0] == "make":
            assert re.search(rf"^{re.escape(command[1])}:", makefile, flags=re.M), command


def test_every_model_name_in_the_readme_is_a_registry_name():
    from draftwise.models import registry

    for command in _commands(README):
        for flag, value in zip(command, command[1:]):
            if flag in ("--target", "--draft") and not value.startswith(("~", ".", "/")):
                assert value in registry.names(), (flag, value)
        if command[:2] == ["draftwise", "serve"]:
            assert command[2] in registry.names()


def test_the_python_blocks_compile_and_name_what_exists():
    import importlib

    blocks = _blocks(README, "python")
    assert blocks
    for block in blocks:
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("draftwise"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), (node.module, alias.name)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "draftwise":
                import draftwise

                assert hasattr(draftwise, node.attr), node.attr


def test_links_to_docs_resolve():
    for page, text in [(ROOT / "README.md", README)] + [(p, p.read_text(encoding="utf-8")) for p in DOCS]:
        for target in re.findall(r"\]\(((?:docs/)?[\w-]+\.md)(?:#[\w-]+)?\)", text):
            assert (page.parent / target).exists(), (page.name, target)


@pytest.mark.parametrize("name", ["models-and-formats.md", "serving.md", "methods.md", "training.md", "results.md",
                                  "usage.md", "architecture.md"])
def test_the_docs_pages_exist(name):
    assert (ROOT / "docs" / name).exists()
