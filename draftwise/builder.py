"""Building the engine a plan runs on: one builder per drafter kind (the function a `methods.DrafterKind` names, or
for the built-in kinds `DRAFTER_BUILDERS`), the length policy, the select phase, and `build_engine`."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from draftwise.rules.cascades import sequence_confidence
from draftwise.drafters.base import LookupRowsDrafter, ModelRowsDrafter, NoRowsDrafter
from draftwise.engine.core import Engine
from draftwise.methods import DRAFTERS, METHODS
from draftwise.heads.eagle import DraftHead
from draftwise.drafters.eagle import EagleRowsDrafter
from draftwise.models.runner import ModelRunner, draft_runner
from draftwise.drafters.policies import ConfidenceStop, FixedLength, LengthPolicy, StopBefore, StopHead, VerifierStop
from draftwise.errors import DraftwiseError
from draftwise.plan import Plan
from draftwise.engine.protocols import ScoringDrafter


def build_engine(plan: Plan, max_batch_size: int, *, stream_text: bool = False, prefix_cache_mb: float = 0.0,
                 prefill_first: bool = False) -> Any:
    """The batched engine for a plan: the target's runner, the method's drafter and rule, and a prefix store of
    `prefix_cache_mb` megabytes (0: none); `prefill_first` for a batch whose caller waits for every request (see
    `Engine`). The sequence-level cascade is two engines behind one interface."""
    from draftwise.engine.prefix import PrefixStore

    spec = plan.method
    if spec.loop == "sequence":
        from draftwise.rules.seq_cascade import SequenceCascadeEngine

        draft_plan = dataclasses.replace(plan, target=plan.draft, method=METHODS["ar"], options={})
        aggregate, alpha = plan.options["aggregate"], plan.options["alpha"]
        return SequenceCascadeEngine(
            build_engine(draft_plan, max_batch_size, stream_text=stream_text, prefill_first=prefill_first),
            build_engine(dataclasses.replace(plan, method=METHODS["ar"], options={}), max_batch_size,
                         stream_text=stream_text, prefix_cache_mb=prefix_cache_mb, prefill_first=prefill_first),
            lambda log_probs: sequence_confidence(log_probs, aggregate), 1.0 - alpha, method=spec.name)
    rule = spec.make_rule(plan.options)
    gamma = spec.draft_run(plan.options, plan.gamma)
    drafter = _drafter(plan, rule)
    if rule.bonus_from_pi and not isinstance(drafter, ScoringDrafter):  # checked once, never in the step
        raise DraftwiseError(f"{spec.name}: its rule draws the bonus from pi, and a {spec.drafter!r} drafter cannot "
                             "score the token after its drafts")
    return Engine(ModelRunner(plan.target.model, vocab_size=plan.vocab_size, rows=0), drafter, rule,
                  gamma=gamma, tokenizer=plan.target.tokenizer, max_batch_size=max_batch_size, method=spec.name,
                  stream_text=stream_text, selector=_selector(plan, gamma),
                  prefixes=PrefixStore(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 else None,
                  tree_nodes=int(plan.options.get("tree_nodes", 0)),
                  tree_adaptive=bool(plan.options.get("tree_adaptive", 1)), prefill_first=prefill_first)


def _drafter(plan: Plan, rule: Any) -> Any:
    """The method's drafter over rows: its kind's builder."""
    return drafter_builder(DRAFTERS[plan.method.drafter])(plan, rule)


def drafter_builder(kind: Any) -> Callable[[Plan, Any], Any]:
    """A drafter kind's builder: the function its `builder` names ("module:function"), else the built-in one."""
    if not kind.builder:
        return DRAFTER_BUILDERS[kind.name]
    module, _, name = kind.builder.partition(":")
    return getattr(importlib.import_module(module), name)


def _none(plan: Plan, rule: Any) -> Any:
    return NoRowsDrafter(plan.vocab_size, plan.target.device)


def _model(plan: Plan, rule: Any, *, keep_raw: bool | None = None) -> Any:
    """The draft model's rows drafter, or the EAGLE head's when the draft is a head."""
    keep_raw = rule.needs_draft_raw if keep_raw is None else keep_raw
    if isinstance(plan.draft, DraftHead):
        return EagleRowsDrafter(plan.draft, plan.vocab_size, plan.target.device, eos_token_ids=plan.eos_token_ids,
                                policy=_policy(plan), keep_raw=keep_raw)
    return ModelRowsDrafter(draft_runner(plan.draft, vocab_size=plan.vocab_size), plan.vocab_size,
                            eos_token_ids=plan.eos_token_ids, keep_raw=keep_raw, policy=_policy(plan))


def _ngram(plan: Plan, rule: Any) -> Any:
    return LookupRowsDrafter(plan.vocab_size, plan.target.device, max_ngram=plan.options["max_ngram"],
                             min_ngram=plan.options["min_ngram"], eos_token_ids=plan.eos_token_ids)


def _suffix(plan: Plan, rule: Any) -> Any:
    from draftwise.methods import suffix_options
    from draftwise.drafters.suffix import SuffixRowsDrafter

    return SuffixRowsDrafter(plan.vocab_size, plan.target.device, suffix_options(plan.options),
                             eos_token_ids=plan.eos_token_ids)


def _hybrid(plan: Plan, rule: Any) -> Any:
    from draftwise.drafters.suffix import HybridRowsDrafter

    return HybridRowsDrafter(_model(plan, rule), _suffix(plan, rule), plan.options["threshold"])


def _companion(plan: Plan, rule: Any) -> Any:
    from draftwise.drafters.companion import CompanionRowsDrafter, StagedRowsDrafter

    kind = StagedRowsDrafter if plan.method.drafter == "staged" else CompanionRowsDrafter
    inner = _model(plan, rule, keep_raw=kind is CompanionRowsDrafter)  # SV's companion reads the draft's raw q
    from draftwise.drafters.ngram_companion import companion_runner

    return kind(inner, companion_runner(plan.companion, vocab_size=plan.vocab_size), plan.vocab_size)


def _beams(plan: Plan, rule: Any) -> Any:
    from draftwise.drafters.mtad import BeamRowsDrafter, ModelBeams

    if plan.method.drafter == "target-beam":  # MTJD: the target's weights in a cache of their own
        base: Any = ModelBeams(ModelRunner(plan.target.model, vocab_size=plan.vocab_size, rows=0), plan.vocab_size)
    elif isinstance(plan.draft, DraftHead):
        base = EagleRowsDrafter(plan.draft, plan.vocab_size, plan.target.device)
    else:
        base = ModelBeams(draft_runner(plan.draft, vocab_size=plan.vocab_size), plan.vocab_size)
    return BeamRowsDrafter(base, plan.vocab_size, plan.options["num_beams"])


# One builder per drafter kind (methods.DRAFTERS): (plan, rule) -> the rows drafter.
DRAFTER_BUILDERS = {"none": _none, "model": _model, "sprinter": _model, "stophead": _model, "ngram": _ngram,
                    "suffix": _suffix, "hybrid": _hybrid, "companion": _companion, "staged": _companion,
                    "beam": _beams, "target-beam": _beams}


assert all(k.builder or k.name in DRAFTER_BUILDERS for k in DRAFTERS.values()), "every drafter kind has a builder"


def _selector(plan: Plan, gamma: int) -> Any:
    """The select phase of SV and its history-based baselines (None: verify every drafted token)."""
    from draftwise.selectors.selection import GoodputSelector, HistorySelector, SmartSpecSelector

    kind, profile = plan.method.selector, plan.sv_profile
    lookahead = plan.options.get("lookahead") or None  # 0: always draft gamma
    if kind == "sv":
        return GoodputSelector(profile.table(plan.options["bins"]), profile.latency, lookahead=lookahead,
                               probe=plan.options["probe"])
    if kind == "history":
        return HistorySelector(profile.latency, gamma, lookahead=lookahead, probe=plan.options["probe"])
    if kind == "smartspec":
        return SmartSpecSelector(profile.latency, gamma)
    return None


def _policy(plan: Plan) -> LengthPolicy:
    """The method's length policy: SPRINTER's verifier, SpecDec++'s head, a stop rule, or fixed gamma."""
    spec = plan.method
    if spec.kind.objective:
        drafter_model = plan.target.model if isinstance(plan.draft, DraftHead) else plan.draft.model  # a head
        embedding = drafter_model.get_input_embeddings()  # reads the target's token embeddings
        verifier = plan.verifier.to(plan.target.device)
        if spec.kind.objective == "sprinter":
            return VerifierStop(verifier, plan.options["tau"], embedding)
        return StopHead(verifier, plan.options["threshold"], embedding)
    if spec.draft_stop:
        return StopBefore(spec.draft_stop(plan.options))
    confidence = draft_confidence(plan.options.get("confidence", 0.0), plan.draft)
    if confidence > 0:
        return ConfidenceStop(confidence)
    return FixedLength()


def draft_confidence(option: float, draft: Any) -> float:
    """The confidence threshold in force: the option, or with -1 the EAGLE head's tuned one (0 without one)."""
    if option != -1.0:
        return float(option)
    tuned = (getattr(getattr(draft, "config", None), "dynamic", None) or {}) if isinstance(draft, DraftHead) else {}
    return float(tuned.get("confidence", 0.0))
