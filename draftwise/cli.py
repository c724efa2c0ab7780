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
from .sampling import SamplingConfig

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
        p.add_argument(f"--{option.name.replace('_', '-')}", type=option.type, default=None,
                       help=_option_help(option.name))
    p.add_argument("--device", default=None, help="cpu (default), cuda, or auto")
    p.add_argument("--dtype", default=None, help="auto, fp32, bf16 or fp16 (default: fp32 on CPU)")
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
        needs = {"model": "needs --draft", "ngram": "no draft model", "none": "target only",
                 "sprinter": "needs --draft and --verifier", "stophead": "needs --draft and --head",
                 "beam": "needs --draft"}[m.drafter]
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
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None, help="draft for sd / lossy / ... methods")
    p.add_argument("--hf-draft", default=None, help="independent draft for hf-assisted (default: --draft)")
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
    p.add_argument("--dtype", default=d.dtype, help="auto (default: bf16 where the CPU has native bf16, else fp32), "
                   "bf16, fp32")
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
    p.add_argument("--plot", default=None, metavar="OUT.png", help="speedup and mean accepted length per method")


def _run_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .bench.datasets import expand_categories, load_prompts
    from .bench.harness import BenchConfig, check_methods, run_bench
    from .bench.report import format_table, write_json

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    check_methods(methods)
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    expand_categories(list(categories))
    config = BenchConfig(
        target=args.target, draft=args.draft, hf_draft=args.hf_draft, methods=methods, dataset=args.dataset,
        categories=categories, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, gamma=args.gamma, repeats=args.repeats,
        warmup=args.warmup, dtype=args.dtype, device=args.device, seed=args.seed, threads=args.threads,
        method_options=_parse_option_values(args.option), quality=args.quality,
        prefix_fraction=args.prefix_fraction, compare_to=args.compare_to,
    )
    if config.compare_to is not None and config.compare_to not in methods:
        raise DraftwiseError(f"--compare-to {config.compare_to!r} is not among --methods")
    if not 0.0 <= config.prefix_fraction < 1.0:
        raise DraftwiseError(f"--prefix-fraction must be in [0, 1), got {config.prefix_fraction}")
    SamplingConfig(config.temperature, config.top_k, config.top_p)
    if config.gamma < 1 or config.repeats < 1 or config.max_new_tokens < 1:
        raise DraftwiseError("--gamma, --repeats and --max-new-tokens must be >= 1")
    n_prompts = len(load_prompts(config.dataset, categories=list(categories) or None, num_prompts=config.num_prompts))
    with tqdm(total=n_prompts * len(methods) * config.repeats, desc="bench", unit="run", file=sys.stderr) as bar:
        results = run_bench(config, progress=bar.update)
    print(format_table(results))
    if args.json:
        write_json(results, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from .bench.report import plot

        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


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
    p = sub.add_parser("sweep", help="quality against latency for lossy methods over alpha grids (seed 003 Fig. 4, "
                       "Table 2)")
    p.add_argument("--target", required=True)
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
    p.add_argument("--dtype", default=d.dtype)
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
    p = sub.add_parser("train-verifier", help="train SPRINTER's verifier for a (target, draft) pair")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="smollm2-135m-draft")
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
    draft = load_model(args.draft, dtype=args.dtype)
    from .api import _shared_vocab

    vocab = _shared_vocab(target, draft)
    meta = {"target": args.target, "draft": args.draft, "num_prompts": args.num_prompts, **vars(data_config)}
    data = load_data(Path(args.data), meta) if args.data else None
    if data is None:
        prompts = load_prompts("spec-bench", split="train", num_prompts=args.num_prompts)
        ids = [_prompt_ids(target, p) for p in prompts]
        with tqdm(total=len(ids), desc="collect", unit="prompt", file=sys.stderr) as bar:
            data = collect(target, draft, ids, data_config, vocab_size=vocab, progress=bar.update)
        if args.data:
            save_data(data, meta, Path(args.data))
    base = spec_base(draft, args.draft, data_config)
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
    p = sub.add_parser("theory", help="closed forms of a method's analysis (sprinter: seed 000 §3.1, A.4, A.8)")
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
    return 0


def _add_train_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-data", help="answer the training prompt mix with the target (the drafts' data recipe)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--out", required=True, help="JSONL file; re-running resumes")
    p.add_argument("--num-fortunes", type=int, default=3000)
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
                   help="comma-separated subset of spec-bench, human-eval, fortunes")


def _run_train_data(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from .training.data import build_prompts, generate_answers

    sources = {x.strip() for x in args.sources.split(",") if x.strip()}
    prompts = [p for p in build_prompts(num_fortunes=args.num_fortunes, seed=args.seed) if p.source in sources]
    if args.limit:
        prompts = prompts[: args.limit]
    tag = args.tag or ("prompt" if args.prompts_only else "greedy" if args.temperature == 0 else f"t{args.temperature:g}")
    if args.prompts_only:
        args.max_new_tokens = 0
    target = load_model(args.target, dtype=args.dtype)
    with tqdm(total=len(prompts), desc="answers", unit="prompt", file=sys.stderr, mininterval=10) as bar:
        generate_answers(target, prompts, Path(args.out), max_new_tokens=args.max_new_tokens,
                         batch_size=args.batch_size, temperature=args.temperature, tag=tag, seed=args.seed,
                         progress=bar.update)
    return 0


def _add_distill(sub: argparse._SubParsersAction) -> None:
    from .training.distill import DistillConfig

    d = DistillConfig(data="", out="")
    p = sub.add_parser("distill", help="train an independent draft model on the target's answers")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", required=True, help="JSONL from `draftwise train-data` (comma-separated for several)")
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
                             pad=pad, progress=progress, stop_at=args.stop_at)
    print(json.dumps(report, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftwise", description="Faster LLM decoding with draft models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    methods = sub.add_parser("methods", help="list the methods, their options and defaults")
    methods.add_argument("--json", action="store_true")
    _add_bench(sub)
    _add_sweep(sub)
    _add_train_verifier(sub)
    _add_theory(sub)
    _add_train_data(sub)
    _add_distill(sub)
    models = sub.add_parser("models", help="list the default models and what is cached")
    models.add_argument("--verify", action="store_true", help="recompute SHA-256 of cached files")
    return parser


_COMMANDS = {"generate": _run_generate, "methods": _run_methods, "bench": _run_bench, "sweep": _run_sweep,
             "train-verifier": _run_train_verifier, "theory": _run_theory,
             "models": _run_models,
             "train-data": _run_train_data, "distill": _run_distill}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would interleave with the output
    hf_logging.set_verbosity_error()  # per-call deprecation notices from generate() would flood the bench
    try:
        return _COMMANDS[args.command](args)
    except DraftwiseError as error:
        print(f"draftwise: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
