"""What the subcommands share: defaults, option help, output checks and writers."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from draftwise.api import generate
from draftwise.errors import DraftwiseError, DraftwiseWarning
from draftwise.methods import METHODS


DEFAULT_TARGET = "smollm2-135m"


API_DEFAULTS = {
    name: p.default for name, p in inspect.signature(generate).parameters.items() if p.default is not inspect.Parameter.empty
}


def method_options() -> dict[str, Any]:
    """Every method option once (name -> Option); options of the same name share meaning."""
    found: dict[str, Any] = {}
    for method in METHODS.values():
        for option in method.options:
            found.setdefault(option.name, option)
    return found


def option_help(name: str) -> str:
    """One flag's help: every method with an option of that name, its meaning and default there."""
    by_help: dict[tuple[str, Any], list[str]] = {}
    for method in METHODS.values():
        for option in method.options:
            if option.name == name:
                by_help.setdefault((option.help, option.default), []).append(method.name)
    return "; ".join(f"{', '.join(methods)}: {text} (default {default})" for (text, default), methods in by_help.items())


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default after its help, unless the help already states one or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default is not None and default is not False and default != argparse.SUPPRESS
                and "default" not in text
                and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            text = f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return text


def json_out(value: Any, path: str) -> None:
    """JSON to standard output ('-') or to a file, written atomically."""
    if path == "-":
        print(json.dumps(value, indent=2))
        return
    from draftwise.atomic import write_json

    write_json(value, path)
    print(f"wrote {path}", file=sys.stderr)


def parse_option_values(pairs: list[str] | None) -> dict[str, dict[str, Any]]:
    """['lossy:alpha=0.2', 'prompt-lookup:max_ngram=4'] -> {'lossy': {'alpha': '0.2'}, ...} (typed by the method)."""
    out: dict[str, dict[str, Any]] = {}
    for pair in pairs or []:
        method, sep, assignment = pair.partition(":")
        name, eq, value = assignment.partition("=")
        if not sep or not eq or not name:
            raise DraftwiseError(f"--option takes METHOD:NAME=VALUE, got {pair!r}")
        spec = METHODS.get(method)
        if spec is None:
            raise DraftwiseError(f"--option {pair!r}: unknown method {method!r}")
        out.setdefault(method, {})[name.replace("-", "_")] = value
    for method, given in out.items():
        out[method] = {k: v for k, v in METHODS[method].resolve_options(given).items() if k in given}
    return out


def warn_if_fewer(found: int, asked: int, dataset: str, categories: Sequence[str]) -> None:
    if found < asked:
        where = f" in {', '.join(categories)}" if categories else ""
        warnings.warn(f"--num-prompts {asked}: {dataset} has only {found} evaluation prompts{where}; running {found}",
                      DraftwiseWarning, stacklevel=2)


def check_output(path: str, flag: str) -> None:
    """An output file's folder is created (as for every output) and must be writable, before any work starts."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise DraftwiseError(f"{flag} {path} is a directory; give a file name")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DraftwiseError(f"{flag} {path}: cannot create the folder {file.parent} ({error.strerror or error})") \
            from None
    if not os.access(file.parent, os.W_OK | os.X_OK) or (file.exists() and not os.access(file, os.W_OK)):
        raise DraftwiseError(f"{flag} {path}: not writable")
    # What the atomic write will do, tried now: a temporary file beside the target (os.access says yes to root
    # even where nothing can be created, /proc or a read-only mount)
    try:
        with tempfile.NamedTemporaryFile(dir=file.parent, prefix=f".{file.name}.", suffix=".check"):
            pass
    except OSError as error:
        raise DraftwiseError(f"{flag} {path}: cannot write in {file.parent} ({error.strerror or error})") from None
    if flag == "--plot":
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        kinds = FigureCanvasAgg.get_supported_filetypes()
        if file.suffix.lstrip(".").lower() not in kinds:
            raise DraftwiseError(f"--plot {path}: unknown image type {file.suffix or '(none)'!r}; use one of "
                                 f"{', '.join('.' + k for k in sorted(kinds))}")


def check_outputs(args: argparse.Namespace) -> None:
    for attr, flag in (("json", "--json"), ("plot", "--plot")):
        value = getattr(args, attr, None)
        if isinstance(value, str) and value != "-":
            check_output(value, flag)
    if args.command in ("train-verifier", "profile-sv"):
        check_output(args.out, "--out")


def plot_safely(draw: Any, args: argparse.Namespace) -> None:
    try:
        draw()
    except Exception as error:  # noqa: BLE001 - the results are saved; the plot alone failed
        saved = f"; the results are in {args.json}" if getattr(args, "json", None) else ""
        raise DraftwiseError(f"--plot {args.plot}: plotting failed ({type(error).__name__}: {error}){saved}") from None
    print(f"wrote {args.plot}")


def floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise DraftwiseError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values:
        raise DraftwiseError(f"{flag} is empty")
    return values
