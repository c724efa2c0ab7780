"""`draftwise` command line: one subcommand per job; flags map one to one onto API keywords."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from typing import Any, Sequence

from .api import check_options, generate, stream
from .errors import DraftwiseError
from .methods import METHODS
from .models.loading import load_model

_API_DEFAULTS = {
    name: p.default for name, p in inspect.signature(generate).parameters.items() if p.default is not inspect.Parameter.empty
}


def _method_options() -> dict[str, Any]:
    """Every method option once (name -> Option); options of the same name share meaning."""
    found: dict[str, Any] = {}
    for method in METHODS.values():
        for option in method.options:
            found.setdefault(option.name, option)
    return found


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode one prompt and print the text (or --json)")
    p.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    p.add_argument("--target", required=True, help="registry name, local directory, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft model, same forms as --target")
    p.add_argument("--method", default=_API_DEFAULTS["method"], choices=list(METHODS), help="decoding method")
    p.add_argument("--max-new-tokens", type=int, default=_API_DEFAULTS["max_new_tokens"])
    p.add_argument("--temperature", type=float, default=_API_DEFAULTS["temperature"], help="0 means greedy")
    p.add_argument("--top-k", type=int, default=_API_DEFAULTS["top_k"], help="0 turns it off")
    p.add_argument("--top-p", type=float, default=_API_DEFAULTS["top_p"], help="1 turns it off")
    p.add_argument("--seed", type=int, default=_API_DEFAULTS["seed"])
    p.add_argument("--gamma", type=int, default=_API_DEFAULTS["gamma"], help="draft tokens per step")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep decoding past end-of-sequence tokens")
    for option in _method_options().values():
        methods = ", ".join(m.name for m in METHODS.values() if option in m.options)
        p.add_argument(
            f"--{option.name.replace('_', '-')}", type=option.type, default=None,
            help=f"{option.help} (methods: {methods}; default {option.default})",
        )
    p.add_argument("--device", default=None, help="cpu (default), cuda, or auto")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: fp32 on CPU)")
    p.add_argument("--json", action="store_true", help="print the Generation (text, token ids, stats) as JSON")


def _run_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options = {name: getattr(args, name) for name in _method_options() if getattr(args, name) is not None}
    kwargs = dict(
        method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, gamma=args.gamma, stop=args.stop, ignore_eos=args.ignore_eos, **options,
    )
    # Cheap checks first (method, options, sampling values) so bad flags fail before loading weights.
    check_options(draft_given=args.draft is not None, **kwargs)
    target = load_model(args.target, device=args.device, dtype=args.dtype)
    draft = load_model(args.draft, device=args.device, dtype=args.dtype) if args.draft else None
    if args.json:
        result = generate(target, prompt, draft=draft, **kwargs)
        print(json.dumps(result.to_dict(), indent=2))
    else:
        for piece in stream(target, prompt, draft=draft, **kwargs):
            print(piece, end="", flush=True)
        print()
    return 0


def _run_methods(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({
            m.name: {
                "summary": m.summary, "drafter": m.drafter, "exact": m.exact, "uses_gamma": m.uses_gamma,
                "greedy_only": m.greedy_only, "reference": m.reference,
                "options": {o.name: {"default": o.default, "type": o.type.__name__, "help": o.help} for o in m.options},
            }
            for m in METHODS.values()
        }, indent=2))
        return 0
    common = ", ".join(f"{k}={v}" for k, v in _API_DEFAULTS.items() if k not in ("draft", "method"))
    print(f"common options (all methods): {common}\n")
    for m in METHODS.values():
        kind = "exact" if m.exact else "lossy"
        needs = {"model": "needs --draft", "ngram": "no draft model", "none": "target only"}[m.drafter]
        print(f"{m.name:<14} {kind}, {needs}{', temperature 0 only' if m.greedy_only else ''}")
        print(f"{'':<14} {m.summary}")
        for o in m.options:
            print(f"{'':<14}   --{o.name.replace('_', '-')} (default {o.default}): {o.help}")
        if m.reference:
            print(f"{'':<14} ref: {m.reference}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftwise", description="Faster LLM decoding with draft models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    methods = sub.add_parser("methods", help="list the methods, their options and defaults")
    methods.add_argument("--json", action="store_true")
    return parser


_COMMANDS = {"generate": _run_generate, "methods": _run_methods}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would interleave with the output
    try:
        return _COMMANDS[args.command](args)
    except DraftwiseError as error:
        print(f"draftwise: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
