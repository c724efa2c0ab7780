"""The service behind the server: its configuration, the methods the loaded models can run (checked at start),
the plans built once, and each request turned into an engine request (`Service.prepare`)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any


from draftwise import api, builder, prompts
from draftwise import plan as plan_module
from draftwise.errors import DraftwiseError, DraftwiseWarning, did_you_mean
from draftwise.engine.grammar import grammar_from
from draftwise.engine.rows import ParamError
from draftwise.methods import METHODS, Method
from draftwise.models.loading import LoadedModel
from draftwise.engine.sampling import SamplingConfig
from draftwise.server import protocol
from draftwise.server.metrics import Metrics
from draftwise.server.protocol import ApiError
from draftwise.server.worker import EngineWorker, Ticket


@dataclass
class ServerConfig:
    model_name: str  # what clients put in `model`
    method: str = "sd"
    options: dict[str, Any] = field(default_factory=dict)  # the method's options (typed or strings)
    gamma: int = 4
    api_key: str | None = None
    max_batch_size: int = 16  # rows decoding together, across every engine
    max_queue: int = 64  # requests waiting for a row; more get 429
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0  # a request body that has not arrived whole by then gets 408
    max_engines: int = 8  # (method, options) engines kept; idle ones beyond it are dropped
    retry_after_s: int = 1
    prefix_cache_mb: float = 256.0  # prompt prefixes' keys and values kept for reuse, per engine; 0: off
    cors_origins: tuple[str, ...] = ()  # browser origins allowed cross-site (CORS); none: CORS off


# Options that name a file or a model: only the server's command line sets them, never a request.
RESOURCE_OPTIONS = frozenset({"verifier", "head", "companion", "profile"})


WARM_UP_TOKENS = 160  # the warm-up request's prompt: longer than a prefill chunk (a chunked prefill runs too)


def resource_options(spec: Method) -> set[str]:
    from draftwise import methods

    model_type = getattr(methods, "model_spec", None)
    return {o.name for o in spec.options
            if o.required or o.name in RESOURCE_OPTIONS or (model_type is not None and o.type is model_type)}


def _key_value(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:  # a loaded model (the companion): the same object for every request
        return id(value)


def _prompt_scores(parsed: protocol.Parsed) -> int | None:
    """The alternatives a prompt token's score needs: echo with logprobs k, vLLM's prompt_logprobs k (the larger)."""
    asked = [k for k in (parsed.logprobs if parsed.echo else None, parsed.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


class Service:
    """What the app serves: the loaded models, the methods they can run, and the engine thread.

    Every method is checked against the loaded models when the server starts; a plan per method (per
    sampling setting for methods that read an SV profile) is built from those models only, so no request
    ever loads a model or names a file."""

    def __init__(self, config: ServerConfig, target: LoadedModel, draft: Any = None,
                 companion: LoadedModel | None = None, sampled_draft: Any = None) -> None:
        self.config = config
        self.target = target
        self.draft = draft  # a LoadedModel, an EagleHead, or None
        # an EAGLE head trained on sampled answers: the draft of requests at T > 0 (their own engines); None: the
        # draft above drafts for every request
        self.sampled_draft = sampled_draft
        self.companion = companion
        self.metrics = Metrics(config.model_name)
        self.worker = EngineWorker(metrics=self.metrics, max_batch_size=config.max_batch_size,
                                   max_engines=config.max_engines, on_finish=self._record)
        self.in_flight = 0
        self.stopping = False
        self.created = protocol.now()
        self._plans: dict[tuple[str, Any], plan_module.Plan] = {}  # (method, sampling or None) -> plan, options apart
        self._sampled_plans: dict[tuple[str, Any], plan_module.Plan] = {}  # the same with the sampled-answer head
        self.refused: dict[str, str] = {}  # method -> why this server cannot run it
        self._pieces: dict[int, str] = {}
        self._check_methods()

    # ---- methods ----

    def _check_methods(self) -> None:
        for name, spec in METHODS.items():
            reason = self._refusal(spec)
            if reason is None:
                reason = self._first_plans(spec)
            if reason is not None:
                if name == self.config.method:
                    raise DraftwiseError(f"cannot serve method {name!r}: {reason}")
                self.refused[name] = reason

    def _refusal(self, spec: Method) -> str | None:
        if spec.needs_draft and self.draft is None:
            return "it needs a draft model and this server loaded none (start it with --draft)"
        if spec.needs_draft and not isinstance(self.draft, LoadedModel) and spec.name not in plan_module.EAGLE_METHODS:
            return (f"the server's draft is an EAGLE head, which drafts for {', '.join(sorted(plan_module.EAGLE_METHODS))} "
                    "only")
        if spec.needs_companion and self.companion is None:
            return "it needs a companion model and this server loaded none (start it with --companion)"
        files = [o.name for o in spec.options if o.required]
        if files and spec.name != self.config.method:
            return (f"it needs a trained file ({', '.join(files)}), which a request cannot name: start the server "
                    f"with --method {spec.name} --{files[0]} PATH")
        return None

    def _startup_options(self, spec: Method) -> dict[str, Any]:
        options = dict(self.config.options) if spec.name == self.config.method else {}
        if spec.needs_companion:
            options["companion"] = self.companion  # the loaded one: never a name to load
        return options

    def _first_plans(self, spec: Method) -> str | None:
        """Build the method's plan(s) now, the only time plans are built; the reason it cannot run, or None."""
        if spec.kind.objective and self._given_file(spec):
            try:  # a trained file at one sampling setting, read at start
                found = self._verifier_spec(spec)
            except DraftwiseError as error:
                return str(error)
            settings = [SamplingConfig(found.temperature, found.top_k, found.top_p)]
        elif spec.kind.objective:  # the registry's files for the pair, where it ships them
            settings = [SamplingConfig(1.0), SamplingConfig(0.0)]
        elif spec.needs_profile:  # an SV profile per sampling setting: every one found now
            settings = self._profile_settings(spec)
        else:
            settings = [SamplingConfig(0.0 if spec.greedy_only else 1.0)]
        errors = []
        for sampling in settings:
            try:
                self._build(spec, sampling)
            except DraftwiseError as error:
                errors.append(str(error))
        return errors[0] if len(errors) == len(settings) else None

    def _profile_settings(self, spec: Method) -> list[SamplingConfig]:
        """The sampling settings a profile method is tried at: greedy, T=1, and the --profile file's own."""
        settings = [SamplingConfig(1.0), SamplingConfig(0.0)]
        path = self._startup_options(spec).get("profile")
        if path:
            from draftwise.selectors.sv import SVProfile

            try:
                found = SVProfile.load(path).setting
                own = SamplingConfig(float(found["temperature"]), int(found.get("top_k") or 0),
                                     float(found.get("top_p") or 1.0))
            except (DraftwiseError, KeyError, TypeError, ValueError):
                return settings  # the plan build reports the file's problem
            settings = [own] + [s for s in settings if s != own]
        return settings

    def _given_file(self, spec: Method) -> bool:
        resolved = spec.resolve_options(self._startup_options(spec))
        return any(resolved[o.name] for o in spec.options if o.required)

    def _verifier_spec(self, spec: Method) -> Any:
        from draftwise.heads.sprinter import Verifier

        resolved = spec.resolve_options(self._startup_options(spec))
        spec.check_required(resolved)
        path = next(resolved[o.name] for o in spec.options if o.required)
        return Verifier.load(path, getattr(self.draft, "model", self.draft)).spec  # a head is its own module

    @staticmethod
    def _key(spec: Method, sampling: SamplingConfig) -> tuple[str, Any]:
        if not spec.needs_profile:
            return spec.name, None
        return spec.name, SamplingConfig(0.0) if sampling.greedy else sampling  # greedy ignores top-k / top-p

    def _heads_by_temperature(self, spec: Method) -> bool:
        """Whether this method's requests at T > 0 draft with the sampled-answer head."""
        return self.sampled_draft is not None and spec.needs_draft and spec.name in plan_module.EAGLE_METHODS

    def draft_for(self, spec: Method, sampling: SamplingConfig) -> Any:
        """The draft a request of this method and sampling setting drafts with."""
        return self.sampled_draft if self._heads_by_temperature(spec) and not sampling.greedy else self.draft

    def _build(self, spec: Method, sampling: SamplingConfig) -> None:
        probe = [next(iter(self.target.eos_token_ids), 0)]  # any valid prompt: each request brings its own
        drafts = [(self._plans, self.draft)]
        if self._heads_by_temperature(spec):
            drafts.append((self._sampled_plans, self.sampled_draft))
        for plans, draft in drafts:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DraftwiseWarning)
                plans[self._key(spec, sampling)] = plan_module.make_plan(
                    target=self.target, prompt=probe, draft=draft if spec.needs_draft else None, method=spec.name,
                    max_new_tokens=1, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                    seed=None, gamma=self.config.gamma, stop=None, ignore_eos=False,
                    method_options=self._startup_options(spec))

    def _plan(self, spec: Method, sampling: SamplingConfig) -> plan_module.Plan:
        """The method's plan over the loaded models, built at start (per sampling setting for an SV profile), with
        the draft of this sampling setting (`draft_for`)."""
        plans = self._plans if self.draft_for(spec, sampling) is self.draft else self._sampled_plans
        plan = plans.get(self._key(spec, sampling))
        if plan is not None:
            return plan
        have = [s for (name, s), _ in self._plans.items() if name == spec.name and s is not None]
        listed = "; ".join(f"temperature={s.temperature}, top_p={s.top_p}, top_k={s.top_k}" for s in have)
        raise DraftwiseError(f"{spec.name} reads an SV profile made for one sampling setting, and this server has "
                             f"them for: {listed}; for another, make one with `draftwise profile-sv` and start the "
                             f"server with --method {spec.name} --profile PATH")

    def runnable(self) -> list[str]:
        return [name for name in METHODS if name not in self.refused]

    @property
    def window(self) -> int:
        """The context window of the server's method (the smallest of the models it runs)."""
        return next(plan.window for (name, _), plan in self._plans.items() if name == self.config.method)

    # ---- one request ----

    def prepare(self, parsed: protocol.Parsed) -> tuple[Any, Any, Any, Method]:
        """(engine key, engine builder, engine Request, method) for a checked request; ApiError otherwise."""
        override = dict(parsed.override)
        method = override.pop("method", self.config.method)
        if not isinstance(method, str) or method not in METHODS:
            hint = did_you_mean(method, self.runnable()) if isinstance(method, str) else ""
            raise ApiError(400, f"unknown method {method!r}{hint}; this server runs: {', '.join(self.runnable())}",
                           param="draftwise.method", code="unknown_method")
        if method in self.refused:
            raise ApiError(400, f"method {method!r} is not available on this server: {self.refused[method]}; it "
                           f"runs: {', '.join(self.runnable())}", param="draftwise.method", code="method_unavailable")
        spec = METHODS[method]
        named = sorted(set(override) & resource_options(spec))
        if named:
            raise ApiError(400, f"option {named[0]!r} names a file or a model, and a request cannot make the server "
                           "read or load one: the server's own (from its command line) is used",
                           param=f"draftwise.{named[0]}", code="option_not_allowed")
        unknown = sorted(set(override) - set(protocol.OVERRIDE_KEYS) - {o.name for o in spec.options})
        if unknown:
            options = ", ".join(o.name for o in spec.options if o.name not in resource_options(spec)) or "none"
            raise ApiError(400, f"method {method!r} has no option {protocol.short(unknown[0])}: the 'draftwise' field "
                           f"takes {', '.join(protocol.OVERRIDE_KEYS)} and the method's options ({options})",
                           param=f"draftwise.{unknown[0][:40]}", code="unknown_option")
        gamma = override.pop("gamma", self.config.gamma)
        top_k = override.pop("top_k", parsed.top_k)
        ignore_eos = override.pop("ignore_eos", parsed.ignore_eos)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, f"draftwise.ignore_eos must be true or false, got {protocol.short(ignore_eos)}",
                           param="draftwise.ignore_eos")
        grammar = override.pop("grammar", None)
        try:
            grammar = grammar_from(grammar, response_format=parsed.response_format)
        except DraftwiseError as error:
            raise ApiError(400, str(error), param="response_format" if parsed.response_format is not None
                           else "draftwise.grammar") from None
        options = {**self._startup_options(spec), **override}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DraftwiseWarning)
                _, options, sampling, stops = plan_module.check_options(
                    method=method, max_new_tokens=parsed.max_tokens or 1, temperature=parsed.temperature, top_k=top_k,
                    top_p=parsed.top_p, seed=parsed.seed, gamma=gamma, stop=list(parsed.stop), ignore_eos=ignore_eos,
                    draft_given=spec.needs_draft, target=None, draft=self.draft if spec.needs_draft else None,
                    **options)
            base = self._plan(spec, sampling)
            if base.verifier is not None:
                base.verifier.check_sampling(sampling)
        except DraftwiseError as error:
            raise ApiError(400, str(error), param="draftwise") from None
        source = "messages" if parsed.chat else "prompt"
        try:
            prompt_ids = prompts.encode_prompt(parsed.messages if parsed.chat else parsed.prompt, base.target,
                                         base.vocab_size)
        except DraftwiseError as error:
            raise ApiError(400, str(error), param=source) from None
        if len(prompt_ids) >= base.window:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens and the context window is {base.window} "
                           f"tokens: shorten the {source}", param=source, code="context_length_exceeded")
        if parsed.max_tokens is not None and len(prompt_ids) + parsed.max_tokens > base.window:  # vLLM's answer too
            name = "max_completion_tokens" if parsed.chat else "max_tokens"
            raise ApiError(400, f"the context window is {base.window} tokens and this request asks for "
                           f"{len(prompt_ids) + parsed.max_tokens} ({len(prompt_ids)} in the {source}, "
                           f"{parsed.max_tokens} to generate): lower {name} or shorten the {source}",
                           param="max_tokens", code="context_length_exceeded")
        budget = parsed.max_tokens or base.window  # chat without max_tokens: until the window ends it
        plan = dataclasses.replace(
            base, options=options, sampling=sampling, gamma=gamma, stop=stops, seed=parsed.seed, prompt_ids=prompt_ids,
            eos_token_ids=frozenset() if ignore_eos else self.target.eos_token_ids,
            requested_new_tokens=budget, max_new_tokens=budget)
        params = dataclasses.replace(parsed.params, logprobs=parsed.logprobs, prompt_logprobs=_prompt_scores(parsed),
                                     grammar=grammar)
        try:
            plan = plan_module.with_params(plan, params)
        except ParamError as error:
            wire = {name: key for key, name in protocol.wire_options().items()}
            wire["grammar"] = "response_format" if parsed.response_format is not None else "draftwise.grammar"
            raise ApiError(400, str(error), param=wire.get(error.param, error.param)) from None
        try:
            request = plan_module.request_for(plan, prompt_ids)
        except DraftwiseError as error:
            raise ApiError(400, str(error), param=source, code="context_length_exceeded") from None
        window = spec.draft_run(plan.options, plan.gamma)
        # end-of-sequence tokens are the request's own (ignore_eos): requests that differ in them share an engine,
        # whose drafters stop a draft at the target's EOS tokens (a shorter draft; verification decides)
        key = (method, tuple(sorted((k, _key_value(v)) for k, v in options.items())), window,
               self._key(spec, sampling)[1], id(self.draft_for(spec, sampling)))  # T > 0: its own head and engine
        size = self.config.max_batch_size
        prefix_mb = self.config.prefix_cache_mb
        shared = dataclasses.replace(plan, eos_token_ids=self.target.eos_token_ids)

        def make_engine() -> Any:
            return builder.build_engine(shared, size, stream_text=True, prefix_cache_mb=prefix_mb)

        return key, make_engine, request, spec

    def warm_up(self, *, new_tokens: int = 8) -> float | None:
        """Build the default method's engine for greedy requests and run one request through it before the server
        takes any (vLLM warms up too), so the first client does not pay for building the engine and the fast
        forward, the kernels' first calls and the engine's first timings. The prompt (WARM_UP_TOKENS, within the
        context window) is longer than a prefill chunk, so a chunked prefill runs too. Nothing of it stays: no
        metrics, no result, no stored prefix. The engine is handed to the worker for the requests that share its
        key. Returns the seconds it took, or None when the default method refuses such a request: nothing runs
        then."""
        started = time.perf_counter()
        tokenizer = self.target.tokenizer
        words = tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False) \
            if tokenizer is not None else []
        words = [t for t in words if 0 <= t < self.target.vocab_size] or list(range(1, 9))
        length = min(WARM_UP_TOKENS, self.window - new_tokens - 1)
        ids = (words * (length // len(words) + 1))[:length]
        try:
            parsed = protocol.parse({"model": self.config.model_name, "prompt": ids, "max_tokens": new_tokens,
                                     "temperature": 0, "draftwise": {"ignore_eos": True}}, chat=False)
            key, make_engine, request, _ = self.prepare(parsed)
        except ApiError:
            return None

        def run() -> None:  # on the engine thread (see EngineWorker.call), which keeps the engine
            engine = make_engine()
            rid = engine.submit(request)
            engine.run()
            engine.finished.pop(rid, None)
            if engine.prefixes is not None:
                engine.prefixes.clear()
            self.worker.adopt(key, engine)

        self.worker.call(run)
        return time.perf_counter() - started

    def _record(self, ticket: Ticket, result: Any) -> None:
        """Engine thread, at a request's end: the metrics from the same numbers as the response's usage."""
        stats = result.stats
        per_position = stats.get("drafted_per_position") or []
        self.metrics.record_request(stats, num_drafts=per_position[0] if per_position else 0)

    def piece(self, token_id: int) -> str:
        """A token's own text, as log-probabilities name it (cached: a vocabulary is finite)."""
        text = self._pieces.get(token_id)
        if text is None:
            tokenizer = self.target.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
            if len(self._pieces) < 1 << 20:
                self._pieces[token_id] = text
        return text

    def prompt_text(self, parsed: protocol.Parsed, prompt_ids: Any) -> str:
        """What `echo` puts before the answer: the prompt as sent, or token ids decoded."""
        if isinstance(parsed.prompt, str):
            return parsed.prompt
        tokenizer = self.target.tokenizer
        return tokenizer.decode(list(prompt_ids)) if tokenizer is not None else ""

    def usage(self, result: Any, spec: Method) -> dict[str, Any]:
        generation = api.generation_from(result, spec)
        return protocol.usage(generation.stats, generation.mean_accepted_length, generation.acceptance_rate)
