"""Benchmark arithmetic: raw per-run records in, the reported metrics out (pure functions).

Conventions (as vLLM and Spec-Bench report them):
- tokens/s of a method = its new tokens over all prompts / its wall time over all
  prompts, per repeat; the reported value is the median over repeats.
- speedup_vs_ar = tokens/s of the method / tokens/s of `ar` from the same run.
- mean_accepted_length = new tokens / target calls (bonus or recovered token included;
  `ar` = 1.0); reported a second time as `block_efficiency`, the MTAD paper's name for it.
- energy_j_per_token = joules / new tokens per repeat, median over repeats, where the
  machine exposes a counter (bench.energy); None otherwise.
- acceptance_rate = accepted / drafted (drafted = draft tokens sent to verification).
- accepted_per_position[i] = fraction of verification steps that drafted a token at
  position i in which that token was accepted.
- quality (when scored): the target's perplexity and greedy agreement over all output
  tokens; ROUGE-2 (mean over summarization prompts) and corpus BLEU (translation prompts).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from draftwise.bench.quality import corpus_bleu, perplexity, rouge2, rouge_l, rouge_n


@dataclass
class RunRecord:
    method: str
    repeat: int
    question_id: int
    category: str
    new_tokens: int
    wall_time_s: float
    target_calls: int
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    verifier_calls: int = 0  # SPRINTER / SpecDec++ head evaluations
    verifier_accepted: int = 0  # drafted tokens the SPRINTER verifier passed (kept without target verification)
    energy_j: float | None = None  # joules over the run, where the machine has a counter (bench.energy)
    # quality (filled when scored; see bench.quality)
    nll: float = 0.0
    scored_tokens: int = 0
    agree: int = 0
    text: str = ""  # decoded output, kept only where a reference exists
    reference: str | None = None
    passed: bool | None = None  # HumanEval: the answer's code passed the problem's tests (bench.execution)


def _sum_lists(lists: list[list[int]]) -> list[int]:
    width = max((len(x) for x in lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(width)]


def summarize(records: list[RunRecord]) -> dict:
    """Metrics of one method over `records` (all repeats, all prompts)."""
    if not records:
        raise ValueError("no records to summarize")
    repeats = sorted({r.repeat for r in records})
    per_repeat_tps = []
    for rep in repeats:
        runs = [r for r in records if r.repeat == rep]
        wall = sum(r.wall_time_s for r in runs)
        per_repeat_tps.append(sum(r.new_tokens for r in runs) / wall if wall > 0 else 0.0)
    new_tokens = sum(r.new_tokens for r in records)
    target_calls = sum(r.target_calls for r in records)
    energy = None
    if all(r.energy_j is not None for r in records):
        per_repeat = [sum(r.energy_j for r in records if r.repeat == rep) /
                      max(sum(r.new_tokens for r in records if r.repeat == rep), 1) for rep in repeats]
        energy = statistics.median(per_repeat)
    drafted = sum(r.drafted for r in records)
    accepted = sum(r.accepted for r in records)
    acc_pos = _sum_lists([r.accepted_per_position for r in records])
    dra_pos = _sum_lists([r.drafted_per_position for r in records])
    out = {
        "tokens_per_s": statistics.median(per_repeat_tps),
        "tokens_per_s_per_repeat": per_repeat_tps,
        "new_tokens": new_tokens,
        "mean_accepted_length": new_tokens / target_calls if target_calls else 0.0,
        # the MTAD paper's block efficiency: tokens per target call (the same number; MTJD runs k calls per block)
        "block_efficiency": new_tokens / target_calls if target_calls else 0.0,
        "energy_j_per_token": energy,  # median over repeats; None where no counter could be read
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "accepted_per_position": [a / d if d else 0.0 for a, d in zip(acc_pos, dra_pos)],
        "target_calls_per_token": target_calls / new_tokens if new_tokens else 0.0,
        "draft_calls_per_token": sum(r.draft_calls for r in records) / new_tokens if new_tokens else 0.0,
        "drafted": drafted,
        "accepted": accepted,
        "target_calls": target_calls,
        # lossy methods: rejection = 1 - acceptance; deferral = share of tokens the target produced
        # (recovered or bonus; for token-cascade the tokens sampled from p, for seq-cascade whole answers)
        "rejection_rate": 1.0 - accepted / drafted if drafted else 0.0,
        "deferral_rate": 1.0 - accepted / new_tokens if new_tokens else 0.0,
    }
    verifier_calls = sum(r.verifier_calls for r in records)
    if verifier_calls:
        out["verifier_calls_per_token"] = verifier_calls / new_tokens if new_tokens else 0.0
        out["tokens_without_target_check"] = sum(r.verifier_accepted for r in records) / new_tokens if new_tokens else 0.0
    out.update(quality_fields(records))
    return out


QUALITY_BY_CATEGORY = {"summarization": "rouge2", "translation": "bleu"}


def quality_fields(records: list[RunRecord]) -> dict:
    """perplexity, target_agreement, rouge2 / bleu where scored records carry references, and pass_at_1 where
    records ran their problem's tests (the fraction that passed: one answer a problem and repeat)."""
    fields: dict = {}
    tested = [r.passed for r in records if r.passed is not None]
    if tested:
        fields["pass_at_1"] = sum(tested) / len(tested)
        fields["tested_answers"] = len(tested)
    scored = sum(r.scored_tokens for r in records)
    if not scored:
        return fields
    fields.update({
        "perplexity": perplexity(sum(r.nll for r in records), scored),
        "target_agreement": sum(r.agree for r in records) / scored,
    })
    with_refs = [r for r in records if r.reference is not None]
    if with_refs:  # every reference the prompts carry (SPRINTER's Figure 7 compares with them)
        fields["rouge1_ref"] = statistics.fmean(rouge_n(r.text, r.reference, 1) for r in with_refs)
        fields["rougeL_ref"] = statistics.fmean(rouge_l(r.text, r.reference) for r in with_refs)
    summaries = [r for r in records if r.reference is not None and r.category == "summarization"]
    if summaries:
        fields["rouge2"] = statistics.fmean(rouge2(r.text, r.reference) for r in summaries)
    translations = [r for r in records if r.reference is not None and r.category == "translation"]
    if translations:
        fields["bleu"] = corpus_bleu([r.text for r in translations], [r.reference for r in translations])
    return fields


def identical_fraction(records: list[RunRecord], reference: list[RunRecord]) -> float:
    """Fraction of (repeat, prompt) outputs token-identical to the reference method's."""
    ref = {(r.repeat, r.question_id): r.token_ids for r in reference}
    pairs = [(r.token_ids, ref.get((r.repeat, r.question_id))) for r in records]
    pairs = [(a, b) for a, b in pairs if b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0


def pairwise_quality(records: list[RunRecord], reference: list[RunRecord]) -> dict:
    """Each output against the reference method's output for the same (repeat, prompt): ROUGE-1/2/L
    of the texts, and the win-tie rate judged by the target's mean log-likelihood per token
    (higher wins; equal is a tie)."""
    ref = {(r.repeat, r.question_id): r for r in reference}
    pairs = [(r, ref[(r.repeat, r.question_id)]) for r in records if (r.repeat, r.question_id) in ref]
    pairs = [(a, b) for a, b in pairs if a.scored_tokens and b.scored_tokens]
    if not pairs:
        return {}
    def loglik(r: RunRecord) -> float:
        return -r.nll / r.scored_tokens

    return {
        "rouge1": statistics.fmean(rouge_n(a.text, b.text, 1) for a, b in pairs),
        "rouge2": statistics.fmean(rouge_n(a.text, b.text, 2) for a, b in pairs),
        "rougeL": statistics.fmean(rouge_l(a.text, b.text) for a, b in pairs),
        "win_tie_rate": sum(loglik(a) >= loglik(b) - 1e-9 for a, b in pairs) / len(pairs),
        "pairs": len(pairs),
    }


def report(records: list[RunRecord], *, baseline: str = "ar", compare_identical: bool = False,
           compare_to: str | None = None) -> dict:
    """{"<method>": metrics + speedup_vs_ar + per_category}, speedups against `baseline` in the same run."""
    methods = list(dict.fromkeys(r.method for r in records))
    categories = list(dict.fromkeys(r.category for r in records))
    out: dict[str, dict] = {}
    base = [r for r in records if r.method == baseline]
    base_tps = summarize(base)["tokens_per_s"] if base else None
    base_cat = {c: summarize([r for r in base if r.category == c])["tokens_per_s"] for c in categories} if base else {}
    for method in methods:
        mine = [r for r in records if r.method == method]
        metrics = summarize(mine)
        metrics["speedup_vs_ar"] = metrics["tokens_per_s"] / base_tps if base_tps else None
        if compare_identical and base:
            metrics["identical_to_ar"] = identical_fraction(mine, base)
        if compare_to and method != compare_to:
            other = [r for r in records if r.method == compare_to]
            if other:
                metrics[f"vs_{compare_to}"] = pairwise_quality(mine, other)
                metrics[f"speedup_vs_{compare_to}"] = metrics["tokens_per_s"] / summarize(other)["tokens_per_s"]
        per_category = {}
        for c in categories:
            cat_runs = [r for r in mine if r.category == c]
            if cat_runs:
                m = summarize(cat_runs)
                m["speedup_vs_ar"] = m["tokens_per_s"] / base_cat[c] if base_cat.get(c) else None
                m.pop("tokens_per_s_per_repeat")
                per_category[c] = m
        metrics["per_category"] = per_category
        out[method] = metrics
    return out
