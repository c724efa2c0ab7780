"""`draftwise` command line: one subcommand per job; flags map one to one onto API keywords."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from .api import check_options, default_draft, generate, stream
from .errors import DraftwiseError, DraftwiseWarning
from .methods import METHODS
from .models.loading import DTYPE_HELP, LoadedModel, load_draft, load_model
from .sampling import SamplingConfig

DEFAULT_TARGET = "smollm2-135m"

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


def _option_help(name: str) -> str:
    """One flag's help: every method with an option of that name, its meaning and default there."""
    by_help: dict[tuple[str, Any], list[str]] = {}
    for method in METHODS.values():
        for option in method.options:
            if option.name == name:
                by_help.setdefault((option.help, option.default), []).append(method.name)
    return "; ".join(f"{', '.join(methods)}: {text} (default {default})" for (text, default), methods in by_help.items())


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default after its help, unless the help already states one or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default is not None and default is not False and default != argparse.SUPPRESS
                and "default" not in text
                and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            text = f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return text


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode prompts and print the text (or --json)")
    p.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help="prompt text ('-' reads standard input); several prompts are decoded as a batch")
    p.add_argument("--prompts-file", default=None, metavar="PATH",
                   help="more prompts: one per line, or a .jsonl file whose lines hold a 'prompt' string, "
                   "'turns' (the first one is used, as in Spec-Bench) or OpenAI-style 'messages'")
    p.add_argument("--max-batch-size", type=int, default=_API_DEFAULTS.get("max_batch_size"),
                   help="at most this many prompts decode together")
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, local directory, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft model or EAGLE head, same forms as --target (default: the "
                   "registry's best draft for the method when the target is a registry model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id, when the target has none")
    p.add_argument("--no-chat", "--raw", dest="chat", action="store_false",
                   help="send the prompt as raw text; by default a model with a chat template gets the prompt as "
                   "a user message, formatted by that template")
    p.add_argument("--system", default=None, help="system prompt (chat only)")
    p.add_argument("--method", default=_API_DEFAULTS["method"], choices=list(METHODS), help="decoding method")
    p.add_argument("--max-new-tokens", type=int, default=_API_DEFAULTS["max_new_tokens"], help="new-token budget")
    p.add_argument("--temperature", type=float, default=_API_DEFAULTS["temperature"], help="0 means greedy")
    p.add_argument("--top-k", type=int, default=_API_DEFAULTS["top_k"], help="0 turns it off")
    p.add_argument("--top-p", type=float, default=_API_DEFAULTS["top_p"], help="1 turns it off")
    p.add_argument("--seed", type=int, default=_API_DEFAULTS["seed"], help="sampling seed (default: a fresh one, "
                   "reported in --json stats)")
    p.add_argument("--gamma", type=int, default=_API_DEFAULTS["gamma"], help="draft tokens per step")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep decoding past end-of-sequence tokens")
    for option in _method_options().values():
        p.add_argument(f"--{option.name.replace('_', '-')}", type=option.type, default=None,
                       help=_option_help(option.name))
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="the output is JSON matching this schema (JSON text, or a file holding it); '{}' for any "
                       "JSON object")
    shape.add_argument("--regex", default=None, help="the output matches this regular expression")
    shape.add_argument("--lark", default=None, metavar="GRAMMAR", help="the output matches this Lark grammar (text "
                       "or a file)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="each new token's target log-probability and its K most likely alternatives (in --json)")
    p.add_argument("--device", default=None, help="cpu (default), cuda, or auto")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the Generation (text, token ids, stats) as JSON, a list of them for several prompts, "
                   "to PATH (atomically), or to standard output when PATH is '-' or left out")


def _read_prompts_file(path: str) -> list[Any]:
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


def _collect_prompts(args: argparse.Namespace) -> list[Any]:
    prompts: list[Any] = [sys.stdin.read() if p == "-" else p for p in args.prompts]
    if args.prompts_file:
        prompts += _read_prompts_file(args.prompts_file)
    if not prompts:
        if args.json not in (None, "-"):
            raise DraftwiseError(f"no prompt: --json took {args.json!r} as the file to write; --json takes a PATH "
                                 "(or '-' for standard output), so write --json - PROMPT, or put --json after the prompt")
        raise DraftwiseError("no prompt: give PROMPT arguments, '-' to read standard input, or --prompts-file PATH")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and not prompt.strip():
            raise DraftwiseError("prompt is empty" if len(prompts) == 1 else f"prompt {i + 1} is empty")
    return prompts


def _as_chat(prompts: list[Any], target: Any, args: argparse.Namespace) -> list[Any]:
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


def _structure(args: argparse.Namespace) -> dict[str, Any]:
    """--json-schema / --regex / --lark and --logprobs as generate's arguments, checked now."""
    from .api import _check_logprobs
    from .grammar import grammar_from

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
    if args.logprobs is not None:
        _check_logprobs(args.logprobs, "--logprobs")
        out["logprobs"] = args.logprobs
    return out


def _run_generate(args: argparse.Namespace) -> int:
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise DraftwiseError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.threads < 0:
        raise DraftwiseError(f"--threads must be >= 0, got {args.threads}")
    if args.system is not None and not args.chat:
        raise DraftwiseError("--system and --no-chat contradict each other: drop one")
    options = {name: getattr(args, name) for name in _method_options() if getattr(args, name) is not None}
    kwargs = dict(
        method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, gamma=args.gamma, stop=args.stop, ignore_eos=args.ignore_eos, **options,
    )
    # Cheap checks first (method, options, sampling values, prompts) so bad input fails before loading weights.
    spec = check_options(draft_given=args.draft is not None, target=args.target, draft=args.draft, **kwargs)[0]
    kwargs.update(_structure(args))
    prompts = _collect_prompts(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target = load_model(args.target, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer)
    prompts = _as_chat(prompts, target, args)
    draft_spec = (args.draft or default_draft(target, spec.name)) if spec.needs_draft else None
    # The one resolver the API uses too: a draft model or an EAGLE head, loaded once for every prompt.
    draft = load_draft(draft_spec, target, device=args.device, dtype=args.dtype) if draft_spec else None
    if len(prompts) == 1 and not args.json:
        for piece in stream(target, prompts[0], draft=draft, **kwargs):
            print(piece, end="", flush=True)
        print()
        return 0
    if len(prompts) == 1:
        _json_out(generate(target, prompts[0], draft=draft, **kwargs).to_dict(), args.json)
        return 0
    batch = {} if args.max_batch_size is None else {"max_batch_size": args.max_batch_size}
    results = generate(target, prompts, draft=draft, **batch, **kwargs)  # the batched API: a list in, a list out
    if args.json:
        _json_out([r.to_dict() for r in results], args.json)
    else:
        print("\n\n".join(r.text for r in results))
    return 0


def _json_out(value: Any, path: str) -> None:
    """JSON to standard output ('-') or to a file, written atomically."""
    if path == "-":
        print(json.dumps(value, indent=2))
        return
    from .bench.report import write_json

    write_json(value, path)
    print(f"wrote {path}", file=sys.stderr)


def _run_methods(args: argparse.Namespace) -> int:
    if args.json:
        _json_out({
            m.name: {
                "summary": m.summary, "drafter": m.drafter, "exact": m.exact, "uses_gamma": m.uses_gamma,
                "greedy_only": m.greedy_only, "reference": m.reference,
                "options": {o.name: {"default": o.default, "type": o.type.__name__, "help": o.help} for o in m.options},
            }
            for m in METHODS.values()
        }, args.json)
        return 0
    common = ", ".join(f"{k}={v}" for k, v in _API_DEFAULTS.items() if k not in ("prompt", "messages", "draft", "method"))
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


def _parse_option_values(pairs: list[str] | None) -> dict[str, dict[str, Any]]:
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


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench.datasets import CATEGORIES, DATASETS, GROUPS
    from .bench.harness import BenchConfig

    d = BenchConfig(target="")
    p = sub.add_parser("bench", help="measure methods on Spec-Bench prompts (speed, target calls, acceptance)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, local directory, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft for every method that can use it (default: the registry's "
                   "best draft per method for a registry target)")
    p.add_argument("--hf-draft", default=None, help="independent draft for hf-assisted (default: --draft unless it "
                   "is an EAGLE head, else the registry's independent draft)")
    p.add_argument("--methods", default=",".join(d.methods), help="comma-separated; see `draftwise methods`, "
                   "plus hf-assisted and prompt-lookup-hf")
    p.add_argument("--dataset", default=d.dataset, help=f"one of: {', '.join(DATASETS)}")
    p.add_argument("--categories", default="", help=f"comma-separated, default all: {', '.join(CATEGORIES)}, "
                   f"or group {', '.join(GROUPS)}")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--gamma", type=int, default=d.gamma)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--warmup", type=int, default=d.warmup, help="prompts per method run before timing")
    p.add_argument("--dtype", default=d.dtype, help=DTYPE_HELP)
    p.add_argument("--device", default=d.device)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (0 = default)")
    p.add_argument("--option", action="append", default=None, metavar="METHOD:NAME=VALUE",
                   help="a method option, e.g. lossy:alpha=0.2 (repeatable)")
    p.add_argument("--prefix-fraction", type=float, default=0.0,
                   help="continue the first fraction of each prompt's words as raw text (no chat template), "
                   "e.g. 0.3 as in SPRINTER §4")
    p.add_argument("--compare-to", default=None, metavar="METHOD",
                   help="compare every method's outputs with this one's: ROUGE-1/2/L, win-tie rate by the target's "
                   "log-likelihood, and speedup (e.g. sd, as in SPRINTER's Table 2)")
    p.add_argument("--quality", action="store_true", help="quality fields for every method (on by default when a "
                   "lossy method runs): target perplexity and agreement, ROUGE-2 / BLEU where references exist")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write the results here")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="speedup and mean accepted length per method; "
                   "with --batch-sizes, throughput against batch size per method")
    p.add_argument("--save-outputs", action="store_true",
                   help="keep every run's output text and token ids in the --json results, to re-score quality later")
    p.add_argument("--batch-sizes", default=None, metavar="B1,B2,...",
                   help="the batched bench: every prompt submitted at once to generate(target, prompts, "
                   "max_batch_size=B) for each B (e.g. 1,4,16,32); reports throughput, latency percentiles, mean "
                   "accepted length and verified tokens per committed token, in the JSON's \"batched\" section")


def _warn_if_fewer(found: int, asked: int, dataset: str, categories: Sequence[str]) -> None:
    if found < asked:
        where = f" in {', '.join(categories)}" if categories else ""
        warnings.warn(f"--num-prompts {asked}: {dataset} has only {found} evaluation prompts{where}; running {found}",
                      DraftwiseWarning, stacklevel=2)


def _run_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .bench.datasets import expand_categories, load_prompts
    from .bench.harness import BenchConfig, check_methods, run_bench
    from .bench.report import format_table, write_json

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    check_methods(methods)
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    expand_categories(list(categories))
    from .bench.batched import parse_batch_sizes

    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes is not None else ()
    config = BenchConfig(
        target=args.target, draft=args.draft, hf_draft=args.hf_draft, methods=methods, dataset=args.dataset,
        categories=categories, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, gamma=args.gamma, repeats=args.repeats,
        warmup=args.warmup, dtype=args.dtype, device=args.device, seed=args.seed, threads=args.threads,
        method_options=_parse_option_values(args.option), quality=args.quality,
        prefix_fraction=args.prefix_fraction, compare_to=args.compare_to, save_outputs=args.save_outputs,
        batch_sizes=batch_sizes,
    )
    if config.compare_to is not None and config.compare_to not in methods:
        raise DraftwiseError(f"--compare-to {config.compare_to!r} is not among --methods")
    if not 0.0 <= config.prefix_fraction < 1.0:
        raise DraftwiseError(f"--prefix-fraction must be in [0, 1), got {config.prefix_fraction}")
    SamplingConfig(config.temperature, config.top_k, config.top_p)
    if config.gamma < 1 or config.repeats < 1 or config.max_new_tokens < 1:
        raise DraftwiseError("--gamma, --repeats and --max-new-tokens must be >= 1")
    n_prompts = len(load_prompts(config.dataset, categories=list(categories) or None, num_prompts=config.num_prompts))
    _warn_if_fewer(n_prompts, config.num_prompts, config.dataset, categories)
    from .bench.harness import plan_drafts

    plan_drafts(config)  # every method and its draft checked before any model loads
    runs = len(batch_sizes) if batch_sizes else n_prompts  # a batched run decodes every prompt at once
    with tqdm(total=runs * len(methods) * config.repeats, desc="bench", unit="run", file=sys.stderr) as bar:
        results = run_bench(config, progress=bar.update)
    if batch_sizes:
        from .bench.batched import format_batched_table

        print(format_batched_table(results["batched"]))
    else:
        print(format_table(results))
    if args.json:
        write_json(results, args.json)
        print(f"wrote {args.json}")
    if args.plot:  # after the JSON: a plotting failure never loses the results
        from .bench.report import plot, plot_batched

        draw = plot_batched if batch_sizes else plot
        _plot_safely(lambda: draw(results, args.plot), args)
    return 0


def _check_output(path: str, flag: str) -> None:
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
    if flag == "--plot":
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        kinds = FigureCanvasAgg.get_supported_filetypes()
        if file.suffix.lstrip(".").lower() not in kinds:
            raise DraftwiseError(f"--plot {path}: unknown image type {file.suffix or '(none)'!r}; use one of "
                                 f"{', '.join('.' + k for k in sorted(kinds))}")


def _check_outputs(args: argparse.Namespace) -> None:
    for attr, flag in (("json", "--json"), ("plot", "--plot")):
        value = getattr(args, attr, None)
        if isinstance(value, str) and value != "-":
            _check_output(value, flag)
    if args.command in ("train-verifier", "profile-sv"):
        _check_output(args.out, "--out")


def _plot_safely(draw: Any, args: argparse.Namespace) -> None:
    try:
        draw()
    except Exception as error:  # noqa: BLE001 - the results are saved; the plot alone failed
        saved = f"; the results are in {args.json}" if getattr(args, "json", None) else ""
        raise DraftwiseError(f"--plot {args.plot}: plotting failed ({type(error).__name__}: {error}){saved}") from None
    print(f"wrote {args.plot}")


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise DraftwiseError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values:
        raise DraftwiseError(f"{flag} is empty")
    return values


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    from .bench.datasets import CATEGORIES, DATASETS
    from .bench.sweep import SweepConfig

    d = SweepConfig(target="", methods=(), alpha_grid=())
    p = sub.add_parser("sweep", help="quality against latency for lossy methods over alpha grids (Narasimhan et al. Fig. 4, "
                       "Table 2)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, local directory, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft model (default: the registry's independent draft)")
    p.add_argument("--methods", required=True, help="comma-separated labels: cascade:RULE (RULE one of chow, diff, "
                   "opt, opt-log, bild, token-v1, token-v2, token-v3), lossy, token-cascade, seq-cascade, oracle-diff, "
                   "bild, fly, ...")
    p.add_argument("--alpha-grid", required=True, help="comma-separated alphas for every method")
    p.add_argument("--grid", action="append", default=None, metavar="LABEL=A,B,C",
                   help="an alpha grid for one method label, e.g. cascade:bild=1,2,4,8 (repeatable)")
    p.add_argument("--temperatures", "--temperature", default="1", help="comma-separated, e.g. 1,0.5")
    p.add_argument("--dataset", default=d.dataset, help=f"one of: {', '.join(DATASETS)}")
    p.add_argument("--categories", default=",".join(d.categories), help=f"comma-separated: {', '.join(CATEGORIES)}")
    for name in ("num_prompts", "max_new_tokens", "top_k", "gamma", "repeats", "warmup", "seed", "threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--dtype", default=d.dtype, help=DTYPE_HELP)
    p.add_argument("--device", default=d.device)
    p.add_argument("--json", default=None, metavar="OUT.json")
    p.add_argument("--plot", default=None, metavar="OUT.png")


def _run_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .bench.datasets import expand_categories, load_prompts
    from .bench.report import write_json
    from .bench.sweep import SweepConfig, format_sweep, plot_sweep, run_sweep, sweep_labels

    grids = {}
    for item in args.grid or []:
        label, sep, values = item.partition("=")
        if not sep:
            raise DraftwiseError(f"--grid takes LABEL=A,B,C, got {item!r}")
        grids[label.strip()] = _floats(values, f"--grid {label}")
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    expand_categories(list(categories))
    config = SweepConfig(
        target=args.target, draft=args.draft, methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        alpha_grid=_floats(args.alpha_grid, "--alpha-grid"), grids=grids,
        temperatures=_floats(args.temperatures, "--temperatures"), dataset=args.dataset, categories=categories,
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, top_k=args.top_k, top_p=args.top_p,
        gamma=args.gamma, repeats=args.repeats, warmup=args.warmup, dtype=args.dtype, device=args.device,
        seed=args.seed, threads=args.threads,
    )
    for t in config.temperatures:
        SamplingConfig(t, config.top_k, config.top_p)
    labels = sweep_labels(config)
    n_prompts = len(load_prompts(config.dataset, categories=list(categories), num_prompts=config.num_prompts))
    _warn_if_fewer(n_prompts, config.num_prompts, config.dataset, categories)
    total = n_prompts * len(labels) * config.repeats * len(config.temperatures)
    with tqdm(total=total, desc="sweep", unit="run", file=sys.stderr) as bar:
        result = run_sweep(config, progress=bar.update)
    print(format_sweep(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot_sweep(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _add_train_verifier(sub: argparse._SubParsersAction) -> None:
    from .training.verifier import VerifierDataConfig, VerifierTrainConfig

    d, t = VerifierDataConfig(), VerifierTrainConfig()
    p = sub.add_parser("train-verifier", help="train SPRINTER's verifier for a (target, draft or head) pair")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="smollm2-135m-draft", help="a draft model, or an EAGLE head (the verifier "
                   "then reads the head's states)")
    p.add_argument("--lambda", dest="lam", type=float, default=t.lam, help="labels: 1 iff q(x)/p(x) <= lambda")
    p.add_argument("--lambdas", default="1,1.2,1.5", help="lambdas drawn in the ROC plot (the one saved: --lambda)")
    p.add_argument("--features", default=",".join(t.features), help="comma-separated: hidden, embedding, stats")
    p.add_argument("--arch", default=t.arch, choices=["linear", "mlp"])
    p.add_argument("--objective", default=t.objective, choices=["sprinter", "acceptance"],
                   help="sprinter: labels q/p <= lambda; acceptance: SpecDec++'s head, targets min(1, p/q)")
    p.add_argument("--tau", type=float, default=t.tau, help="TPR / FPR are reported at this threshold")
    p.add_argument("--num-prompts", type=int, default=200, help="Spec-Bench prompts outside the evaluation split")
    p.add_argument("--continuation", type=int, default=d.continuation)
    p.add_argument("--per-kind", type=int, default=d.per_kind, help="prefixes per kind (a-d of §3.2) per prompt")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--data", default=None, help="cache of collected examples (reused when the settings match)")
    p.add_argument("--out", required=True, help="verifier file to write")
    p.add_argument("--json", default=None, help="training report (all lambdas)")
    p.add_argument("--plot", default=None, help="ROC curves for --lambdas")


def _run_train_verifier(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from .bench.datasets import load_prompts
    from .bench.harness import _prompt_ids
    from .bench.report import write_json
    from .training.verifier import (VerifierDataConfig, VerifierTrainConfig, collect, load_data, plot_roc,
                                    save_data, spec_base, train)

    features = tuple(f.strip() for f in args.features.split(",") if f.strip())
    lambdas = _floats(args.lambdas, "--lambdas")
    if any(lam <= 0 for lam in lambdas + (args.lam,)):
        raise DraftwiseError("lambda must be > 0")
    SamplingConfig(args.temperature, args.top_k, args.top_p)
    data_config = VerifierDataConfig(continuation=args.continuation, per_kind=args.per_kind,
                                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.num_prompts < 3:
        raise DraftwiseError("--num-prompts must be >= 3 (train, validation and test splits are by prompt)")
    target = load_model(args.target, dtype=args.dtype)
    draft = load_draft(args.draft, target, dtype=args.dtype)  # a draft model or a feature head
    from .api import _shared_vocab

    vocab = _shared_vocab(target, draft if isinstance(draft, LoadedModel) else None)
    meta = {"target": args.target, "draft": args.draft, "num_prompts": args.num_prompts, **vars(data_config)}
    data = load_data(Path(args.data), meta) if args.data else None
    if data is None:
        prompts = load_prompts("spec-bench", split="train", num_prompts=args.num_prompts)
        ids = [_prompt_ids(target, p) for p in prompts]
        with tqdm(total=len(ids), desc="collect", unit="prompt", file=sys.stderr) as bar:
            data = collect(target, draft, ids, data_config, vocab_size=vocab, progress=bar.update)
        if args.data:
            save_data(data, meta, Path(args.data))
    base = spec_base(draft, args.draft, data_config, target, args.target)
    reports, saved = [], None
    for lam in sorted(set(lambdas + (args.lam,))):
        verifier, report = train(data, VerifierTrainConfig(lam=lam, features=features, arch=args.arch, tau=args.tau,
                                                           seed=args.seed, objective=args.objective), base)
        auc_test, auc_val = (f"{v:.3f}" if v is not None else "n/a" for v in (report["roc_auc_test"], report["roc_auc_val"]))
        print(f"lambda={lam:g}: ROC-AUC test {auc_test} (val {auc_val}); "
              f"at tau={args.tau:g} TPR {report['tpr_at_tau']:.3f} FPR {report['fpr_at_tau']:.3f}; "
              f"positives {report['positive_fraction']['train']:.2f}; {report['examples']} examples")
        if lam == args.lam:
            saved = verifier
        if lam in lambdas:
            reports.append(report)
    saved.save(args.out)
    print(f"wrote {args.out}")
    if args.json:
        write_json({"data": meta, "reports": reports}, args.json)
    if args.plot:
        plot_roc(reports, args.plot, title=f"{args.draft} -> {args.target}, T={args.temperature:g}: verifier ROC "
                 f"(test split)")
        print(f"wrote {args.plot}")
    return 0


def _add_theory(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("theory", help="closed forms of a method's analysis (sprinter: Zhong et al. §3.1, A.4, A.8)")
    p.add_argument("method", choices=["sprinter"])
    p.add_argument("--eta-tp", type=float, default=0.9, help="verifier true-positive rate")
    p.add_argument("--eta-fp", type=float, default=0.3, help="verifier false-positive rate")
    p.add_argument("--r", type=int, default=5, help="acceptable draft tokens before the first unacceptable one")
    p.add_argument("--t-d", type=float, default=0.1, help="draft time per token (any unit)")
    p.add_argument("--tv", type=float, default=None, help="d_TV(p, q), for the acceptance rate (Theorem A.4)")
    p.add_argument("--target", default="smollm2-135m", help="for the FLOPs model (App. A.8)")
    p.add_argument("--draft", default="smollm2-135m-draft")
    p.add_argument("--verifier", default=None, help="a verifier file (its size enters F_v)")
    p.add_argument("--gamma", type=int, default=20, help="tokens per run for eq. 5-6")
    p.add_argument("--context", type=int, default=256, help="context length for the attention FLOPs")
    p.add_argument("--plot", default=None, help="Figures 5-6 as PNG")
    p.add_argument("--json", default=None)


def _run_theory(args: argparse.Namespace) -> int:
    from . import theory
    from .bench.report import write_json

    try:
        result = {
            "eta_tp": args.eta_tp, "eta_fp": args.eta_fp, "r": args.r, "t_d": args.t_d,
            "expected_run_length": theory.expected_run_length(args.eta_tp, args.eta_fp, args.r),
            "expected_stopping_time": theory.expected_stopping_time(args.eta_tp, args.eta_fp, args.r, args.t_d),
            "run_length_pmf": [theory.run_length_pmf(i, args.eta_tp, args.eta_fp, args.r) for i in range(args.r + 6)],
        }
        if args.tv is not None:
            result["acceptance_rate"] = theory.acceptance_rate(args.eta_fp, args.tv)
            result["sprinter_tv_to_target"] = args.eta_fp * args.tv
    except ValueError as error:
        raise DraftwiseError(str(error)) from None
    from .models import registry
    from .models.loading import resolve_path
    from transformers import AutoConfig

    shapes = {}
    for role, name in (("target", args.target), ("draft", args.draft)):
        path = resolve_path(name)
        if path is None or not path.is_dir():
            raise DraftwiseError(f"{role} {name!r}: no local model directory (registry names: {', '.join(registry.names())})")
        shapes[role] = theory.ModelShape.from_config(AutoConfig.from_pretrained(path))
    f_t, f_d = (theory.forward_flops(shapes[r], args.context) for r in ("target", "draft"))
    f_v = 2.0 * shapes["draft"].width
    if args.verifier:
        from .sprinter import Verifier

        v = Verifier.load(args.verifier)
        f_v = theory.verifier_flops(v.spec.input_size, v.spec.arch, v.spec.mlp_width)
    result["flops"] = {"target_per_token": f_t, "draft_per_token": f_d, "verifier_per_token": f_v,
                       "gamma": args.gamma, "sd": theory.sd_flops(args.gamma, f_d, f_t),
                       "sprinter": theory.sprinter_flops(args.gamma, f_d, f_v, f_t)}
    result["flops"]["sd_over_sprinter"] = result["flops"]["sd"] / result["flops"]["sprinter"]
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(result, args.json)
    if args.plot:
        theory.plot_figures(args.plot, r=args.r, t_d=args.t_d)
        print(f"wrote {args.plot}")
    return 0


def _run_models(args: argparse.Namespace) -> int:
    from .models import registry
    from .models.cache import cache_root, list_entries

    print(f"cache: {cache_root()}")
    cached = list_entries(verify=args.verify)
    for entry in registry.entries():
        state = cached.get(entry.name) if args.verify else entry.cached()
        print(f"{entry.name:<26} {entry.role:<10} {state or 'not built yet':<22} {entry.description}")
    for line in registry.trained_files_listing():
        print(line)
    return 0


def _add_train_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-data", help="answer the training prompt mix with the target (the drafts' data recipe)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--out", required=True, help="JSONL file, or with --features a directory of shards; re-running resumes")
    p.add_argument("--features", action="store_true",
                   help="batched engine with the target's features captured while it generates (EAGLE-3 training "
                   "data): --out is a directory of atomic safetensors shards")
    p.add_argument("--num-fortunes", type=int, default=3000)
    p.add_argument("--num-magpie", type=int, default=2000,
                   help="prompts the target synthesises from its user-turn prefix (source `magpie`; kept in "
                   "OUT/magpie.jsonl, or OUT.magpie.jsonl)")
    p.add_argument("--shard-size", type=int, default=64, help="sequences per shard (--features)")
    p.add_argument("--minutes", type=float, default=None,
                   help="--features: stop after this many minutes, keeping every finished answer (re-run to go on)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tag", default=None, help="record tag (default: greedy or t<temperature>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--limit", type=int, default=0, help="answer only the first N prompts (0 = all)")
    p.add_argument("--prompts-only", action="store_true",
                   help="write the chat-formatted prompts without answers (text for a feature head)")
    p.add_argument("--sources", default="spec-bench,human-eval,fortunes",
                   help="comma-separated subset of spec-bench, human-eval, fortunes, magpie")


def _run_train_data(args: argparse.Namespace) -> int:
    import random
    import time
    from pathlib import Path

    from tqdm import tqdm

    from .training.data import build_prompts, generate_answers, synthesise_prompts

    sources = {x.strip() for x in args.sources.split(",") if x.strip()}
    unknown = sources - {"spec-bench", "human-eval", "fortunes", "magpie"}
    if unknown:
        raise DraftwiseError(f"--sources: unknown source(s) {sorted(unknown)}; choose from spec-bench, human-eval, "
                             "fortunes, magpie")
    for name in ("num_fortunes", "num_magpie", "max_new_tokens", "batch_size", "shard_size", "limit"):
        if getattr(args, name) < (1 if name in ("batch_size", "shard_size") else 0):
            raise DraftwiseError(f"--{name.replace('_', '-')} must be {'>= 1' if name in ('batch_size', 'shard_size') else '>= 0'}")
    out = Path(args.out)
    if args.features and out.exists() and not out.is_dir():
        raise DraftwiseError(f"--out {out}: with --features this is a directory of shards, and a file is there")
    try:
        prompts = [p for p in build_prompts(num_fortunes=args.num_fortunes if "fortunes" in sources else 0,
                                            seed=args.seed) if p.source in sources]
    except FileNotFoundError as e:
        raise DraftwiseError(str(e)) from None
    tag = args.tag or ("prompt" if args.prompts_only else "greedy" if args.temperature == 0 else f"t{args.temperature:g}")
    if args.prompts_only:
        args.max_new_tokens = 0
    target = load_model(args.target, dtype=args.dtype)
    if "magpie" in sources and args.num_magpie:
        store = out / "magpie.jsonl" if args.features else out.with_name(out.name + ".magpie.jsonl")
        store.parent.mkdir(parents=True, exist_ok=True)
        with tqdm(total=args.num_magpie, desc="magpie prompts", unit="prompt", file=sys.stderr, mininterval=10) as bar:
            prompts += synthesise_prompts(target, args.num_magpie, store, batch_size=args.batch_size, seed=args.seed,
                                          progress=lambda n: bar.update(n - bar.n))
    random.Random(args.seed).shuffle(prompts)  # every category early: a cut-short run still covers them all
    if args.limit:
        prompts = prompts[: args.limit]
    if args.features:
        from .bench.report import write_json
        from .training.shards import generate_shards

        log_path = out / "progress.jsonl"
        import signal

        def interrupted(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, interrupted)  # `kill` keeps the finished answers, like Ctrl-C

        def log(record: dict) -> None:
            with open(log_path, "a") as f:
                f.write(json.dumps({"tag": tag, **record}) + "\n")

        with tqdm(total=len(prompts), desc="answers", unit="prompt", file=sys.stderr, mininterval=10) as bar:
            report = generate_shards(target, prompts, out, max_new_tokens=args.max_new_tokens,
                                     batch_size=args.batch_size, temperature=args.temperature, tag=tag,
                                     seed=args.seed, shard_size=args.shard_size,
                                     deadline=time.monotonic() + 60 * args.minutes if args.minutes else None,
                                     progress=lambda n, tokens: bar.update(n - bar.n), log=log)
        report.update(tag=tag, target=args.target, batch_size=args.batch_size, torch_threads=__import__("torch").get_num_threads())
        write_json(report, out / f"train-data-report-{tag}.json")
        print(f"{report['sequences']} sequences, {report['answer_tokens']} answer tokens in {report['seconds']:.0f} s "
              f"({report['answer_tokens_per_hour']:.0f} answer tokens/hour); {report['skipped']} already done")
        return 0
    with tqdm(total=len(prompts), desc="answers", unit="prompt", file=sys.stderr, mininterval=10) as bar:
        generate_answers(target, prompts, out, max_new_tokens=args.max_new_tokens,
                         batch_size=args.batch_size, temperature=args.temperature, tag=tag, seed=args.seed,
                         progress=bar.update)
    return 0


def _add_profile_sv(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile-sv", help="build Speculative Verification's profile: P(accept | S, A), information "
                       "gain, and this machine's verification latency (Kim et al. §4, §7.4, D.10)")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=None, help="draft model (default: the registry's independent draft)")
    p.add_argument("--companion", default=None, help="companion model (default: the registry's companion)")
    p.add_argument("--out", required=True, help="profile JSON (written atomically)")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampling setting the profile is for (0: greedy)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--gamma", type=int, default=5, help="draft tokens per step while profiling (and the most sv verifies)")
    p.add_argument("--num-prompts", type=int, default=64, help="Spec-Bench training-split prompts (never evaluation ones)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--latency-rows", default="1,2,4,8,16,32", help="batch sizes whose latency is profiled")
    p.add_argument("--context", type=int, default=256, help="tokens already in each row while latency is timed")
    p.add_argument("--latency-from", default=None, metavar="PROFILE",
                   help="reuse another profile's latency model (same machine and models) instead of timing again")
    p.add_argument("--latency-only", action="store_true",
                   help="time the latency again (this machine) and rewrite --out's latency model, keeping its samples' "
                   "tables and report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")


def _run_profile_sv(args: argparse.Namespace) -> int:
    import platform
    import time

    import torch
    from tqdm import tqdm

    from . import sv
    from .api import check_same_tokenizer
    from .bench.batched import parse_batch_sizes
    from .bench.datasets import load_prompts
    from .bench.harness import _prompt_ids
    from .models import registry
    from .sv_profile import build_profile, collect_samples, measure_latency

    if args.threads:
        torch.set_num_threads(args.threads)
    for name, value in (("--gamma", args.gamma), ("--num-prompts", args.num_prompts),
                        ("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                        ("--context", args.context)):
        if value < 1:
            raise DraftwiseError(f"{name} must be >= 1, got {value}")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    rows = parse_batch_sizes(args.latency_rows)
    latency_from = sv.SVProfile.load(args.latency_from) if args.latency_from else None
    draft_name = args.draft or registry.default_independent_draft(args.target)
    companion_name = args.companion or registry.default_companion(args.target)
    if not draft_name or not companion_name:
        raise DraftwiseError("profile-sv needs --draft and --companion (the registry has defaults only for "
                             f"{', '.join(registry.companion_targets())})")
    target = load_model(args.target, dtype=args.dtype)
    draft = load_draft(draft_name, target, dtype=args.dtype)
    companion = load_model(companion_name, dtype=args.dtype)
    for model in (draft, companion):
        check_same_tokenizer(target, model)
    vocab = min(m.vocab_size for m in (target, draft, companion))
    setting = sv.profile_setting(target.name, draft.name, companion.name, sampling)
    if latency_from is not None:
        latency_from.check(setting, args.latency_from, ("target", "draft", "companion"))
    if args.latency_only:
        existing = sv.SVProfile.load(args.out)
        existing.check(setting, args.out)
        existing.latency = latency_from.latency if latency_from is not None else measure_latency(
            target, draft, companion, gamma=len(existing.latency.verify[0]) - 1, vocab_size=vocab, rows=rows,
            context=args.context)
        existing.report["machine"] = {"cpu": platform.processor() or platform.machine(),
                                      "threads": torch.get_num_threads()}
        existing.report["latency_context"] = args.context
        existing.save(args.out)
        print(f"rewrote the latency model of {args.out}")
        return 0
    prompts = [_prompt_ids(target, p) for p in load_prompts(split="train", num_prompts=args.num_prompts)]
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="profiling SD", unit="prompt", file=sys.stderr, mininterval=5) as bar:
        def progress(done: int, total: int, samples: int) -> None:
            bar.update(done - bar.n)
            bar.set_postfix(drafted=samples)

        samples = collect_samples(target, draft, companion, prompts, sampling=sampling, gamma=args.gamma,
                                  max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, vocab_size=vocab,
                                  eos_token_ids=target.eos_token_ids, seed=args.seed, progress=progress)
    profiled_s = time.perf_counter() - start
    if latency_from is not None:
        latency = latency_from.latency
    else:
        print("timing verification latency ...", file=sys.stderr)
        latency = measure_latency(target, draft, companion, gamma=args.gamma, vocab_size=vocab, rows=rows,
                                  context=args.context)
    extra = {"prompts": len(prompts), "split": "spec-bench train", "gamma": args.gamma,
             "max_new_tokens": args.max_new_tokens, "profiling_seconds": round(profiled_s, 1),
             "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
             "latency_context": args.context}
    profile = build_profile(samples, latency, setting, extra)
    profile.save(args.out)
    report = profile.report
    print(f"wrote {args.out}: {report['samples']} drafted tokens from {len(prompts)} prompts, mean acceptance "
          f"{report['mean_x']:.3f}")
    print(f"{'bins':<10} {'H(X)':>7} {'H(X|S,A)':>9} {'I(X;S,A)':>9} {'I (Miller-Madow)':>17}")
    for name, row in report["resolutions"].items():
        print(f"{name:<10} {row['H_X']:7.3f} {row['H_X_given']:9.3f} {row['I']:9.3f} {row['I_mm']:17.3f}")
    corr = report.get("corr_S_draft_companion_vs_draft_target")
    if corr is not None:
        print(f"correlation of draft-companion and draft-target similarity: {corr:.3f}")
    return 0


def _add_distill(sub: argparse._SubParsersAction) -> None:
    from .training.distill import DistillConfig

    d = DistillConfig(data="", out="")
    p = sub.add_parser("distill", help="train an independent draft model on the target's answers")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", required=True, help="JSONL from `draftwise train-data`, or a shard directory from "
                   "`train-data --features` (comma-separated for several)")
    p.add_argument("--out", required=True, help="output directory (re-running resumes from its checkpoint)")
    for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_len", "batch_size", "steps",
                 "warmup", "seed", "checkpoint_every"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lr", "val_fraction"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--weight-decay", type=float, default=None,
                   help=f"AdamW weight decay (default: {d.weight_decay} for a draft model, 0 for an EAGLE head)")
    p.add_argument("--save-dtype", default=d.save_dtype, choices=["fp16", "bf16", "fp32"])
    p.add_argument("--kind", default="model", choices=["model", "eagle"],
                   help="model: an independent draft LM; eagle: a feature-level head on the target's features")
    p.add_argument("--draft-vocab", type=int, default=8192, help="eagle: draft vocabulary size")
    p.add_argument("--stop-at", type=int, default=None, help="end this run after that step (resume later)")
    p.add_argument("--loss-on", default="all", choices=["all", "answer"],
                   help="eagle: train on every position, or only on the target's answers")
    p.add_argument("--init-from", default="", help="eagle: start from this EAGLE directory (fine-tuning)")
    p.add_argument("--output-vocab", type=int, default=0, help="model: also write output-vocab.json, the N most "
                   "frequent tokens of the data; decoding then runs the draft's LM head over those rows only (exact)")
    p.add_argument("--bf16", action="store_true", help="model: bf16 autocast for the matmuls (fp32 master "
                   "weights); about 10x faster on CPUs with AMX")
    p.add_argument("--minutes", type=float, default=None, help="model: train one chunk of this many minutes, then "
                   "checkpoint and export (re-run to go on)")


def _add_train_eagle3(sub: argparse._SubParsersAction) -> None:
    from .training.eagle3_train import Eagle3TrainConfig

    d = Eagle3TrainConfig(data="", out="")
    p = sub.add_parser("train-eagle3", help="train an EAGLE-3-style head (training-time test) on feature shards "
                       "from `draftwise train-data --features`")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", required=True, help="shard directory (comma-separated for several)")
    p.add_argument("--out", required=True, help="output directory; re-running resumes from its checkpoint, and the "
                   "head is written to OUT/head")
    for name in ("draft_vocab", "intermediate_size", "max_len", "batch_size", "steps", "warmup", "ttt_steps", "seed",
                 "checkpoint_every", "max_examples"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lr", "weight_decay", "decay", "val_fraction"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--own-lm-head", dest="shared_lm_head", action="store_false",
                   help="train and store the head's own LM head (default: the target's rows, frozen, not stored)")
    p.add_argument("--fp32", dest="bf16", action="store_false",
                   help="fp32 matmuls (default: bf16 autocast with fp32 master weights)")
    p.add_argument("--minutes", type=float, default=None, help="train one chunk of this many minutes, then checkpoint "
                   "and export (re-run to go on)")
    p.add_argument("--stop-at", type=int, default=None, help="end this run after that step (resume later)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")


def _run_train_eagle3(args: argparse.Namespace) -> int:
    import dataclasses

    import torch
    from tqdm import tqdm

    from .training.eagle3_train import Eagle3TrainConfig, train_eagle3

    for name in ("draft_vocab", "intermediate_size", "max_len", "batch_size", "steps", "ttt_steps", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise DraftwiseError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = {f.name for f in dataclasses.fields(Eagle3TrainConfig)}
    config = Eagle3TrainConfig(**{k: v for k, v in vars(args).items() if k in names}, target_name=args.target)
    target = load_model(args.target, dtype="fp32")
    log_path = Path(args.out) / "train-log.jsonl"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with tqdm(total=args.steps, desc="train-eagle3", unit="step", file=sys.stderr, mininterval=10) as bar:
        def progress(step: int, info: dict) -> None:
            bar.n = step
            bar.set_postfix({k: f"{v:.3f}" for k, v in info.items() if k in ("loss", "acc0", "acc1", "acc2")},
                            refresh=False)
            bar.refresh()
            if step % 10 == 0:
                with open(log_path, "a") as f:
                    f.write(json.dumps({"step": step, **{k: round(v, 4) for k, v in info.items()}}) + "\n")

        report = train_eagle3(config, target.model, eos_ids=set(target.eos_token_ids), minutes=args.minutes,
                              progress=progress, stop_at=args.stop_at)
    print(json.dumps(report, indent=2))
    return 0


def _add_export_eagle(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-eagle", help="write an EAGLE-3-style head as the checkpoint vLLM and SGLang load "
                       "(llama_eagle3: config.json, model.safetensors with d2t/t2d)")
    p.add_argument("--head", required=True, help="a draftwise EAGLE-3 head: registry name or directory")
    p.add_argument("--out", required=True, help="a new (or empty) directory")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    p.add_argument("--with-embeddings", action="store_true",
                   help="also write the target's token embedding (embed_tokens.weight); vLLM and SGLang share the "
                   "target's when it is absent")
    p.add_argument("--target", default=None, help="the target whose embedding --with-embeddings writes (default: the "
                   "head's own target)")


def _run_export_eagle(args: argparse.Namespace) -> int:
    import torch

    from .eagle import is_eagle_dir, load_head
    from .eagle3 import Eagle3Head
    from .export import export_eagle3
    from .models.loading import resolve_path

    path = resolve_path(args.head)
    if path is None or not is_eagle_dir(path):
        raise DraftwiseError(f"--head {args.head}: not an EAGLE head (a registry name or a directory with eagle3.json)")
    head = load_head(path)
    if isinstance(head, Eagle3Head) and head.config.shared_lm_head and not args.with_embeddings:
        target_name = args.target or head.config.target  # its LM head is the target's rows: read them
        if not target_name:
            raise DraftwiseError("this head shares its target's LM head and does not record the target; pass --target")
        head.attach(load_model(target_name, dtype="fp32").model)
    if not isinstance(head, Eagle3Head):
        raise DraftwiseError(f"--head {args.head} is an EAGLE-1 head (one fused last-layer feature, bias in fc, the "
                             "target's LM head): it has no EAGLE-3 counterpart to export; train an EAGLE-3 head with "
                             "`draftwise train-eagle3`")
    embeddings = None
    if args.with_embeddings:
        target_name = args.target or head.config.target
        if not target_name:
            raise DraftwiseError("--with-embeddings: the head does not record its target; pass --target")
        target = load_model(target_name, dtype="fp32")
        head.attach(target.model)
        embeddings = target.model.get_input_embeddings().weight
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    out = export_eagle3(head, args.out, dtype=dtype, embeddings=embeddings)
    layers = ",".join(map(str, head.config.feature_layers))
    print(f"wrote {out} (EAGLE-3 layout, {args.dtype}, draft vocabulary {head.draft_vocab_size}, target layers "
          f"{layers}). Serve it with vLLM: --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{out}\", "
          f"\"num_speculative_tokens\": 3}}'; or SGLang: --speculative-algorithm EAGLE3 "
          f"--speculative-draft-model-path {out}")
    return 0


def _run_distill(args: argparse.Namespace) -> int:
    import dataclasses

    from tqdm import tqdm

    from .training.distill import DistillConfig, distill

    target = load_model(args.target, dtype="fp32")
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None and target.tokenizer.pad_token_id is not None \
        else 0
    with tqdm(total=args.steps, desc="distill", unit="step", file=sys.stderr, mininterval=5) as bar:
        def progress(step: int, info: dict) -> None:
            bar.n = step
            bar.set_postfix({k: f"{v:.3f}" for k, v in info.items()}, refresh=False)
            bar.refresh()

        if args.kind == "eagle":
            from .training.eagle_train import EagleTrainConfig, train_eagle

            names = {f.name for f in dataclasses.fields(EagleTrainConfig)}
            values = {k: v for k, v in vars(args).items() if k in names and k != "target_name" and v is not None}
            if values.get("init_from"):
                from .models.loading import resolve_path

                values["init_from"] = str(resolve_path(values["init_from"]) or values["init_from"])
            config = EagleTrainConfig(**values, target_name=args.target)
            report = train_eagle(config, target.model, pad=pad, eos_ids=set(target.eos_token_ids),
                                 progress=progress, stop_at=args.stop_at)
        else:
            given = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillConfig)}
            config = DistillConfig(**{k: v for k, v in given.items() if v is not None})
            report = distill(config, target.model.config, target.model.get_input_embeddings().weight.detach(),
                             pad=pad, progress=progress, stop_at=args.stop_at, minutes=args.minutes)
    print(json.dumps(report, indent=2))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is one `--help` away, not 28 lines of it)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="draftwise", description="Faster LLM decoding with draft models.",
                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"draftwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    methods = sub.add_parser("methods", help="list the methods, their options and defaults")
    methods.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                         help="the methods as JSON, to PATH or to standard output ('-' or left out)")
    _add_bench(sub)
    _add_sweep(sub)
    _add_train_verifier(sub)
    _add_theory(sub)
    _add_train_data(sub)
    _add_distill(sub)
    _add_train_eagle3(sub)
    _add_export_eagle(sub)
    _add_profile_sv(sub)
    models = sub.add_parser("models", help="list the default models and what is cached")
    models.add_argument("--verify", action="store_true", help="recompute SHA-256 of cached files")
    _add_serving(sub)
    for subparser in sub.choices.values():
        subparser.formatter_class = _HelpFormatter  # defaults in every --help
    return parser


_COMMANDS = {"generate": _run_generate, "methods": _run_methods, "bench": _run_bench, "sweep": _run_sweep,
             "train-verifier": _run_train_verifier, "theory": _run_theory,
             "models": _run_models,
             "train-data": _run_train_data, "distill": _run_distill, "train-eagle3": _run_train_eagle3, "export-eagle": _run_export_eagle, "profile-sv": _run_profile_sv}


def _add_serving(sub: argparse._SubParsersAction) -> None:
    """`serve` (the OpenAI-compatible server) and `loadtest` (its load test): draftwise.server.cli."""
    from .server.cli import add_parsers

    add_parsers(sub, default_target=DEFAULT_TARGET, method_options=_method_options(), option_help=_option_help)


def _run_serve(args: argparse.Namespace) -> int:
    from .server.cli import run_serve

    return run_serve(args, _method_options())


def _run_loadtest(args: argparse.Namespace) -> int:
    from .server.cli import run_loadtest

    return run_loadtest(args, _read_prompts_file)


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
            _check_outputs(args)
            return _COMMANDS[args.command](args)
        except DraftwiseError as error:
            print(f"draftwise: error: {error}", file=sys.stderr)
            return 2


_showwarning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """draftwise's own warnings as one line, like its errors; others as Python shows them."""
    if issubclass(category, DraftwiseWarning):
        print(f"draftwise: warning: {message}", file=sys.stderr)
    else:
        _showwarning(message, category, filename, lineno, file, line)


if __name__ == "__main__":
    sys.exit(main())
