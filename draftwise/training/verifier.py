"""`draftwise train-verifier`: SPRINTER's verifier (Zhong et al. §3.2).

Data. For each training prompt (Spec-Bench outside the evaluation split, chat-formatted) four
token sequences give the four kinds of prefix of §3.2, in equal numbers:
  a. the original prefix: positions inside the prompt itself;
  b. the prompt completed by the draft model (draft-only sampling; not for a feature head, which
     cannot decode without the target);
  c. the prompt completed by the target model (target-only sampling);
  d. the prompt completed by both: speculative decoding's output interleaves draft tokens it
     kept with target tokens it drew.
Completions use the decoding-time sampling (temperature, top-k, top-p). One forward of each
model over a sequence gives every prefix in it; at each chosen prefix a token x ~ S(q) is
drawn and the features of every kind (`sprinter.FEATURES`) plus S(q)(x) and S(p)(x) are kept,
so labels `1 iff S(q)(x) / S(p)(x) <= lambda` can be made for any lambda afterwards.

Training. Train / validation / test splits are by prompt. Features are standardised on the
training split; the model is linear + sigmoid (or a small MLP), Adam, binary cross-entropy with
the positive class weighted by n_neg / n_pos, early stopping on validation loss. The report
holds ROC-AUC on the test split and TPR / FPR at tau.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from draftwise.errors import DraftwiseError
from draftwise.models.runner import full_vocabulary_logits
from draftwise.engine.sampling import SamplingConfig, make_generator, sample, unwarped, warp
from draftwise.heads.sprinter import FEATURES, Verifier, VerifierSpec, draft_fingerprint, verifier_features
from draftwise.atomic import save_torch as atomic_save

KINDS = ("prompt", "draft", "target", "mixed")


@dataclass(frozen=True)
class VerifierDataConfig:
    continuation: int = 48  # tokens per completion
    per_kind: int = 12  # prefixes per kind per prompt
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    gamma: int = 4  # for the mixed (speculative decoding) completions
    seed: int = 0


@torch.inference_mode()
def _head_outputs(target, head, ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A feature head's first-step outputs over a sequence, as when it drafts after each prefix: row i reads the
    target's features at position i and token i + 1 and predicts token i + 2. Returns the head's states [T-1, H]
    and full-vocabulary logits [T-1, vocab] (-inf outside its draft vocabulary)."""
    from draftwise.models.runner import ModelRunner

    runner = ModelRunner(target.model, vocab_size=vocab_size, rows=0)
    runner.feature_layers = head.feature_layers
    n = int(ids.shape[0])
    features = head.take_features(runner.forward_rows(ids[None], [n], hidden=True).hidden[0])  # [T, F]
    body = ModelRunner(head.body, rows=0)
    states = body.forward_states(head.step_input(features[None, :-1], ids[None, 1:].to(features.device)), [n - 1])[0]
    usable = head.vocab_ids < vocab_size
    logits = full_vocabulary_logits(head.logits(states)[:, usable], head.vocab_ids[usable], vocab_size)
    return states, logits


FIELDS = ("hidden", "embedding", "stats", "q_x", "p_x", "prompt", "kind")
PART_VERSION = 2  # 2: labelling forwards share the prompt (other float rounding than 1)


@torch.inference_mode()
def collect(target, draft, prompts: Sequence[list[int]], config: VerifierDataConfig, *, vocab_size: int,
            progress: Callable[[int], None] | None = None, parts: Path | None = None,
            meta: dict | None = None, timings: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """Verifier examples from `prompts` (token ids): a dict of tensors, one row per example.

    target, draft: LoadedModel. Keys: hidden, embedding, stats (features), q_x, p_x, prompt, kind.
    parts: a directory where each prompt's examples are written as it finishes (`NNNNN.pt`, atomically, with the
    random generator's state after it); a later call with the same directory and `meta` (the settings) loads those
    prompts instead of collecting them again, so a run cut off resumes where it stopped and gives the data an
    uninterrupted run gives. The parts of the first n prompts serve any run over those n prompts or more.
    timings: accumulates seconds spent decoding ("decode": the ar, sd and draft-only completions) and in the
    labelling forwards ("label"), for the prompts collected in this call.
    """
    generator = make_generator(config.seed)
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in FIELDS}
    stamp = _parts_stamp(parts, meta, config) if parts is not None else None
    decoded: dict[int, dict[str, list[int]]] = {}  # completions of prompts decoded but not yet labelled
    for index, ids in enumerate(prompts):
        path = parts / f"{index:05d}.pt" if parts is not None else None
        part = _load_part(path, stamp, ids) if path is not None else None
        if part is None:
            if index not in decoded:  # decode this prompt and the next unfinished ones together
                chunk = [j for j in range(index, min(len(prompts), index + DECODE_BATCH))
                         if j == index or parts is None or not (parts / f"{j:05d}.pt").exists()]
                decoded.update(zip(chunk, _completions(target, draft, [prompts[j] for j in chunk], chunk, config,
                                                       timings)))
            part = {"data": _prompt_examples(target, draft, index, ids, decoded.pop(index), config, generator,
                                             vocab_size, timings)}
            if path is not None:
                atomic_save({"stamp": stamp, "prompt": list(ids), "data": part["data"],
                             "generator": generator.get_state()}, path)
        else:
            generator.set_state(part["generator"])
        for k in FIELDS:
            if k in part["data"]:
                rows[k].append(part["data"][k])
        if progress:
            progress(1)
    if not rows["q_x"]:
        raise DraftwiseError("no verifier examples were collected (empty prompts?)")
    return {k: torch.cat(v) for k, v in rows.items()}


def _parts_stamp(parts: Path, meta: dict | None, config: VerifierDataConfig) -> str:
    """The settings a parts directory was collected with (written once as stamp.json; a different one is an
    error, so parts of two settings never mix)."""
    import json

    from draftwise.atomic import write_text

    settings = {k: v for k, v in (meta or {}).items() if k != "num_prompts"} | vars(config)
    stamp = hashlib.sha256(json.dumps({"version": PART_VERSION, **settings}, sort_keys=True,
                                      default=str).encode()).hexdigest()[:16]
    parts.mkdir(parents=True, exist_ok=True)
    written = parts / "stamp.json"
    if written.exists():
        try:
            old = json.loads(written.read_text()).get("stamp")
        except (OSError, ValueError, AttributeError):
            old = None
        if old != stamp:
            raise DraftwiseError(f"{parts} holds verifier data collected with other settings (see its stamp.json): "
                                 "give another --data path or remove that directory")
    else:
        write_text(written, json.dumps({"stamp": stamp, **settings}, sort_keys=True, default=str, indent=1) + "\n")
    return stamp


def _load_part(path: Path, stamp: str, ids: Sequence[int]) -> dict | None:
    """A prompt's finished part, or None if it has none yet; a part of another prompt or setting is an error."""
    if not path.exists():
        return None
    try:
        part = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a part is written atomically: a damaged one was damaged after, say so
        raise DraftwiseError(f"{path}: not a readable verifier data part ({type(e).__name__}); remove it to "
                             "collect that prompt again") from None
    if part.get("stamp") != stamp or part.get("prompt") != list(ids):
        raise DraftwiseError(f"{path} was collected for another prompt or setting: give another --data path")
    return part


SHARED_PREFIX = True  # the labelling forwards read the prompt once (False: one whole forward per sequence)


@torch.inference_mode()
def _sequence_outputs(loaded, sequences: dict[str, list[int]], prompt_len: int, vocab_size: int, *, hidden: bool
                      ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Per sequence, a model's logits [len, vocab] at every position (-inf outside a draft's restricted output
    vocabulary) and, with `hidden`, its last-layer states [len, H].

    Every sequence starts with the same prompt of `prompt_len` tokens: it is fed once and its cache copied to one
    row per completion, which then feeds only its own tokens (the prompt's share of the labelling forwards was 4x
    before: one whole forward per kind)."""
    from draftwise.models.runner import draft_runner

    if not SHARED_PREFIX:  # the transformers forward over each whole sequence (how examples were made before)
        out = {}
        for kind, seq in sequences.items():
            result = loaded.model(input_ids=torch.tensor([seq], device=loaded.device), output_hidden_states=hidden)
            out[kind] = (result.logits[0, :, :vocab_size], result.hidden_states[-1][0] if hidden else None)
        return out
    runner = draft_runner(loaded, vocab_size=vocab_size)
    device = runner.device
    prompt = next(iter(sequences.values()))[:prompt_len]
    runner.cache.reset_row(0)
    head = runner.forward_rows(torch.tensor([prompt], device=device), [prompt_len], hidden=hidden, prompt=True)
    out = {}
    for row, (kind, seq) in enumerate(sequences.items(), start=1):
        assert seq[:prompt_len] == prompt, "every sequence continues the prompt"
        if len(seq) == prompt_len:
            out[kind] = (head.logits[0], head.hidden[0] if hidden else None)
            continue
        runner.cache.reset_row(row)
        runner.cache.move_row(0, row)  # the prompt's keys and values, copied
        tail = runner.forward_rows(torch.tensor([seq[prompt_len:]], device=device), [len(seq) - prompt_len],
                                   begin=row, hidden=hidden, prompt=True)
        out[kind] = (torch.cat([head.logits[0], tail.logits[0]]),
                     torch.cat([head.hidden[0], tail.hidden[0]]) if hidden else None)
    return out


DECODE_BATCH = 4  # prompts decoded together (one engine per kind of completion); each keeps its own seed


def _completions(target, draft, prompts: Sequence[list[int]], indices: Sequence[int], config: VerifierDataConfig,
                 timings: dict[str, float] | None) -> list[dict[str, list[int]]]:
    """The completions of kinds c (target), d (mixed: sd) and b (draft-only; not for a feature head, which cannot
    decode without the target) of some prompts, decoded as a batch: prompt i with seed `seed * 100_003 +
    indices[i]`, giving the tokens it gives alone (draws are keyed by seed and position, engine/keyed.py)."""
    import time

    from draftwise.heads.eagle import DraftHead

    started = time.perf_counter()
    kinds = [("target", target, None, "ar"), ("mixed", target, draft, "sd")]
    if not isinstance(draft, DraftHead):
        kinds.append(("draft", draft, None, "ar"))
    seeds = [config.seed * 100_003 + i for i in indices]
    out: list[dict[str, list[int]]] = [{} for _ in prompts]
    for kind, model, helper, method in kinds:
        for completion, tokens in zip(out, _decode(model, helper, method, prompts, seeds, config)):
            completion[kind] = tokens
    if timings is not None:
        timings["decode"] = timings.get("decode", 0.0) + time.perf_counter() - started
    return out


def _decode(model, draft, method: str, prompts: Sequence[list[int]], seeds: Sequence[int],
            config: VerifierDataConfig) -> list[list[int]]:
    """`generate(model, prompt, draft=draft, method=method, seed=seed)` for each prompt and its seed, in one engine."""
    import dataclasses

    from draftwise.builder import build_engine
    from draftwise.plan import make_plan, request_for

    plan = make_plan(target=model, prompt=list(prompts[0]), draft=draft, method=method,
                     max_new_tokens=config.continuation, temperature=config.temperature, top_k=config.top_k,
                     top_p=config.top_p, seed=seeds[0], gamma=config.gamma, stop=None, ignore_eos=True,
                     method_options={})
    engine = build_engine(plan, len(prompts), prefill_first=True)
    ids = [engine.submit(dataclasses.replace(request_for(plan, list(p)), seed=seed)) for p, seed in zip(prompts, seeds)]
    engine.run()
    return [list(engine.result(i).token_ids) for i in ids]


def _prompt_examples(target, draft, index: int, ids: list[int], completions: dict[str, list[int]],
                     config: VerifierDataConfig, generator: torch.Generator, vocab_size: int,
                     timings: dict[str, float] | None) -> dict[str, torch.Tensor]:
    """One prompt's examples (every kind) from its completions, drawing prefixes and tokens from `generator`."""
    import time

    from draftwise.heads.eagle import DraftHead

    sampling = SamplingConfig(config.temperature, config.top_k, config.top_p)
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in FIELDS}
    is_head = isinstance(draft, DraftHead)
    embedding = (target.model if is_head else draft.model).get_input_embeddings()  # a head reads the target's
    device = target.device if is_head else draft.device
    decoded = time.perf_counter()
    sequences = {"prompt": list(ids)} | {k: list(ids) + v for k, v in completions.items()}
    target_out = _sequence_outputs(target, sequences, len(ids), vocab_size, hidden=False)
    draft_out = None if is_head else _sequence_outputs(draft, sequences, len(ids), vocab_size, hidden=True)
    for kind_index, kind in enumerate(KINDS):
        if kind not in sequences:
            continue
        seq = sequences[kind]
        # prefix lengths: inside the prompt (its second half) for kind a, inside the completion otherwise;
        # a head predicts from the second position on (it reads the target's features of the one before)
        low, high = (max(1 + is_head, len(ids) // 2), len(ids)) if kind == "prompt" else (len(ids), len(seq))
        if high <= low:
            continue
        count = min(config.per_kind, high - low)
        ends = (low + torch.randperm(high - low, generator=generator)[:count]).sort().values  # prefix lengths
        t_logits = target_out[kind][0]
        rows_at = ends - 1  # the row that predicts the token after the prefix
        if is_head:
            states, q_all = _head_outputs(target, draft, torch.tensor(seq, device=device), vocab_size)
            hidden, q_logits = states[rows_at - 1], q_all[rows_at - 1]  # head row i predicts token i + 2
        else:
            d_logits, d_hidden = draft_out[kind]
            hidden, q_logits = d_hidden[rows_at.to(d_hidden.device)], d_logits[rows_at.to(d_logits.device)]
        if getattr(draft, "output_ids", None) is not None:  # a restricted output vocabulary, as when decoding
            out_ids = draft.output_ids.to(q_logits.device)
            q_logits = full_vocabulary_logits(q_logits[:, out_ids], out_ids, q_logits.shape[-1])
        q_w, p_w = warp(q_logits, sampling), warp(t_logits[rows_at.to(t_logits.device)], sampling)
        x = q_w.argmax(-1) if sampling.greedy else sample(q_w, generator)  # [count]
        feats = {name: verifier_features((name,), hidden, x, unwarped(q_logits), embedding)
                 for name in FEATURES}
        for name in FEATURES:
            rows[name].append(feats[name].cpu())
        rows["q_x"].append(q_w.gather(-1, x[:, None]).squeeze(-1).double().cpu())
        rows["p_x"].append(p_w.gather(-1, x[:, None].to(p_w.device)).squeeze(-1).double().cpu())
        rows["prompt"].append(torch.full((count,), index, dtype=torch.long))
        rows["kind"].append(torch.full((count,), kind_index, dtype=torch.long))
    if timings is not None:
        timings["label"] = timings.get("label", 0.0) + time.perf_counter() - decoded
    return {k: torch.cat(v) for k, v in rows.items() if v}


def labels(data: dict[str, torch.Tensor], lam: float) -> torch.Tensor:
    """1 iff S(q)(x) / S(p)(x) <= lambda, written without the division (p(x) may be 0)."""
    return (data["q_x"] <= lam * data["p_x"]).float()


def split_by_prompt(prompts: torch.Tensor, seed: int = 0, fractions=(0.7, 0.15)) -> dict[str, torch.Tensor]:
    """Boolean masks train / val / test: every example of a prompt falls in one split (by hash)."""
    def bucket(i: int) -> float:
        return int(hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()[:8], 16) / 16**8

    where = {int(i): bucket(int(i)) for i in prompts.unique()}
    u = torch.tensor([where[int(i)] for i in prompts])
    train = u < fractions[0]
    val = (u >= fractions[0]) & (u < fractions[0] + fractions[1])
    return {"train": train, "val": val, "test": ~(train | val)}


def roc_curve(scores: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fpr, tpr, thresholds), thresholds descending; ties share one point."""
    order = torch.argsort(scores, descending=True)
    s, y = scores[order].double(), truth[order].double()
    tps, fps = torch.cumsum(y, 0), torch.cumsum(1 - y, 0)
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]  # the last index of each run of equal scores
    pos, neg = max(float(y.sum()), 1.0), max(float((1 - y).sum()), 1.0)
    tpr = torch.cat([torch.zeros(1, dtype=torch.float64), tps[last] / pos])
    fpr = torch.cat([torch.zeros(1, dtype=torch.float64), fps[last] / neg])
    return fpr, tpr, torch.cat([torch.tensor([math.inf], dtype=torch.float64), s[last]])


def roc_auc(scores: torch.Tensor, truth: torch.Tensor) -> float:
    """Area under the ROC curve (trapezoids; 0.5 for a constant score)."""
    if truth.min() == truth.max():
        raise DraftwiseError("ROC-AUC needs both classes among the examples")
    fpr, tpr, _ = roc_curve(scores, truth)
    return float(torch.trapezoid(tpr, fpr))


def rates_at(scores: torch.Tensor, truth: torch.Tensor, tau: float) -> tuple[float, float]:
    """(TPR, FPR) of `score >= tau`: TPR over acceptable tokens, FPR over unacceptable ones."""
    predicted = scores >= tau
    pos, neg = truth > 0.5, truth <= 0.5
    tpr = float(predicted[pos].float().mean()) if pos.any() else float("nan")
    fpr = float(predicted[neg].float().mean()) if neg.any() else float("nan")
    return tpr, fpr


@dataclass(frozen=True)
class VerifierTrainConfig:
    lam: float = 1.2
    # hidden + stats: the best validation ROC-AUC of the ablation in benchmarks/README.md (hidden alone is the paper's)
    features: tuple[str, ...] = ("hidden", "stats")
    arch: str = "linear"
    mlp_width: int = 64
    lr: float = 1e-3
    batch_size: int = 512
    max_epochs: int = 200
    patience: int = 10
    tau: float = 0.5
    seed: int = 0
    objective: str = "sprinter"  # "sprinter": 1 iff q/p <= lambda; "acceptance": SpecDec++'s min(1, p/q)


def targets(data: dict[str, torch.Tensor], config: VerifierTrainConfig) -> torch.Tensor:
    """Training targets: SPRINTER's hard labels, or the acceptance probability min(1, p(x)/q(x))."""
    if config.objective == "sprinter":
        return labels(data, config.lam)
    if config.objective == "acceptance":
        return torch.clamp(data["p_x"] / data["q_x"], max=1.0).float()
    raise DraftwiseError(f"objective must be 'sprinter' or 'acceptance', got {config.objective!r}")


def train(data: dict[str, torch.Tensor], config: VerifierTrainConfig, spec_base: dict) -> tuple[Verifier, dict]:
    """Fit one verifier; returns it and a report (ROC on the test split, TPR / FPR at tau)."""
    unknown = [f for f in config.features if f not in FEATURES]
    if unknown or not config.features:
        raise DraftwiseError(f"unknown verifier feature(s) {unknown}; choose from: {', '.join(FEATURES)}")
    x = torch.cat([data[f] for f in config.features], dim=-1).float()
    y = targets(data, config)
    truth = labels(data, config.lam)  # ROC and rates are against the hard labels in both objectives
    splits = split_by_prompt(data["prompt"], config.seed)
    for name, mask in splits.items():
        one_class = bool(mask.any()) and bool(truth[mask].min() == truth[mask].max())
        if not mask.any() or (one_class and config.objective == "sprinter"):
            raise DraftwiseError(f"the {name} split has no examples or one class only: collect from more prompts")
    spec = VerifierSpec(features=tuple(config.features), input_size=x.shape[1], lam=config.lam, arch=config.arch,
                        mlp_width=config.mlp_width, **spec_base)
    torch.manual_seed(config.seed)
    verifier = Verifier(spec)
    train_x, train_y = x[splits["train"]], y[splits["train"]]
    verifier.mean.copy_(train_x.mean(0))
    verifier.std.copy_(train_x.std(0).clamp_min(1e-6))
    positives = float(train_y.sum())
    pos_weight = torch.tensor((len(train_y) - positives) / max(positives, 1.0))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    optimizer = torch.optim.Adam(verifier.net.parameters(), lr=config.lr)
    best, best_state, stale = math.inf, None, 0
    order_gen = torch.Generator().manual_seed(config.seed)
    epochs = 0
    for epochs in range(1, config.max_epochs + 1):
        verifier.train()
        perm = torch.randperm(train_x.shape[0], generator=order_gen)
        for start in range(0, len(perm), config.batch_size):
            batch = perm[start : start + config.batch_size]
            loss = loss_fn(verifier.logit(train_x[batch]), train_y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        verifier.eval()
        with torch.no_grad():
            val_loss = float(loss_fn(verifier.logit(x[splits["val"]]), y[splits["val"]]))
        if val_loss < best - 1e-5:
            best, stale = val_loss, 0
            best_state = {k: v.clone() for k, v in verifier.state_dict().items()}
        else:
            stale += 1
            if stale >= config.patience:
                break
    verifier.load_state_dict(best_state)
    verifier.eval()
    with torch.no_grad():
        scores = {name: verifier(x[mask]) for name, mask in splits.items()}
    test_y = truth[splits["test"]]
    tpr, fpr = rates_at(scores["test"], test_y, config.tau)
    roc_fpr, roc_tpr, _ = roc_curve(scores["test"], test_y)

    def auc(name: str) -> float | None:  # None where a split holds one class (possible for the acceptance head)
        labels_here = truth[splits[name]]
        return roc_auc(scores[name], labels_here) if labels_here.min() != labels_here.max() else None

    report = {
        "lambda": config.lam, "features": list(config.features), "arch": config.arch,
        "parameters": verifier.num_parameters, "epochs": epochs, "val_loss": best,
        "examples": {name: int(mask.sum()) for name, mask in splits.items()},
        "objective": config.objective,
        "positive_fraction": {name: float(truth[mask].mean()) for name, mask in splits.items()},
        "roc_auc_val": auc("val"), "roc_auc_test": auc("test"),
        "tau": config.tau, "tpr_at_tau": tpr, "fpr_at_tau": fpr,
        "roc_test": {"fpr": roc_fpr.tolist(), "tpr": roc_tpr.tolist()},
    }
    verifier = Verifier(VerifierSpec(**{**spec.__dict__, "extra": {k: v for k, v in report.items() if k != "roc_test"}}))
    verifier.load_state_dict(best_state)
    return verifier.eval(), report


def spec_base(draft, draft_name: str, config: VerifierDataConfig, target=None, target_name: str = "") -> dict:
    base = {"draft_fingerprint": draft_fingerprint(getattr(draft, "model", draft)), "draft_name": draft_name,
            "temperature": config.temperature, "top_k": config.top_k, "top_p": config.top_p}
    if target is not None:
        base.update(target_fingerprint=draft_fingerprint(target.model), target_name=target_name)
    return base


def save_data(data: dict[str, torch.Tensor], meta: dict, path: Path) -> None:
    atomic_save({"meta": meta, "data": data}, path)


def load_data(path: Path, meta: dict) -> dict[str, torch.Tensor] | None:
    """Cached examples if `path` holds some collected with the same settings (else None)."""
    if not path.exists():
        return None
    blob = torch.load(path, map_location="cpu", weights_only=True)
    return blob["data"] if blob.get("meta") == meta else None


def plot_roc(reports: list[dict], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    for r in reports:
        ax.plot(r["roc_test"]["fpr"], r["roc_test"]["tpr"],
                label=f"lambda={r['lambda']:g} (AUC {r['roc_auc_test']:.3f})")
        ax.scatter([r["fpr_at_tau"]], [r["tpr_at_tau"]], s=15)
    ax.plot([0, 1], [0, 1], color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("false-positive rate (unacceptable tokens accepted)")
    ax.set_ylabel("true-positive rate (acceptable tokens accepted)")
    ax.set_title(title or "SPRINTER verifier ROC (test split); dots: tau", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
