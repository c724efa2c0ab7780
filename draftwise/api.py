"""The Python API: `generate` and `stream`.

Both take the same arguments; every check on them runs before any model does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import os
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .cascades import sequence_confidence
from .errors import DraftwiseError, DraftwiseWarning
from .engine import (MAX_LOGPROBS, Engine, LookupRowsDrafter, ModelRowsDrafter, NoRowsDrafter, Request, Result,
                     TokenLogprob, kv_bytes_per_token)
from .methods import DRAFTERS, MAX_GAMMA, METHODS, Method, get_method
from .eagle import DraftHead
from .grammar import Grammar, compiler_for, grammar_from
from .eagle_rows import EagleRowsDrafter
from .models import registry
from .models.loading import LoadedModel, is_eagle_spec, load_draft, load_model
from .models.runner import ModelRunner, draft_runner
from .policies import ConfidenceStop, FixedLength, LengthPolicy, StopBefore, StopHead, VerifierStop
from .sampling import SamplingConfig


@dataclass
class Generation:
    token_ids: list[int]  # new tokens only (an end-of-sequence token that ended generation included)
    text: str  # decoded new tokens, special tokens skipped, cut before a matched stop string
    stats: dict[str, Any]
    logprobs: list[TokenLogprob] | None = None  # per new token, when asked (`logprobs=k`)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (None for the first), when asked

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target call, bonus/recovered token included (`ar` = 1.0)."""
        return self.stats["new_tokens"] / max(self.stats["target_calls"], 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted-and-verified (0 when nothing was drafted)."""
        return self.stats["accepted"] / self.stats["drafted"] if self.stats["drafted"] else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "stats": self.stats,
            "rates": {"mean_accepted_length": self.mean_accepted_length, "acceptance_rate": self.acceptance_rate},
            **({"logprobs": [t.to_dict() for t in self.logprobs]} if self.logprobs is not None else {}),
            **({"prompt_logprobs": [t and t.to_dict() for t in self.prompt_logprobs]}
               if self.prompt_logprobs is not None else {}),
        }


@dataclass(frozen=True)
class _Plan:
    """A validated request: everything `decode` needs, checked before any model runs."""

    target: LoadedModel
    draft: LoadedModel | DraftHead | None
    method: Method
    options: dict[str, Any]
    sampling: SamplingConfig
    gamma: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop: tuple[str, ...]
    eos_token_ids: frozenset[int]
    vocab_size: int
    seed: int | None
    verifier: Any = None  # SPRINTER's verifier or SpecDec++'s head, loaded and checked with the plan
    context_limited: bool = False  # max_new_tokens was cut to fit the context window: finish_reason "context"
    window: int = 10**12  # the smallest context window of the models the plan runs
    requested_new_tokens: int = 0  # max_new_tokens as asked, before the window cut (other prompts of a batch)
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    companion: LoadedModel | None = None  # SV's companion / staged SD's intermediate model
    sv_profile: Any = None  # sv.SVProfile: P(accept | S, A) and the latency model of the select phase


def generate(
    target: Any,
    prompt: Any = None,
    *,
    messages: Any = None,
    draft: Any = None,
    method: str = "sd",
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    gamma: int = 4,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    grammar: Any = None,
    response_format: Any = None,
    max_batch_size: int = 16,
    kv_budget_mb: float | None = None,
    prefix_cache_mb: float = 0.0,
    **method_options: Any,
) -> Generation | list[Generation]:
    """Decode `prompt` with `method`; returns the new tokens, their text and the step counters.

    A list of prompts (strings, token-id lists, chats) is decoded batched, `max_batch_size` rows at a
    time with continuous batching, and returns a list of `Generation`s in prompt order. `seed` seeds
    every request alike: request i gives the same tokens as `generate(target, prompts[i], seed=seed)`,
    except for methods whose select phase or draft length is decided over the batch (`sv`,
    `adaptive-verify`, `smartspec`): at temperature > 0 their tokens (not their distribution) depend on
    the batch-mates.
    `kv_budget_mb` bounds the target's KV cache: a request joins only when its prompt plus
    `max_new_tokens` fits beside the live ones (one request always runs, whatever its size).
    `logprobs=k` gives each new token's log-probability under the target and its k most likely tokens
    (`Generation.logprobs`), read from the verification forward; `prompt_logprobs=k` the same for the prompt.
    Both are the target's raw log-softmax (before temperature, top-k / top-p and penalties).
    `prefix_cache_mb` (a list of prompts) keeps that many megabytes of prompt prefixes' keys and values: a
    request admitted after another with the same prefix (64-token blocks) copies it instead of prefilling
    (`stats["cached_tokens"]`).
    `grammar` ({"json_schema": {...}}, {"json_object": True}, {"regex": "..."} or {"lark": "..."}) or OpenAI's
    `response_format` constrains every new token: the target's and the draft's logits are masked at every
    position, so a lossless method is exact towards the masked target distribution.
    """
    prompts, batch = _split_prompts(messages if prompt is None and messages is not None else prompt)
    if prompt is not None and messages is not None:
        raise DraftwiseError("give a prompt or messages=..., not both")
    _check_batch_size(max_batch_size)
    if kv_budget_mb is not None and (not isinstance(kv_budget_mb, (int, float)) or isinstance(kv_budget_mb, bool)
                                     or not kv_budget_mb > 0):
        raise DraftwiseError(f"kv_budget_mb must be a number > 0 (megabytes), got {kv_budget_mb!r}")
    if not isinstance(prefix_cache_mb, (int, float)) or isinstance(prefix_cache_mb, bool) \
            or not 0 <= prefix_cache_mb < float("inf"):
        raise DraftwiseError(f"prefix_cache_mb must be a number >= 0 (megabytes; 0: off), got {prefix_cache_mb!r}")
    for other in prompts[1:]:
        _check_prompt(other)
    _check_processors(repetition_penalty, min_new_tokens, logprobs, prompt_logprobs)
    constraint = grammar_from(grammar, response_format=response_format)
    plan = _plan(target=target, prompt=prompts[0], draft=draft, method=method, max_new_tokens=max_new_tokens,
                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, gamma=gamma, stop=stop,
                 ignore_eos=ignore_eos, method_options=method_options)
    plan = _with_processors(plan, repetition_penalty, min_new_tokens, logprobs, prompt_logprobs, constraint)
    if not batch:
        run = _Run(plan, streaming=False)
        for _ in run.pieces():
            pass
        return run.result()
    requests = [_request(plan, plan.prompt_ids)] + [
        _request(plan, _prompt_ids(p, plan.target, plan.vocab_size)) for p in prompts[1:]]
    engine = build_engine(plan, max_batch_size, prefix_cache_mb=prefix_cache_mb)
    if kv_budget_mb is not None:
        engine.kv_budget_tokens = int(kv_budget_mb * 2**20 // kv_bytes_per_token(plan.target.model))
    ids = [engine.submit(request) for request in requests]
    cut = [r.max_new_tokens < plan.requested_new_tokens for r in requests]  # the window cut the budget
    if any(cut[1:]):  # the first prompt's cut was announced by _plan
        warnings.warn(f"{sum(cut[1:])} more prompt(s) leave less than max_new_tokens={plan.requested_new_tokens} "
                      f"in the context window of {plan.window} (finish_reason 'context' where that ends them)",
                      DraftwiseWarning, stacklevel=2)
    engine.run()
    out = [_generation(engine.result(i), plan.method) for i in ids]
    for generation, limited in zip(out, cut):
        if limited and generation.stats["finish_reason"] == "length":
            generation.stats["finish_reason"] = "context"
    return out


def stream(
    target: Any,
    prompt: Any = None,
    *,
    messages: Any = None,
    draft: Any = None,
    method: str = "sd",
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    gamma: int = 4,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
    logprobs: int | None = None,
    grammar: Any = None,
    response_format: Any = None,
    events: bool = False,
    **method_options: Any,
) -> Iterator[str] | Iterator[StreamEvent]:
    """Like `generate`, but yields text pieces as tokens are committed; they join to `generate(...).text`.

    With `events=True` it yields `StreamEvent`s instead: each piece of text with the token ids committed
    since the previous event (and their `logprobs`, when asked), and a last event (`finished=True`) carrying
    `finish_reason` and the stats.
    Arguments are checked (and models loaded) here, before the first piece is asked for.
    """
    if prompt is not None and messages is not None:
        raise DraftwiseError("give a prompt or messages=..., not both")
    _check_processors(repetition_penalty, min_new_tokens, logprobs)
    constraint = grammar_from(grammar, response_format=response_format)
    plan = _plan(target=target, prompt=prompt if messages is None else None, messages=messages, draft=draft,
                 method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                 seed=seed, gamma=gamma, stop=stop, ignore_eos=ignore_eos, method_options=method_options)
    run = _Run(_with_processors(plan, repetition_penalty, min_new_tokens, logprobs, grammar=constraint),
               streaming=True)
    return _stream_events(run) if events else run.pieces()


@dataclass(frozen=True)
class StreamEvent:
    """One step of `stream(..., events=True)`."""

    text: str  # new text (may be empty)
    token_ids: list[int]  # tokens committed since the previous event
    finished: bool = False
    finish_reason: str | None = None  # on the last event: "eos", "length", "stop", "context"
    stats: dict[str, Any] | None = None  # on the last event: the same stats as `generate`
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, with `logprobs=k`


def _stream_events(run: "_Run") -> Iterator[StreamEvent]:
    seen = 0

    def logprobs(end: int) -> list[TokenLogprob] | None:
        return None if run.plan.logprobs is None else run.logprobs[seen:end]

    for piece in run.pieces():
        end = len(run.token_ids)
        yield StreamEvent(piece, list(run.token_ids[seen:end]), logprobs=logprobs(end))
        seen = end
    yield StreamEvent("", list(run.token_ids[seen:]), True, run.stats.get("finish_reason"), dict(run.stats),
                      logprobs(len(run.token_ids)))


def _check_logprobs(value: Any, name: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not 0 <= value <= MAX_LOGPROBS):
        raise DraftwiseError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (how many top alternatives "
                             f"to return beside each token's own), got {value!r}")


def _check_processors(repetition_penalty: Any, min_new_tokens: Any, logprobs: Any = None,
                      prompt_logprobs: Any = None) -> None:
    _check_logprobs(logprobs, "logprobs")
    _check_logprobs(prompt_logprobs, "prompt_logprobs")
    if (not isinstance(repetition_penalty, (int, float)) or isinstance(repetition_penalty, bool)
            or not repetition_penalty > 0 or repetition_penalty == float("inf")):
        raise DraftwiseError(f"repetition_penalty must be a number > 0 (1 turns it off), got {repetition_penalty!r}")
    if not isinstance(min_new_tokens, int) or isinstance(min_new_tokens, bool) or min_new_tokens < 0:
        raise DraftwiseError(f"min_new_tokens must be an integer >= 0, got {min_new_tokens!r}")


def _with_processors(plan: _Plan, repetition_penalty: float, min_new_tokens: int, logprobs: int | None = None,
                     prompt_logprobs: int | None = None, grammar: Grammar | None = None) -> _Plan:
    """The plan with its logits processors, log-probability requests and grammar, refused (with the reason)
    where the method cannot apply them."""
    asked = [name for name, on in (("repetition_penalty", repetition_penalty != 1.0),
                                   ("min_new_tokens", min_new_tokens != 0), ("logprobs", logprobs is not None),
                                   ("prompt_logprobs", prompt_logprobs is not None),
                                   ("a grammar", grammar is not None)) if on]
    if not asked:
        return plan
    if grammar is not None:
        if not plan.eos_token_ids:
            raise DraftwiseError("a grammar ends its answer with an end-of-sequence token: drop ignore_eos (or give "
                                 "the target an EOS token)")
        if plan.target.tokenizer is None:
            raise DraftwiseError("a grammar needs the target's tokenizer, and this target has none")
        compiler_for(plan.target.tokenizer, plan.vocab_size, plan.eos_token_ids)  # a tokenizer it cannot wrap
    for feature in asked:
        refused = plan.method.refusal(feature)
        if refused:
            raise DraftwiseError(f"{plan.method.name} cannot apply {feature}: {refused}")
    return dataclasses.replace(plan, repetition_penalty=float(repetition_penalty), min_new_tokens=min_new_tokens,
                               logprobs=logprobs, prompt_logprobs=prompt_logprobs, grammar=grammar)


def _check_batch_size(value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DraftwiseError(f"max_batch_size must be an integer >= 1, got {value!r}")


def batched_methods() -> list[str]:
    """Methods the batched engine runs: every method."""
    return list(METHODS)


def _request(plan: _Plan, prompt_ids: list[int]) -> Request:
    if len(prompt_ids) >= plan.window:
        raise DraftwiseError(f"prompt has {len(prompt_ids)} tokens but the context window is {plan.window}: shorten it")
    return Request(prompt_ids=tuple(prompt_ids), sampling=plan.sampling,
                   max_new_tokens=min(plan.requested_new_tokens, plan.window - len(prompt_ids)),
                   eos_token_ids=plan.eos_token_ids, stop=plan.stop, seed=plan.seed,
                   repetition_penalty=plan.repetition_penalty, min_new_tokens=plan.min_new_tokens,
                   logprobs=plan.logprobs, prompt_logprobs=plan.prompt_logprobs, grammar=plan.grammar)


def build_engine(plan: _Plan, max_batch_size: int, *, stream_text: bool = False, prefix_cache_mb: float = 0.0) -> Any:
    """The batched engine for a plan: the target's runner, the method's drafter and rule, and a prefix store of
    `prefix_cache_mb` megabytes (0: none). The sequence-level cascade is two engines behind one interface."""
    from .prefix import PrefixStore

    spec = plan.method
    if spec.loop == "sequence":
        from .seq_cascade import SequenceCascadeEngine

        draft_plan = dataclasses.replace(plan, target=plan.draft, method=METHODS["ar"], options={})
        aggregate, alpha = plan.options["aggregate"], plan.options["alpha"]
        return SequenceCascadeEngine(
            build_engine(draft_plan, max_batch_size, stream_text=stream_text),
            build_engine(dataclasses.replace(plan, method=METHODS["ar"], options={}), max_batch_size,
                    stream_text=stream_text, prefix_cache_mb=prefix_cache_mb),
            lambda log_probs: sequence_confidence(log_probs, aggregate), 1.0 - alpha, method=spec.name)
    rule = spec.make_rule(plan.options)
    gamma = spec.draft_run(plan.options, plan.gamma)
    return Engine(ModelRunner(plan.target.model, vocab_size=plan.vocab_size, rows=0), _drafter(plan, rule), rule,
                  gamma=gamma, tokenizer=plan.target.tokenizer, max_batch_size=max_batch_size, method=spec.name,
                  stream_text=stream_text, selector=_selector(plan, gamma),
                  prefixes=PrefixStore(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 else None)


def _drafter(plan: _Plan, rule: Any) -> Any:
    """The method's drafter over rows: its kind's builder."""
    return DRAFTER_BUILDERS[plan.method.drafter](plan, rule)


def _none(plan: _Plan, rule: Any) -> Any:
    return NoRowsDrafter(plan.vocab_size, plan.target.device)


def _model(plan: _Plan, rule: Any, *, keep_raw: bool | None = None) -> Any:
    """The draft model's rows drafter, or the EAGLE head's when the draft is a head."""
    keep_raw = rule.needs_draft_raw if keep_raw is None else keep_raw
    if isinstance(plan.draft, DraftHead):
        return EagleRowsDrafter(plan.draft, plan.vocab_size, plan.target.device, eos_token_ids=plan.eos_token_ids,
                                policy=_policy(plan), keep_raw=keep_raw)
    return ModelRowsDrafter(draft_runner(plan.draft, vocab_size=plan.vocab_size), plan.vocab_size,
                            eos_token_ids=plan.eos_token_ids, keep_raw=keep_raw, policy=_policy(plan))


def _ngram(plan: _Plan, rule: Any) -> Any:
    return LookupRowsDrafter(plan.vocab_size, plan.target.device, max_ngram=plan.options["max_ngram"],
                             min_ngram=plan.options["min_ngram"], eos_token_ids=plan.eos_token_ids)


def _suffix(plan: _Plan, rule: Any) -> Any:
    from .methods import suffix_options
    from .suffix import SuffixRowsDrafter

    return SuffixRowsDrafter(plan.vocab_size, plan.target.device, suffix_options(plan.options),
                             eos_token_ids=plan.eos_token_ids)


def _hybrid(plan: _Plan, rule: Any) -> Any:
    from .suffix import HybridRowsDrafter

    return HybridRowsDrafter(_model(plan, rule), _suffix(plan, rule), plan.options["threshold"])


def _companion(plan: _Plan, rule: Any) -> Any:
    from .selection import CompanionRowsDrafter, StagedRowsDrafter

    kind = StagedRowsDrafter if plan.method.drafter == "staged" else CompanionRowsDrafter
    inner = _model(plan, rule, keep_raw=kind is CompanionRowsDrafter)  # SV's companion reads the draft's raw q
    return kind(inner, draft_runner(plan.companion, vocab_size=plan.vocab_size), plan.vocab_size)


def _beams(plan: _Plan, rule: Any) -> Any:
    from .mtad import BeamRowsDrafter, ModelBeams

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
assert set(DRAFTER_BUILDERS) == set(DRAFTERS), "every drafter kind has a builder"


def _selector(plan: _Plan, gamma: int) -> Any:
    """The select phase of SV and its history-based baselines (None: verify every drafted token)."""
    from .selection import GoodputSelector, HistorySelector, SmartSpecSelector

    kind, profile = plan.method.selector, plan.sv_profile
    lookahead = plan.options.get("lookahead") or None  # 0: always draft gamma
    if kind == "sv":
        return GoodputSelector(profile.table(plan.options["bins"]), profile.latency, lookahead=lookahead)
    if kind == "history":
        return HistorySelector(profile.latency, gamma, lookahead=lookahead)
    if kind == "smartspec":
        return SmartSpecSelector(profile.latency, gamma)
    return None


def _policy(plan: _Plan) -> LengthPolicy:
    """The method's length policy: SPRINTER's verifier, SpecDec++'s head, a stop rule, or fixed gamma."""
    spec = plan.method
    if spec.kind.objective:
        drafter_model = plan.target.model if isinstance(plan.draft, DraftHead) else plan.draft.model  # a head
        embedding = drafter_model.get_input_embeddings()  # reads the target's token embeddings
        verifier = plan.verifier.to(plan.target.device)
        if spec.kind.objective == "sprinter":
            return VerifierStop(verifier, plan.options["tau"], embedding)
        return StopHead(verifier, plan.options["threshold"], embedding)
    if spec.make_stop:
        return StopBefore(spec.make_stop(plan.options))
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


def _generation(result: Result, spec: Method) -> Generation:
    stats = dict(result.stats)
    if spec.kind.objective:
        stats["verifier_calls"] = stats["drafted"]  # the verifier scores every drafted token
    else:
        stats.pop("verifier_accepted", None)
    return Generation(token_ids=result.token_ids, text=result.text, stats=stats, logprobs=result.logprobs,
                      prompt_logprobs=result.prompt_logprobs)


# Methods that can draft with an EAGLE feature head (the head drafts one token distribution per step).
# Methods an EAGLE head drafts for: every token-wise rule on the batched engine whose drafter needs only the
# draft's distributions. The others, and why a head cannot serve them, are in _HEAD_REFUSALS.
EAGLE_METHODS = frozenset({"sd", "lossy", "lossy-greedy", "fly", "hybrid", "cascade", "token-cascade", "bild",
                           "adaedl", "svip", "mtad", "sprinter", "specdec++"})
# Methods a head can run but whose registry default is the independent draft: the shipped verifier and stop
# head were trained on that draft's states.
_INDEPENDENT_BY_DEFAULT = frozenset({"sprinter", "specdec++"})
_HEAD_REFUSALS = {
    "seq-cascade": "it lets the draft write a whole response alone, and a head cannot decode without the target",
    "oracle-diff": "it runs the draft alone at every step, and a head cannot decode without the target",
    "mtjd": "it decodes with the target alone",
    "sv": "SV's companion reads the draft's unwarped distributions, which the head drafter does not expose",
    "adaptive-verify": "the SV selectors are built for independent drafts",
    "smartspec": "the SV selectors are built for independent drafts",
    "staged": "staged drafting runs the draft model and a companion",
}


def check_options(
    *, method: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
    gamma: int, stop: Any, ignore_eos: bool, draft_given: bool, target: Any = None, draft: Any = None,
    **method_options: Any,
) -> tuple[Method, dict[str, Any], SamplingConfig, tuple[str, ...]]:
    """Every check that needs no model: runs first, so bad input fails before weights load.

    A method that needs a draft and gets none uses the registry's best draft for a registry target
    (`default_draft`); for any other target that is an error naming the way out. A draft given to a
    method that uses none is ignored with a `DraftwiseWarning`.
    """
    spec = get_method(method)
    options = spec.resolve_options(method_options)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    spec.make_rule(options)  # validates option values (alpha range, n-gram sizes) now
    if spec.needs_draft and draft is not None and spec.name not in EAGLE_METHODS and is_eagle_spec(draft):
        raise DraftwiseError(_eagle_refused(spec.name, target))  # before asking for files it could not use
    options = _registry_trained_file(spec, options, target, draft, sampling)
    spec.check_required(options)
    if spec.greedy_only and not sampling.greedy:
        raise DraftwiseError(f"method {spec.name!r} is defined for greedy decoding only: pass temperature=0")
    if not isinstance(gamma, int) or isinstance(gamma, bool) or not 1 <= gamma <= MAX_GAMMA:
        raise DraftwiseError(f"gamma (draft tokens per step) must be an integer in [1, {MAX_GAMMA}], got {gamma!r}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise DraftwiseError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
        raise DraftwiseError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    if stop is not None and not isinstance(stop, (str, list, tuple)):
        raise DraftwiseError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise DraftwiseError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    for s in stops:
        check_text(s, "a stop string")
    draft_given = draft_given or draft is not None
    if spec.needs_draft and not draft_given and default_draft(target, spec.name) is None:
        raise DraftwiseError(_no_draft_message(spec.name, target))
    if not spec.needs_draft and draft_given:
        warnings.warn(f"method {spec.name!r} uses no draft model: the draft given is ignored", DraftwiseWarning,
                      stacklevel=3)
    if spec.needs_draft and draft is not None and spec.name not in EAGLE_METHODS and is_eagle_spec(draft):
        raise DraftwiseError(_eagle_refused(spec.name, target))
    return spec, options, sampling, stops


def _registry_trained_file(spec: Method, options: dict[str, Any], target: Any, draft: Any,
                           sampling: SamplingConfig) -> dict[str, Any]:
    """SPRINTER's verifier or SpecDec++'s head from the registry when none is given and the pair (the draft
    given by name, or the default one) has one for this sampling setting. Otherwise the options unchanged, or,
    when the pair has none, an error saying what the registry ships."""
    if not spec.kind.objective:
        return options
    option = next(o for o in spec.options if o.required)
    if options.get(option.name):
        return options
    objective = spec.kind.objective
    target_name = _registry_name(target)
    if draft is None:
        draft_name = registry.default_draft_for(target_name, eagle_ok=False) if target_name else None
    else:
        draft_name = _registry_name(draft)
    path = registry.trained_file(target_name, draft_name, objective, sampling.temperature, sampling.top_k,
                                 sampling.top_p) if target_name and draft_name else None
    if path is None:
        raise DraftwiseError(f"{spec.name} needs {option.name}=PATH: {registry.trained_files_note(objective)}; "
                             f"for another pair or sampling setting, {option.required}")
    return {**options, option.name: str(path)}


def _registry_name(target: Any) -> str | None:
    """The registry name of a target given by name, or loaded by name (`load_model("smollm2-135m")`)."""
    name = target.name if isinstance(target, LoadedModel) else target if isinstance(target, str) else None
    return name if name in registry.names() else None


def default_draft(target: Any, method: str) -> str | None:
    """The registry's best ready draft for `target` and `method` (None for other targets): the EAGLE
    head for methods that can draft with one, the independent draft model for the others."""
    name = _registry_name(target)
    eagle_ok = method in EAGLE_METHODS and method not in _INDEPENDENT_BY_DEFAULT
    return registry.default_draft_for(name, eagle_ok=eagle_ok) if name else None


def _no_draft_message(method: str, target: Any) -> str:
    missing = _missing_path(target)
    if missing:
        return missing
    name = _registry_name(target)
    listed = registry.listed_drafts(name) if name else ()
    if listed:
        problems = "; ".join(f"{d}: {registry.entry(d).cached()}" for d in listed)
        where = f"the registry's drafts for {name} are not ready ({problems})"
    else:
        known = [t for t in registry.names() if registry.listed_drafts(t)]
        where = ("the registry has drafts only for " + ", ".join(known)) if known else "the registry has no drafts"
    return (f"method {method!r} needs a draft model and {where}: pass draft=... (--draft), "
            "or use method='ar' or 'prompt-lookup', which need none")


def _missing_path(target: Any) -> str | None:
    """'target not found' for a target given as a path that does not exist (before any draft question)."""
    if not isinstance(target, (str, os.PathLike)) or (isinstance(target, str) and target in registry.names()):
        return None
    text = os.fspath(target)
    path = Path(text).expanduser()
    looks_like_path = text.startswith((".", "/", "~")) or text.endswith(".gguf") or os.sep in text.strip("/") and \
        text.count("/") != 1  # a hub id is "owner/name"
    if looks_like_path and not path.exists():
        return f"target {text!r} not found: give a registry name ({', '.join(registry.names())}), a model directory, " \
               "a .gguf file or a hub id"
    return None


def _eagle_refused(method: str, target: Any) -> str:
    name = _registry_name(target)
    independent = registry.default_draft_for(name, eagle_ok=False) if name else None
    hint = f" (for {name}: {independent})" if independent else ""
    why = _HEAD_REFUSALS.get(method, "it needs an independent draft model")
    return (f"an EAGLE draft head cannot draft for {method!r}: {why}; give an independent draft model{hint} "
            f"(a head drafts for {', '.join(sorted(EAGLE_METHODS))})")


def _plan(
    *, target: Any, prompt: Any, draft: Any, method: str, max_new_tokens: int, temperature: float, top_k: int,
    top_p: float, seed: int | None, gamma: int, stop: Any, ignore_eos: bool, method_options: dict[str, Any],
    messages: Any = None,
) -> _Plan:
    method_options = dict(method_options)
    if "messages" in method_options:  # generate(target, None, messages=[...]) until the signature has messages=
        messages = method_options.pop("messages")
    if messages is not None:
        if prompt is not None:
            raise DraftwiseError("give a prompt or messages=..., not both")
        _check_messages(messages)
        prompt = list(messages)
    _check_prompt(prompt)
    spec, options, sampling, stops = check_options(
        method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        gamma=gamma, stop=stop, ignore_eos=ignore_eos, draft_given=draft is not None, target=target, draft=draft,
        **method_options,
    )
    if not spec.needs_draft:
        draft = None  # check_options warned
    elif draft is None:
        draft = default_draft(target, spec.name)
    target_model = load_model(target)
    draft_model = _load_draft(draft, target_model) if draft is not None else None
    if isinstance(draft_model, DraftHead):
        if spec.name not in EAGLE_METHODS:
            raise DraftwiseError(_eagle_refused(spec.name, target_model))
        vocab_size = _shared_vocab(target_model, None)
    else:
        if not isinstance(draft_model, (LoadedModel, type(None))):
            raise DraftwiseError(f"draft must be a model, a model path or name, or an EAGLE head; got "
                                 f"{type(draft_model).__name__}")
        vocab_size = _shared_vocab(target_model, draft_model)
        if draft_model is not None:
            check_same_tokenizer(target_model, draft_model)
    if isinstance(draft_model, LoadedModel) and draft_model.device != target_model.device:
        raise DraftwiseError(f"draft is on {draft_model.device} but target on {target_model.device}; use one device")
    if stops and target_model.tokenizer is None:
        raise DraftwiseError("stop strings need a tokenizer; load the target with tokenizer=...")

    companion = None
    if spec.needs_companion:
        companion = _load_companion(options["companion"], target_model, draft_model)
    sv_profile = _load_profile(spec, options, target_model, draft_model, companion, sampling) \
        if spec.needs_profile else None

    verifier = None
    if spec.kind.objective:  # loaded now, so a bad file fails at the call, not mid-stream
        from .sprinter import Verifier

        path = next(options[o.name] for o in spec.options if o.required)  # the trained file's option
        drafter_model = draft_model if isinstance(draft_model, DraftHead) else draft_model.model
        verifier = Verifier.load(path, drafter_model, target_model.model)
        verifier.check_sampling(sampling)
        _check_objective(verifier, spec, path)
    prompt_ids = _prompt_ids(prompt, target_model, vocab_size)
    draft_window = draft_model.context_window if isinstance(draft_model, LoadedModel) else None
    companion_window = companion.context_window if companion is not None else None
    window = min(w for w in (target_model.context_window, draft_window, companion_window, 10**12) if w)
    if len(prompt_ids) >= window:
        raise DraftwiseError(
            f"prompt has {len(prompt_ids)} tokens but the context window is {window}: shorten the prompt"
        )
    room = window - len(prompt_ids)
    if max_new_tokens > room:
        warnings.warn(
            f"the prompt has {len(prompt_ids)} tokens and the context window is {window}: at most {room} new "
            f"tokens fit, not {max_new_tokens} (finish_reason 'context' when that limit ends generation)",
            DraftwiseWarning, stacklevel=3,
        )
    return _Plan(
        target=target_model, draft=draft_model, method=spec, options=options, sampling=sampling, gamma=gamma,
        prompt_ids=prompt_ids, max_new_tokens=min(max_new_tokens, room), stop=stops,
        eos_token_ids=frozenset() if ignore_eos else target_model.eos_token_ids, vocab_size=vocab_size, seed=seed,
        verifier=verifier, context_limited=max_new_tokens > room, window=window, requested_new_tokens=max_new_tokens,
        companion=companion, sv_profile=sv_profile,
    )


def _load_companion(spec: str, target: LoadedModel, draft: Any) -> LoadedModel:
    """SV's companion: the option's model, or the registry's companion for a registry target."""
    name = spec if not isinstance(spec, str) else spec or registry.default_companion(target.name)
    if name is None or (isinstance(name, str) and not name):
        raise DraftwiseError(f"this method needs a companion model: pass companion=NAME_OR_PATH (--companion); the "
                             f"registry has one only for {', '.join(registry.companion_targets()) or 'no target'}")
    if isinstance(name, LoadedModel):
        companion = name
    elif isinstance(name, str):
        companion = load_model(name, device=target.device, dtype=target.dtype)
    else:
        companion = load_model(name)
    if companion.device != target.device:
        raise DraftwiseError(f"companion is on {companion.device} but target on {target.device}; use one device")
    check_same_tokenizer(target, companion)
    _shared_vocab(target, companion)
    return companion


def _load_profile(spec: Method, options: dict[str, Any], target: LoadedModel, draft: Any, companion: Any,
                  sampling: SamplingConfig) -> Any:
    """The SV profile a selector reads, checked against the models and the sampling setting."""
    from . import sv

    setting = sv.profile_setting(target.name, getattr(draft, "name", None),
                                 companion.name if companion is not None else None, sampling)
    keys = sv.SETTING_KEYS if spec.selector == "sv" else ("target", "draft")  # baselines read the latency only
    path = options["profile"] or sv.shipped_profile(setting, keys)
    if path is None:
        raise DraftwiseError(
            f"{spec.name} needs an SV profile for target={setting['target']!r}, draft={setting['draft']!r}"
            + (f", companion={setting['companion']!r}" if spec.selector == "sv" else "")
            + f", temperature={sampling.temperature}, top_p={sampling.top_p}, top_k={sampling.top_k}: make one with "
            "`draftwise profile-sv` and pass profile=PATH (--profile)")
    profile = sv.SVProfile.load(path)
    profile.check(setting, path, keys)
    return profile


def _load_draft(draft: Any, target: LoadedModel) -> LoadedModel | DraftHead:
    """A draft model, or an EAGLE head (a directory with eagle.json, or a registry name of one): see
    `load_draft`, the one resolver the API, the CLI and the benchmark share."""
    return load_draft(draft, target)


def _check_objective(verifier: Any, spec: Method, path: Any) -> None:
    """A SPRINTER verifier and a SpecDec++ head share a file format; the recorded training objective tells them
    apart (files without one were trained with the SPRINTER objective, the only one there was)."""
    objective = (verifier.spec.extra or {}).get("objective", "sprinter")
    wanted = spec.kind.objective
    if objective != wanted:
        made_for = "SpecDec++ (a stop head)" if objective == "acceptance" else "SPRINTER (a verifier)"
        raise DraftwiseError(
            f"{path} was trained with the {objective!r} objective, for {made_for}; {spec.name} needs one trained "
            f"with `draftwise train-verifier --objective {wanted}`"
        )


_FINGERPRINTS: "weakref.WeakKeyDictionary[Any, tuple[int, str]]" = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of what decides token ids: the vocabulary (string -> id) and the special tokens.
    Kept per tokenizer object (about 50 ms for a 49k vocabulary), recomputed when tokens are added."""
    try:
        size, cached = _FINGERPRINTS.get(tokenizer, (-1, ""))
    except TypeError:  # not weak-referenceable / hashable
        size, cached = -1, ""
    if size == len(tokenizer):
        return cached
    vocab = tokenizer.get_vocab()
    special = {k: str(v) for k, v in sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items())}
    blob = json.dumps([sorted(vocab.items(), key=lambda kv: kv[1]), special], ensure_ascii=False)
    fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]
    try:
        _FINGERPRINTS[tokenizer] = (len(tokenizer), fingerprint)
    except TypeError:
        pass
    return fingerprint


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must map text to the same ids as the target; equal sizes are not enough. Checked where both
    models come with a tokenizer (an in-memory model without one cannot be checked)."""
    if target.tokenizer is None or draft.tokenizer is None or target.tokenizer is draft.tokenizer:
        return
    mine, theirs = tokenizer_fingerprint(target.tokenizer), tokenizer_fingerprint(draft.tokenizer)
    if mine == theirs:
        return
    vocab_t, vocab_d = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    differ = sorted(set(vocab_t.items()) ^ set(vocab_d.items()), key=lambda kv: kv[1])
    example = f"e.g. token {differ[0][0]!r} <-> id {differ[0][1]}" if differ else "the special tokens differ"
    raise DraftwiseError(
        f"the draft's tokenizer differs from the target's ({example}; fingerprints {theirs} vs {mine}): "
        "a draft must share the target's tokenizer"
    )


def _shared_vocab(target: LoadedModel, draft: LoadedModel | None) -> int:
    """The distribution size every method uses for this pair. Padding-only differences are tolerated.

    Some checkpoints pad the embedding matrix past the tokenizer (Qwen: 151,936 rows
    for 151,665 tokens). Logits are cut to the tokenizer's size when it is smaller than
    every model's: the rows past it hold no real token, and cutting them for every
    method (with or without a draft) keeps `ar`, `sd` and the others on one distribution.
    Without a tokenizer the models must agree exactly.
    """
    sizes = [target.vocab_size] + ([draft.vocab_size] if draft is not None else [])
    smaller = min(sizes)
    tokenizer = target.tokenizer or (draft.tokenizer if draft is not None else None)
    if tokenizer is not None and len(tokenizer) <= smaller:
        return len(tokenizer)
    if len(set(sizes)) == 1:
        return smaller
    raise DraftwiseError(
        f"draft vocabulary size {draft.vocab_size} differs from target vocabulary size {target.vocab_size}: "
        "the draft must share the target's tokenizer"
        + ("" if tokenizer is None else f" ({len(tokenizer)} tokens; padding past it is tolerated)")
    )


PROMPT_FORMS = (
    "a string, token ids (a list of ints, a 1-D tensor or numpy array, or the BatchEncoding that tokenizer(...) "
    "and apply_chat_template(...) return) or chat messages [{'role': 'user', 'content': '...'}]"
)


def _describe(value: Any) -> str:
    """What was passed, in a few words, for error messages."""
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {sorted(map(str, value))[:6]}"
    if isinstance(value, (torch.Tensor,)) or type(value).__module__ == "numpy":
        shape = tuple(getattr(value, "shape", ()))
        return f"{type(value).__name__} of shape {shape} and dtype {getattr(value, 'dtype', '?')}"
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"{type(value).__name__} of {len(value)} {'/'.join(kinds) or 'items'}"
    return type(value).__name__


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) for m in value)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value)


def _as_array(value: Any) -> Any:
    """input_ids of a BatchEncoding / mapping, else the value itself."""
    if isinstance(value, Mapping) and "input_ids" in value:
        return value["input_ids"]
    return value


def _rows(value: Any) -> list[Any] | None:
    """The prompts of a 2-D batch (tensor, numpy array, BatchEncoding with several rows); None if not one."""
    mask = value.get("attention_mask") if isinstance(value, Mapping) else None
    ids = _as_array(value)
    if isinstance(ids, torch.Tensor) or type(ids).__module__ == "numpy":
        if getattr(ids, "ndim", 0) != 2:
            return None
        rows = [list(map(int, r)) for r in ids.tolist()]
    elif isinstance(ids, (list, tuple)) and ids and all(_is_token_list(r) for r in ids) and isinstance(value, Mapping):
        rows = [list(r) for r in ids]
    else:
        return None
    if mask is not None:  # drop padding, left or right
        mask = mask.tolist() if hasattr(mask, "tolist") else mask
        rows = [[t for t, m in zip(r, mr) if m] for r, mr in zip(rows, mask)]
    return rows


def _split_prompts(prompt_or_prompts: Any) -> tuple[list[Any], bool]:
    """(prompts, is_batch). One prompt: a string, token ids (list, 1-D tensor/array, one-row BatchEncoding) or
    one chat (a list of message dicts). A batch: a list of those (strings, id lists, chats), a 2-D tensor or
    array, or a BatchEncoding with several rows. For the batched `generate` / `stream`."""
    value = prompt_or_prompts
    if value is None:
        raise DraftwiseError(f"no prompt: give {PROMPT_FORMS}, or a list of them")
    if isinstance(value, str) or _is_messages(value):
        return [value], False
    rows = _rows(value)
    if rows is not None:  # a [1, n] tensor / BatchEncoding is one prompt, as transformers' generate reads it
        return (rows, True) if len(rows) > 1 else ([value], False)
    ids = _as_array(value)
    if isinstance(ids, (torch.Tensor,)) or type(ids).__module__ == "numpy" or _is_token_list(ids):
        return [value], False
    if isinstance(value, (list, tuple)):
        if not value:
            raise DraftwiseError("the list of prompts is empty")
        if all(isinstance(p, str) or _is_messages(p) or _is_token_list(p) or isinstance(p, (torch.Tensor, Mapping))
               for p in value):
            return list(value), True
    raise DraftwiseError(f"a prompt must be {PROMPT_FORMS}, or a list of them; got {_describe(value)}")


def _check_prompt(prompt: Any) -> None:
    """The prompt's form, checked before any model loads (token ranges are checked against the model later)."""
    if prompt is None:
        raise DraftwiseError(f"no prompt: give {PROMPT_FORMS}")
    if isinstance(prompt, str):
        if not prompt:
            raise DraftwiseError("prompt is empty")
        check_text(prompt, "prompt")
        return
    if _is_messages(prompt):
        _check_messages(prompt)
        return
    rows = _rows(prompt)
    if rows is not None and len(rows) != 1:
        raise DraftwiseError(f"got a batch of {len(rows)} prompts ({_describe(_as_array(prompt))}) where one prompt "
                             "was expected: pass one row, or a list of prompts to the batched generate")
    ids = _as_array(prompt)
    if isinstance(ids, torch.Tensor) or type(ids).__module__ == "numpy":
        integer = (not ids.dtype.is_floating_point and not ids.dtype.is_complex and ids.dtype != torch.bool
                   if isinstance(ids, torch.Tensor) else getattr(ids.dtype, "kind", "") in ("i", "u"))
        if not integer or not 1 <= ids.ndim <= 2:
            raise DraftwiseError(f"token ids must be integers in a 1-D tensor or array; got {_describe(ids)}")
        return
    if isinstance(ids, (list, tuple)):
        if _is_token_list(ids):
            return
        if all(isinstance(p, (str, list, tuple, Mapping, torch.Tensor)) for p in ids):
            raise DraftwiseError(f"got {_describe(ids)} where one prompt was expected: a list of prompts is a batch "
                                 "(the batched generate takes it); one prompt is " + PROMPT_FORMS)
        raise DraftwiseError(f"token ids must be integers; got {_describe(ids)} (a prompt is {PROMPT_FORMS})")
    raise DraftwiseError(f"a prompt must be {PROMPT_FORMS}; got {_describe(prompt)}")


def _check_messages(messages: Any) -> None:
    if not _is_messages(messages):
        raise DraftwiseError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts; got "
                             + _describe(messages))
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise DraftwiseError(f"message {i} needs a 'role' string and a 'content'; got keys {sorted(m)}")
        content = m["content"]
        if not isinstance(content, str) and not (isinstance(content, list) and all(
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
                for part in content)):
            raise DraftwiseError(f"message {i}: content must be a string or a list of {{'type': 'text', 'text': ...}} "
                                 f"parts; got {_describe(content)}")
        for text in [content] if isinstance(content, str) else [part["text"] for part in content]:
            check_text(text, f"message {i}")


def check_text(text: str, what: str) -> None:
    """A one-line error for text that is not valid Unicode: a lone surrogate, or (from a command line read with
    Python's surrogateescape) a byte that was not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = text[error.start]
        if "\udc80" <= char <= "\udcff":
            raise DraftwiseError(f"{what} is not valid UTF-8: byte 0x{ord(char) - 0xDC00:02x} at character "
                                 f"{error.start}") from None
        raise DraftwiseError(f"{what} holds {char!a} at character {error.start}, which is not valid Unicode text "
                             "(a lone surrogate)") from None


def _messages_to_ids(messages: Any, tokenizer: Any) -> list[int]:
    """OpenAI-style chat messages -> the prompt's token ids through the tokenizer's chat template, with the
    assistant's turn opened (or, when the last message is the assistant's, continued)."""
    _check_messages(messages)
    if tokenizer is None:
        raise DraftwiseError("chat messages need a tokenizer; load the target with tokenizer=...")
    if not getattr(tokenizer, "chat_template", None):
        raise DraftwiseError("the target's tokenizer has no chat template: give the prompt as a string instead")
    normal = [{**m, "content": m["content"] if isinstance(m["content"], str)
               else "".join(part.get("text", "") for part in m["content"])} for m in messages]
    continue_last = normal[-1]["role"] == "assistant"
    try:
        encoded = tokenizer.apply_chat_template(normal, tokenize=True, add_generation_prompt=not continue_last,
                                                continue_final_message=continue_last)
    except Exception as error:  # noqa: BLE001 - a template refusing the messages (e.g. no system role) is bad input
        raise DraftwiseError(f"the chat template refused these messages: {str(error).splitlines()[0]}") from None
    ids = _as_array(encoded)
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return ids


def _prompt_ids(prompt: Any, target: LoadedModel, vocab_size: int) -> list[int]:
    _check_prompt(prompt)
    if isinstance(prompt, str):
        if target.tokenizer is None:
            raise DraftwiseError("a text prompt needs a tokenizer; pass token ids or load the target with tokenizer=...")
        ids = target.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif _is_messages(prompt):
        ids = _messages_to_ids(prompt, target.tokenizer)
    else:
        rows = _rows(prompt)
        if rows is not None:
            ids = rows[0]
        else:
            raw = _as_array(prompt)
            raw = raw.tolist() if hasattr(raw, "tolist") else list(raw)
            ids = raw[0] if raw and isinstance(raw[0], list) else raw
        ids = [int(t) for t in ids]
    if not ids:
        raise DraftwiseError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise DraftwiseError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    return ids


class _Run:
    """One request in flight on an engine of its own: its text, tokens, log-probabilities and stats."""

    def __init__(self, plan: _Plan, *, streaming: bool) -> None:
        self.plan = plan
        self.streaming = streaming
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text = ""
        self.stats: dict[str, Any] = {}
        self.result_logprobs: tuple[Any, Any] = (None, None)

    def pieces(self) -> Iterator[str]:
        """The request on the engine (a batch of one), its text piece by piece when streaming."""
        plan = self.plan
        engine = build_engine(plan, 1, stream_text=self.streaming)
        request_id = engine.submit(_request(plan, plan.prompt_ids))
        try:
            while engine.has_work:
                for event in engine.step():
                    self.token_ids.extend(event.token_ids)
                    self.logprobs.extend(event.logprobs or ())
                    if self.streaming and event.text:
                        yield event.text
        finally:
            if engine.has_work:
                engine.cancel(request_id)
            result = engine.result(request_id)
            if result is not None:  # None only when a forward raised: the error propagates
                self.text = result.text
                self.result_logprobs = (result.logprobs, result.prompt_logprobs)
                self.stats = _generation(result, plan.method).stats
                if plan.context_limited and result.finish_reason == "length":
                    self.stats["finish_reason"] = "context"

    def result(self) -> Generation:
        return Generation(token_ids=list(self.token_ids), text=self.text, stats=self.stats,
                          logprobs=self.result_logprobs[0], prompt_logprobs=self.result_logprobs[1])
