"""A request, checked and planned before any model runs: the method and its options, the models it needs
(loaded, with the registry's defaults), sampling, limits and the request's options (`make_plan`, `with_params`),
and the engine request each prompt becomes (`request_for`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftwise.errors import DraftwiseError, DraftwiseWarning, did_you_mean
from draftwise.engine import rows
from draftwise.engine.rows import ParamError, Request, RequestParams
from draftwise.methods import MAX_GAMMA, METHODS, Method, get_method
from draftwise.heads.eagle import DraftHead
from draftwise.engine.grammar import compiler_for, grammar_from
from draftwise.models import registry
from draftwise.heads.loading import is_eagle_spec, load_draft
from draftwise.models.loading import LoadedModel, load_model
from draftwise.engine.sampling import SamplingConfig, is_greedy
from draftwise.prompts import check_messages, check_prompt, check_text, encode_prompt


@dataclass(frozen=True)
class Plan:
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
    params: RequestParams = RequestParams()  # penalties, bias, log-probabilities, grammar: see `with_params`
    companion: LoadedModel | None = None  # SV's companion / staged SD's intermediate model
    sv_profile: Any = None  # sv.SVProfile: P(accept | S, A) and the latency model of the select phase


def request_params(options: dict[str, Any], *, response_format: Any = None) -> RequestParams:
    """The request options among keyword arguments (`RequestParams`' names), checked before any model loads
    (ParamError names a bad one); OpenAI's `response_format` is another way to give the grammar."""
    values = {name: options[name] for name in rows.RequestParams.names() if name in options}
    if response_format is not None or "grammar" in values:
        try:
            values["grammar"] = grammar_from(values.get("grammar"), response_format=response_format)
        except DraftwiseError as error:
            raise ParamError("grammar", str(error)) from None
    return rows.RequestParams.from_options(values)


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments as (request options, method options)."""
    names = rows.RequestParams.names()
    return ({k: v for k, v in options.items() if k in names}, {k: v for k, v in options.items() if k not in names})


def with_params(plan: Plan, params: RequestParams) -> Plan:
    """The plan with the request's options, checked against the vocabulary and refused (ParamError, with the reason)
    where the method cannot apply them."""
    params = params.checked(plan.vocab_size)
    asked = params.asked()
    if not asked:
        return dataclasses.replace(plan, params=params)
    grammar = params.grammar
    if grammar is not None and plan.options.get("tree_nodes"):
        raise ParamError("grammar", f"{plan.method.name} with tree_nodes={plan.options['tree_nodes']} cannot apply a "
                         "grammar: token trees are drafted without the grammar's masks (set tree_nodes=0)")
    if grammar is not None:
        if not plan.eos_token_ids:
            raise ParamError("grammar", "a grammar ends its answer with an end-of-sequence token: drop ignore_eos (or "
                             "give the target an EOS token)")
        if plan.target.tokenizer is None:
            raise ParamError("grammar", "a grammar needs the target's tokenizer, and this target has none")
        try:
            compiler_for(plan.target.tokenizer, plan.vocab_size, plan.eos_token_ids)  # a tokenizer it cannot wrap
        except DraftwiseError as error:
            raise ParamError("grammar", str(error)) from None
    for name, feature in asked:
        refused = plan.method.refusal(feature)
        if refused:
            raise ParamError(name, f"{plan.method.name} cannot apply {feature}: {refused}")
    return dataclasses.replace(plan, params=params)


def check_batch_size(value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DraftwiseError(f"max_batch_size must be an integer >= 1, got {value!r}")


def request_for(plan: Plan, prompt_ids: list[int]) -> Request:
    if len(prompt_ids) >= plan.window:
        raise DraftwiseError(f"prompt has {len(prompt_ids)} tokens but the context window is {plan.window}: shorten it")
    return Request(prompt_ids=tuple(prompt_ids), sampling=plan.sampling,
                   max_new_tokens=min(plan.requested_new_tokens, plan.window - len(prompt_ids)),
                   eos_token_ids=plan.eos_token_ids, stop=plan.stop, seed=plan.seed, params=plan.params)


# Methods an EAGLE head drafts for: every method with a draft whose declaration gives no reason a head cannot.
EAGLE_METHODS = frozenset(m.name for m in METHODS.values() if m.needs_draft and not m.head_refusal)


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


def default_draft(target: Any, method: str, temperature: float = 0.0) -> str | None:
    """The registry's best ready draft for `target`, `method` and the sampling `temperature` (None for other
    targets): the EAGLE head for methods that can draft with one (at T > 0 the head trained on sampled answers,
    where the registry ships one), the independent draft model for the others."""
    name = _registry_name(target)
    spec = METHODS.get(method)
    eagle_ok = method in EAGLE_METHODS and not (spec is not None and spec.independent_by_default)
    return registry.default_draft_for(name, eagle_ok=eagle_ok, sampled=not is_greedy(temperature)) if name else None


def default_method(target: Any, draft: Any, temperature: Any = 0.0, device: Any = None) -> str:
    """The method when none is asked for: the exact method `draftwise bench` recorded as the fastest for this
    target, its draft (given, or the registry's) and this machine (`advice_record`, one line the first time);
    without a record, 'sd' where there is a draft; else 'suffix', which needs none, with a one-line warning that
    says so. A target whose path is missing keeps 'sd', so its error names the path."""
    t = temperature if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) else 0.0
    if _missing_path(target):
        return "sd"
    pair_draft = draft if draft is not None else default_draft(target, "sd", t)
    from draftwise.advice_record import recorded_method

    where = getattr(target, "device", None) or device or "cpu"
    recorded = recorded_method(target, pair_draft, t, device=where)
    if recorded is not None:
        return recorded
    if pair_draft is not None:
        return "sd"
    warnings.warn("no draft model for this target: decoding with 'suffix', which needs none (pass draft=... "
                  "(--draft) for 'sd')", DraftwiseWarning, stacklevel=4)
    return "suffix"


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
    """What is wrong with a target named by a path, asked before any draft question: 'not found' for a path that
    does not exist; for one that does, what loading it would say first (not a GGUF file, no config.json)."""
    if not isinstance(target, (str, os.PathLike)) or (isinstance(target, str) and target in registry.names()):
        return None
    text = os.fspath(target)
    path = Path(text).expanduser()
    looks_like_path = text.startswith((".", "/", "~")) or text.endswith(".gguf") or os.sep in text.strip("/") and \
        text.count("/") != 1  # a hub id is "owner/name"
    if looks_like_path and not path.exists():
        return f"target {text!r} not found: give a registry name ({', '.join(registry.names())}), a model directory, " \
               f"a .gguf file or a hub id{did_you_mean(text, registry.names())}"
    if path.exists() or not looks_like_path:  # a bare name that is no registry name: what loading would say
        from draftwise.models.loading import check_model_spec

        try:
            check_model_spec(text)
        except DraftwiseError as error:
            return str(error)
    return None


def _eagle_refused(method: str, target: Any) -> str:
    name = _registry_name(target)
    independent = registry.default_draft_for(name, eagle_ok=False) if name else None
    hint = f" (for {name}: {independent})" if independent else ""
    why = METHODS[method].head_refusal if method in METHODS and METHODS[method].head_refusal else \
        "it needs an independent draft model"
    return (f"an EAGLE draft head cannot draft for {method!r}: {why}; give an independent draft model{hint} "
            f"(a head drafts for {', '.join(sorted(EAGLE_METHODS))})")


def make_plan(
    *, target: Any, prompt: Any, draft: Any, method: str | None, max_new_tokens: int, temperature: float, top_k: int,
    top_p: float, seed: int | None, gamma: int, stop: Any, ignore_eos: bool, method_options: dict[str, Any],
    messages: Any = None,
) -> Plan:
    method_options = dict(method_options)
    if "messages" in method_options:  # generate(target, None, messages=[...]) until the signature has messages=
        messages = method_options.pop("messages")
    if messages is not None:
        if prompt is not None:
            raise DraftwiseError("give a prompt or messages=..., not both")
        check_messages(messages)
        prompt = list(messages)
    check_prompt(prompt)
    if method is None:
        method = default_method(target, draft, temperature)
        if draft is not None and not get_method(method).needs_draft:
            draft = None  # the recorded fastest method needs no draft: the one given serves no method here
    spec, options, sampling, stops = check_options(
        method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        gamma=gamma, stop=stop, ignore_eos=ignore_eos, draft_given=draft is not None, target=target, draft=draft,
        **method_options,
    )
    if not spec.needs_draft:
        draft = None  # check_options warned
    elif draft is None:
        draft = default_draft(target, spec.name, sampling.temperature)
    target_model = load_model(target)
    draft_model = _load_draft(draft, target_model) if draft is not None else None
    if isinstance(draft_model, DraftHead):
        if spec.name not in EAGLE_METHODS:
            raise DraftwiseError(_eagle_refused(spec.name, target_model))
        vocab_size = shared_vocab(target_model, None)
    else:
        if not isinstance(draft_model, (LoadedModel, type(None))):
            raise DraftwiseError(f"draft must be a model, a model path or name, or an EAGLE head; got "
                                 f"{type(draft_model).__name__}")
        vocab_size = shared_vocab(target_model, draft_model)
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
        from draftwise.heads.sprinter import Verifier

        path = next(options[o.name] for o in spec.options if o.required)  # the trained file's option
        drafter_model = draft_model if isinstance(draft_model, DraftHead) else draft_model.model
        verifier = Verifier.load(path, drafter_model, target_model.model)
        verifier.check_sampling(sampling)
        _check_objective(verifier, spec, path)
    prompt_ids = encode_prompt(prompt, target_model, vocab_size)
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
    return Plan(
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
    from draftwise.drafters.ngram_companion import load_companion

    if isinstance(name, LoadedModel):
        companion = name
    elif isinstance(name, str):
        companion = load_companion(name, target, device=target.device, dtype=target.dtype)
    else:
        companion = load_companion(name, target)
    if companion.device != target.device:
        raise DraftwiseError(f"companion is on {companion.device} but target on {target.device}; use one device")
    check_same_tokenizer(target, companion)
    shared_vocab(target, companion)
    return companion


def _load_profile(spec: Method, options: dict[str, Any], target: LoadedModel, draft: Any, companion: Any,
                  sampling: SamplingConfig) -> Any:
    """The SV profile a selector reads, checked against the models and the sampling setting."""
    from draftwise.selectors import sv
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


def shared_vocab(target: LoadedModel, draft: LoadedModel | None) -> int:
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
