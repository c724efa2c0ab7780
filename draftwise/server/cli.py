"""`draftwise serve` and `draftwise loadtest`: their flags and what they run (registered by draftwise.cli)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import warnings
from typing import Any, Callable

from draftwise.errors import DraftwiseError, DraftwiseWarning
from draftwise.methods import METHODS
from draftwise.models.loading import DTYPE_HELP

API_KEY_ENV = "DRAFTWISE_API_KEY"
_DEFAULT_TARGET = "smollm2-135m"  # draftwise.cli's, set when it registers `serve`


def add_parsers(sub: argparse._SubParsersAction, *, default_target: str, method_options: dict[str, Any],
                option_help: Callable[[str], str]) -> None:
    global _DEFAULT_TARGET
    _DEFAULT_TARGET = default_target
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the batched engine")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"the target, as `vllm serve MODEL` takes it (the same as --target; default: {default_target})")
    p.add_argument("--target", default=None, help=f"registry name, local directory, .gguf file or hub id (default: "
                   f"{default_target})")
    p.add_argument("--draft", default=None, help="draft model or EAGLE head (default: the registry's best draft for "
                   "--method when it needs one); methods that need a draft run only when one is loaded")
    p.add_argument("--method", default="sd", choices=list(METHODS),
                   help="the method requests get unless their 'draftwise' field names another")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per step")
    for option in method_options.values():
        p.add_argument(f"--{option.name.replace('_', '-')}", type=option.type, default=None,
                       help=option_help(option.name))
    p.add_argument("--served-model-name", default=None, help="the name clients put in 'model' (default: --target)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (only this machine by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1 (default: "
                   f"${API_KEY_ENV} when set, else no key)")
    p.add_argument("--cors-origin", dest="cors_origins", action="append", default=None, metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. http://localhost:3000; repeatable; '*' for any) call /v1 "
                   "cross-site (CORS). Off by default: no CORS headers, preflights refused. POST bodies must be "
                   "'Content-Type: application/json' either way (else 415)")
    p.add_argument("--max-batch-size", type=int, default=16, help="requests decoding together (engine rows)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row; more get 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--body-timeout", type=float, default=10.0,
                   help="seconds a request body may take to arrive whole; a slower one gets 408")
    p.add_argument("--max-engines", type=int, default=8,
                   help="engines (one per method and options) kept at once; idle ones beyond it are dropped")
    p.add_argument("--prefix-cache-mb", type=float, default=256.0,
                   help="megabytes of prompt prefixes' keys and values kept for reuse (per engine); 0 turns it off")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are cancelled")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", dest="access_log", action="store_false", help="no line per request")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="take requests without first running one through the default method's engine")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id, when the target has none")
    p.add_argument("--device", default=None, help="cpu (default), cuda, or auto")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")

    p = sub.add_parser("loadtest", help="load a running server (on this machine): throughput, TTFT and inter-token "
                       "latency percentiles at several concurrencies")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--concurrency", default="1,4,8,16", help="client counts, comma-separated, run in order")
    p.add_argument("--num-requests", type=int, default=32, help="requests at each concurrency")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="seed of every request (default: none)")
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="send raw text to /v1/completions instead of user messages to /v1/chat/completions")
    p.add_argument("--prompts-file", default=None, metavar="PATH", help="prompts, one per line or .jsonl as for "
                   "`generate` (default: Spec-Bench evaluation prompts)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--method", default=None, help="ask for this method through the 'draftwise' body field")
    p.add_argument("--option", action="append", default=None, metavar="NAME=VALUE",
                   help="a method option in the 'draftwise' field (repeatable), e.g. --option alpha=0.3")
    p.add_argument("--gamma", type=int, default=None, help="draft tokens per step, through the 'draftwise' field")
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to max_tokens")
    p.add_argument("--api-key", default=None, help=f"bearer key (default: ${API_KEY_ENV} when set)")
    p.add_argument("--warmup", type=int, default=1, help="requests sent first, not measured")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the whole test may take; nothing starts "
                   "after it and open requests are abandoned")
    p.add_argument("--allow-remote", action="store_true", help="allow a URL that is not this machine")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here (atomically)")


def _positive(name: str, value: float) -> None:
    if value < 1:
        raise DraftwiseError(f"{name} must be >= 1, got {value}")


def run_serve(args: argparse.Namespace, method_options: dict[str, Any]) -> int:
    from draftwise import plan
    from draftwise.models import registry
    from draftwise.drafters.ngram_companion import load_companion
    from draftwise.heads.loading import load_draft
    from draftwise.models.loading import load_model
    from draftwise.server import ServerConfig, Service, bind, create_app, serve

    model = getattr(args, "model", None)
    if model is not None and args.target is not None and model != args.target:
        raise DraftwiseError(f"MODEL {model!r} and --target {args.target!r} name two targets: give one")
    args.target = model or args.target or _DEFAULT_TARGET
    for name in ("--max-batch-size", "--max-engines", "--gamma"):
        _positive(name, getattr(args, name[2:].replace("-", "_")))
    if args.max_queue < 0 or args.max_body_bytes < 1 or not 0 <= args.port < 65536 or args.threads < 0 \
            or args.shutdown_timeout < 0 or not 0 <= args.prefix_cache_mb < float("inf") \
            or not 0 < args.body_timeout < float("inf"):
        raise DraftwiseError("--body-timeout must be > 0; --max-queue, --shutdown-timeout, --prefix-cache-mb and --threads must be >= 0, "
                             "--max-body-bytes >= 1, --port in [0, 65535]")
    options = {name: getattr(args, name) for name in method_options if getattr(args, name) is not None}
    companion_spec = options.pop("companion", None)
    spec = METHODS[args.method]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DraftwiseWarning)  # a draft the method does not use still serves overrides
        plan.check_options(method=args.method, max_new_tokens=1, temperature=0.0 if spec.greedy_only else 1.0,
                          top_k=0, top_p=1.0, seed=None, gamma=args.gamma, stop=None, ignore_eos=False,
                          draft_given=args.draft is not None, target=args.target, draft=args.draft, **options)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if not _loopback(args.host) and api_key is None:
        warnings.warn(f"serving on {args.host} without --api-key: anyone who reaches this port can use it",
                      DraftwiseWarning)
    sock = bind(args.host, args.port)  # a busy port fails now, before any weights load
    try:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        target = load_model(args.target, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer)
        draft_spec = args.draft or (plan.default_draft(target, spec.name) if spec.needs_draft else None)
        draft = load_draft(draft_spec, target, device=args.device, dtype=args.dtype) if draft_spec else None
        # the registry's head for sampled answers, where it ships one: requests at T > 0 draft with it (both heads
        # stay loaded; they are small)
        sampled_spec = plan.default_draft(target, spec.name, 1.0) if args.draft is None and spec.needs_draft else None
        sampled = load_draft(sampled_spec, target, device=args.device, dtype=args.dtype) \
            if sampled_spec and sampled_spec != draft_spec else None
        if companion_spec is None and spec.needs_companion:
            companion_spec = registry.default_companion(target.name) if target.name in registry.names() else None
        companion = None
        if companion_spec is not None:
            companion = load_companion(companion_spec, target, device=args.device or target.device,
                                       dtype=target.dtype)
            plan.check_same_tokenizer(target, companion)
        config = ServerConfig(model_name=args.served_model_name or args.target, method=args.method, options=options,
                              gamma=args.gamma, api_key=api_key, max_batch_size=args.max_batch_size,
                              max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, max_engines=args.max_engines,
                              prefix_cache_mb=args.prefix_cache_mb, body_timeout_s=args.body_timeout,
                              cors_origins=tuple(args.cors_origins or ()))
        service = Service(config, target, draft, companion, sampled_draft=sampled)
        warmed = service.warm_up() if args.warm_up else None
        warm = f"; warmed up in {warmed:.1f} s" if warmed is not None else ""
        host, port = sock.getsockname()[:2]
        print(f"draftwise: serving {config.model_name!r} with {args.method} on http://{_url_host(host)}:{port}/v1 "
              f"(methods: {', '.join(service.runnable())})"
              + (f"; drafts: {draft_spec} at T=0, {sampled_spec} at T>0" if sampled is not None else "") + warm,
              file=sys.stderr, flush=True)
        serve(create_app(service), sock, log_level=args.log_level, shutdown_timeout=args.shutdown_timeout,
              access_log=args.access_log)
    finally:
        sock.close()
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def run_loadtest(args: argparse.Namespace, read_prompts: Callable[[str], list[Any]]) -> int:
    from draftwise.server import loadtest

    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise DraftwiseError(f"--concurrency takes comma-separated integers, got {args.concurrency!r}") from None
    for name in ("--num-requests", "--max-tokens"):
        _positive(name, getattr(args, name[2:].replace("-", "_")))
    if args.warmup < 0:
        raise DraftwiseError(f"--warmup must be >= 0, got {args.warmup}")
    override: dict[str, Any] = {}
    if args.method is not None:
        override["method"] = args.method
    if args.gamma is not None:
        override["gamma"] = args.gamma
    if args.ignore_eos:
        override["ignore_eos"] = True
    for pair in args.option or []:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise DraftwiseError(f"--option takes NAME=VALUE, got {pair!r}")
        override[name.replace("-", "_")] = _scalar(value)
    prompts = read_prompts(args.prompts_file) if args.prompts_file else None
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None

    def progress(level: dict[str, Any]) -> None:
        print(f"concurrency {level['concurrency']}: {level['requests_ok']} ok, {level['requests_failed']} failed, "
              f"{level['throughput_tok_s'] or 0:.1f} tok/s", file=sys.stderr, flush=True)

    report = loadtest.run(args.url, concurrency=levels, num_requests=args.num_requests, max_tokens=args.max_tokens,
                          temperature=args.temperature, chat=args.chat, prompts=prompts, model=args.model,
                          api_key=api_key, override=override or None, seed=args.seed, timeout_s=args.timeout,
                          warmup=args.warmup, allow_remote=args.allow_remote, progress=progress)
    print(loadtest.table(report["levels"]))
    if args.json:
        loadtest.write_json(args.json, report)
        print(f"wrote {args.json}", file=sys.stderr)
    failed = sum(level.get("requests_failed", 0) for level in report["levels"])
    return 1 if failed else 0


def _scalar(text: str) -> Any:
    """An option value as JSON would read it (numbers, true/false), else the string."""
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text
