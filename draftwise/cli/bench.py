"""`draftwise bench`, `sweep`, `theory` and `profile-sv`: measurements."""

from __future__ import annotations

import argparse
import json
import sys

from draftwise.errors import DraftwiseError
from draftwise.heads.loading import load_draft
from draftwise.models.loading import DTYPE_HELP, load_model
from draftwise.engine.sampling import SamplingConfig
from draftwise.cli.common import DEFAULT_TARGET, floats, parse_option_values, plot_safely, warn_if_fewer


def add_bench(sub: argparse._SubParsersAction) -> None:
    from draftwise.bench.datasets import CATEGORIES, DATASETS, GROUPS
    from draftwise.bench.harness import BenchConfig

    d = BenchConfig(target="")
    p = sub.add_parser("bench", help="measure methods on Spec-Bench prompts (speed, target calls, acceptance)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, local directory, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft for every method that can use it (default: the registry's "
                   "best draft per method for a registry target)")
    p.add_argument("--hf-draft", default=None, help="independent draft for hf-assisted (default: --draft unless it "
                   "is an EAGLE head, else the registry's independent draft)")
    p.add_argument("--methods", default=",".join(d.methods), help="comma-separated; see `draftwise methods`, "
                   "plus hf-assisted and prompt-lookup-hf; a label fixes options for its column: sd/tree_nodes=8, "
                   "sd/gamma=3")
    p.add_argument("--dataset", default=d.dataset, help=f"one of: {', '.join(DATASETS)}")
    p.add_argument("--categories", default="", help=f"comma-separated, default all: {', '.join(CATEGORIES)}, "
                   f"or group {', '.join(GROUPS)}")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--max-new-tokens", "--max-tokens", type=int, default=d.max_new_tokens)
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


def run_bench(args: argparse.Namespace) -> int:
    from draftwise.progress import bar as progress_bar

    from draftwise.bench.datasets import expand_categories, load_prompts
    from draftwise.bench.harness import BenchConfig, check_methods, run_bench
    from draftwise.atomic import write_json
    from draftwise.bench.report import format_table

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    check_methods(methods)
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    if args.dataset != "humaneval":  # HumanEval's one category is checked where its prompts load
        expand_categories(list(categories))
    from draftwise.bench.batched import parse_batch_sizes

    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes is not None else ()
    config = BenchConfig(
        target=args.target, draft=args.draft, hf_draft=args.hf_draft, methods=methods, dataset=args.dataset,
        categories=categories, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, gamma=args.gamma, repeats=args.repeats,
        warmup=args.warmup, dtype=args.dtype, device=args.device, seed=args.seed, threads=args.threads,
        method_options=parse_option_values(args.option), quality=args.quality,
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
    warn_if_fewer(n_prompts, config.num_prompts, config.dataset, categories)
    from draftwise.bench.harness import plan_drafts

    plan_drafts(config)  # every method and its draft checked before any model loads
    runs = len(batch_sizes) if batch_sizes else n_prompts  # a batched run decodes every prompt at once
    with progress_bar(total=runs * len(methods) * config.repeats, desc="bench", unit="run") as bar:
        results = run_bench(config, progress=bar.update)
    if batch_sizes:
        from draftwise.bench.batched import format_batched_table

        print(format_batched_table(results["batched"]))
    else:
        print(format_table(results))
        _advice(results)
    if args.json:
        write_json(results, args.json)
        print(f"wrote {args.json}")
    if args.plot:  # after the JSON: a plotting failure never loses the results
        from draftwise.bench.report import plot, plot_batched

        draw = plot_batched if batch_sizes else plot
        plot_safely(lambda: draw(results, args.plot), args)
    return 0


def _advice(results: dict) -> None:
    """The advice line under the table, and its record for the default method (`bench.advice`)."""
    advice = results.get("advice")
    if not advice:
        return
    print(advice["line"])
    from draftwise.bench.advice import write_record

    path = write_record(results, advice)
    if path is not None:
        results["advice"]["record"] = str(path)
        config = results["config"]
        pair = f"{config['target']}" + (f" with --draft {config['draft']}" if config.get("draft") else "")
        when = "at temperature 0" if not config["temperature"] else "at temperatures above 0"
        print(f"recorded in {path}: without --method, {pair} decodes with {advice['method']} on this machine {when}")


def add_sweep(sub: argparse._SubParsersAction) -> None:
    from draftwise.bench.datasets import CATEGORIES, DATASETS
    from draftwise.bench.sweep import SweepConfig

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


def run_sweep(args: argparse.Namespace) -> int:
    from draftwise.progress import bar as progress_bar

    from draftwise.bench.datasets import expand_categories, load_prompts
    from draftwise.atomic import write_json
    from draftwise.bench.sweep import SweepConfig, format_sweep, plot_sweep, run_sweep, sweep_labels

    grids = {}
    for item in args.grid or []:
        label, sep, values = item.partition("=")
        if not sep:
            raise DraftwiseError(f"--grid takes LABEL=A,B,C, got {item!r}")
        grids[label.strip()] = floats(values, f"--grid {label}")
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    if args.dataset == "humaneval" and categories == SweepConfig.__dataclass_fields__["categories"].default:
        categories = ()  # the default categories are Spec-Bench's; HumanEval has one
    if args.dataset != "humaneval":
        expand_categories(list(categories))
    config = SweepConfig(
        target=args.target, draft=args.draft, methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        alpha_grid=floats(args.alpha_grid, "--alpha-grid"), grids=grids,
        temperatures=floats(args.temperatures, "--temperatures"), dataset=args.dataset, categories=categories,
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, top_k=args.top_k, top_p=args.top_p,
        gamma=args.gamma, repeats=args.repeats, warmup=args.warmup, dtype=args.dtype, device=args.device,
        seed=args.seed, threads=args.threads,
    )
    for t in config.temperatures:
        SamplingConfig(t, config.top_k, config.top_p)
    labels = sweep_labels(config)
    n_prompts = len(load_prompts(config.dataset, categories=list(categories) or None, num_prompts=config.num_prompts))
    warn_if_fewer(n_prompts, config.num_prompts, config.dataset, categories)
    total = n_prompts * len(labels) * config.repeats * len(config.temperatures)
    with progress_bar(total=total, desc="sweep", unit="run") as bar:
        result = run_sweep(config, progress=bar.update)
    print(format_sweep(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot_sweep(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def add_theory(sub: argparse._SubParsersAction) -> None:
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


def run_theory(args: argparse.Namespace) -> int:
    from draftwise import theory
    from draftwise.atomic import write_json

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
    from draftwise.models import registry
    from draftwise.models.loading import resolve_path
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
        from draftwise.heads.sprinter import Verifier

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


def add_profile_sv(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile-sv", help="build Speculative Verification's profile: P(accept | S, A), information "
                       "gain, and this machine's verification latency (Kim et al. §4, §7.4, D.10)")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=None, help="draft model (default: the registry's independent draft)")
    p.add_argument("--companion", default=None, help="companion model, or an n-gram companion: 'ngram' (each row's "
                   "context), 'ngram:DIR' (plus the target's answers in DIR) (default: the registry's companion)")
    p.add_argument("--out", required=True, help="profile JSON (written atomically)")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampling setting the profile is for (0: greedy)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--gamma", type=int, default=5, help="draft tokens per step while profiling (and the most sv verifies)")
    p.add_argument("--num-prompts", type=int, default=64, help="Spec-Bench training-split prompts (never evaluation ones)")
    p.add_argument("--max-new-tokens", "--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--latency-rows", default="1,2,4,8,16,32", help="batch sizes whose latency is profiled")
    p.add_argument("--context", type=int, default=256, help="tokens already in each row while latency is timed")
    p.add_argument("--latency-from", default=None, metavar="PROFILE",
                   help="reuse another profile's latency model (same machine and models) instead of timing again")
    p.add_argument("--latency-only", action="store_true",
                   help="time the latency again (this machine) and rewrite --out's latency model, keeping its samples' "
                   "tables and report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")


def run_profile_sv(args: argparse.Namespace) -> int:
    import platform
    import time

    import torch
    from tqdm import tqdm

    from draftwise.selectors import sv
    from draftwise.plan import check_same_tokenizer
    from draftwise.bench.batched import parse_batch_sizes
    from draftwise.bench.datasets import load_prompts
    from draftwise.bench.harness import encode_bench_prompt
    from draftwise.models import registry
    from draftwise.bench.sv_profile import build_profile, collect_samples, measure_latency
    from draftwise.drafters.ngram_companion import load_companion

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
    companion = load_companion(companion_name, target, dtype=args.dtype)
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
    prompts = [encode_bench_prompt(target, p) for p in load_prompts(split="train", num_prompts=args.num_prompts)]
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
