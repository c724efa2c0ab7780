"""The OpenAI-compatible ASGI app (Starlette): completions, chat, models, health and metrics.

A request goes: API key -> body size -> JSON -> OpenAI parameters (`protocol.parse`) -> model name
-> method and options (`Service.prepare`, with the API's own checks) -> queue room -> the engine
thread. Every refusal is OpenAI's error JSON. A generation is answered by `_Generation`, an ASGI
response that also listens for the client going away: then (or on a server shutdown that runs out
of time) the engine request is cancelled and its row freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import api, builder, prompts
from .. import plan as plan_module
from ..errors import DraftwiseError, DraftwiseWarning
from ..grammar import grammar_from
from ..methods import METHODS, Method
from ..models.loading import LoadedModel
from ..sampling import SamplingConfig
from . import protocol
from .metrics import CONTENT_TYPE, Metrics
from .protocol import ApiError
from .worker import EngineWorker, Ticket

log = logging.getLogger("draftwise.server")


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
    max_engines: int = 8  # (method, options) engines kept; idle ones beyond it are dropped
    retry_after_s: int = 1
    prefix_cache_mb: float = 256.0  # prompt prefixes' keys and values kept for reuse, per engine; 0: off


# Options that name a file or a model: only the server's command line sets them, never a request.
RESOURCE_OPTIONS = frozenset({"verifier", "head", "companion", "profile"})


def resource_options(spec: Method) -> set[str]:
    from .. import methods

    model_type = getattr(methods, "model_spec", None)
    return {o.name for o in spec.options
            if o.required or o.name in RESOURCE_OPTIONS or (model_type is not None and o.type is model_type)}


def _key_value(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:  # a loaded model (the companion): the same object for every request
        return id(value)


class Service:
    """What the app serves: the loaded models, the methods they can run, and the engine thread.

    Every method is checked against the loaded models when the server starts; a plan per method (per
    sampling setting for methods that read an SV profile) is built from those models only, so no request
    ever loads a model or names a file."""

    def __init__(self, config: ServerConfig, target: LoadedModel, draft: Any = None,
                 companion: LoadedModel | None = None) -> None:
        self.config = config
        self.target = target
        self.draft = draft  # a LoadedModel, an EagleHead, or None
        self.companion = companion
        self.metrics = Metrics(config.model_name)
        self.worker = EngineWorker(metrics=self.metrics, max_batch_size=config.max_batch_size,
                                   max_engines=config.max_engines, on_finish=self._record)
        self.in_flight = 0
        self.stopping = False
        self.created = protocol.now()
        self._plans: dict[tuple[str, Any], plan_module.Plan] = {}  # (method, sampling or None) -> plan, options apart
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
            from ..sv import SVProfile

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
        from ..sprinter import Verifier

        resolved = spec.resolve_options(self._startup_options(spec))
        spec.check_required(resolved)
        path = next(resolved[o.name] for o in spec.options if o.required)
        return Verifier.load(path, getattr(self.draft, "model", self.draft)).spec  # a head is its own module

    @staticmethod
    def _key(spec: Method, sampling: SamplingConfig) -> tuple[str, Any]:
        if not spec.needs_profile:
            return spec.name, None
        return spec.name, SamplingConfig(0.0) if sampling.greedy else sampling  # greedy ignores top-k / top-p

    def _build(self, spec: Method, sampling: SamplingConfig) -> None:
        probe = [next(iter(self.target.eos_token_ids), 0)]  # any valid prompt: each request brings its own
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DraftwiseWarning)
            self._plans[self._key(spec, sampling)] = plan_module.make_plan(
                target=self.target, prompt=probe, draft=self.draft if spec.needs_draft else None, method=spec.name,
                max_new_tokens=1, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                seed=None, gamma=self.config.gamma, stop=None, ignore_eos=False,
                method_options=self._startup_options(spec))

    def _plan(self, spec: Method, sampling: SamplingConfig) -> plan_module.Plan:
        """The method's plan over the loaded models, built at start (per sampling setting for an SV profile)."""
        plan = self._plans.get(self._key(spec, sampling))
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
            raise ApiError(400, f"unknown method {method!r}; this server runs: {', '.join(self.runnable())}",
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
        budget = parsed.max_tokens or base.window  # chat without max_tokens: until the window ends it
        plan = dataclasses.replace(
            base, options=options, sampling=sampling, gamma=gamma, stop=stops, seed=parsed.seed, prompt_ids=prompt_ids,
            eos_token_ids=frozenset() if ignore_eos else self.target.eos_token_ids,
            requested_new_tokens=budget, max_new_tokens=budget)
        try:
            plan = plan_module.with_processors(plan, parsed.repetition_penalty, parsed.min_tokens, parsed.logprobs,
                                        parsed.logprobs if parsed.echo else None, grammar)
        except DraftwiseError as error:
            param = "response_format" if grammar is not None else "logprobs" if parsed.logprobs is not None else \
                "repetition_penalty"
            raise ApiError(400, str(error), param=param) from None
        try:
            request = plan_module.request_for(plan, prompt_ids)
        except DraftwiseError as error:
            raise ApiError(400, str(error), param=source, code="context_length_exceeded") from None
        window = spec.draft_run(plan.options, plan.gamma)
        # end-of-sequence tokens are the request's own (ignore_eos): requests that differ in them share an engine,
        # whose drafters stop a draft at the target's EOS tokens (a shorter draft; verification decides)
        key = (method, tuple(sorted((k, _key_value(v)) for k, v in options.items())), window,
               self._key(spec, sampling)[1])
        size = self.config.max_batch_size
        prefix_mb = self.config.prefix_cache_mb
        shared = dataclasses.replace(plan, eos_token_ids=self.target.eos_token_ids)

        def make_engine() -> Any:
            return builder.build_engine(shared, size, stream_text=True, prefix_cache_mb=prefix_mb)

        return key, make_engine, request, spec

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


# ---------------------------------------------------------------- the ASGI app

def create_app(service: Service) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        service.worker.start()
        try:
            yield
        finally:
            service.stopping = True
            await asyncio.get_running_loop().run_in_executor(None, service.worker.stop)

    routes = [
        Route("/v1/completions", functools.partial(_generate, service, chat=False), methods=["POST"]),
        Route("/v1/chat/completions", functools.partial(_generate, service, chat=True), methods=["POST"]),
        Route("/v1/models", functools.partial(_models, service), methods=["GET"]),
        Route("/health", functools.partial(_health, service), methods=["GET"]),
        Route("/metrics", functools.partial(_metrics, service), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.service = service
    return app


def _error(error: ApiError, service: Service | None = None) -> JSONResponse:
    if service is not None:
        service.metrics.inc("request_rejected_total", status=error.status)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:
    service = request.app.state.service
    if request.url.path.startswith("/v1"):  # the API's paths say nothing, not even which exist, without the key
        try:
            _authorize(service, request)
        except ApiError as error:
            return _error(error, service)
    path = protocol.short(request.url.path, 120)
    message = {404: f"no route {path}", 405: f"{request.method} is not allowed on {path}"}
    return _error(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))))


async def _server_error(request: HttpRequest, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return _error(ApiError(500, f"internal error: {type(exc).__name__}"))


def _authorize(service: Service, request: HttpRequest) -> None:
    key = service.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    # compare_digest on bytes: constant time in the key's content (its length is not secret)
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def _read_json(request: HttpRequest, limit: int) -> Any:
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "bad Content-Length header")
        if int(declared) > limit:
            raise too_big
    chunks, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise too_big
        chunks.append(piece)
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, ValueError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:
        deep = True
    else:
        deep = protocol.nesting(body)
    if deep:
        raise ApiError(400, f"the request body nests deeper than {protocol.MAX_NESTING} levels", code="invalid_json")
    return body


async def _generate(service: Service, request: HttpRequest, *, chat: bool) -> Response:
    arrived = time.perf_counter()  # latencies count from here: parsing and tokenizing included
    try:
        _authorize(service, request)
        if service.stopping or not service.worker.alive:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
        parsed = protocol.parse(await _read_json(request, service.config.max_body_bytes), chat=chat)
        if parsed.model != service.config.model_name:
            raise ApiError(404, f"model {parsed.model!r} does not exist; this server serves "
                           f"{service.config.model_name!r}", param="model", code="model_not_found")
        key, make_engine, engine_request, spec = service.prepare(parsed)
        limit = service.config.max_batch_size + service.config.max_queue
        if service.in_flight >= limit:
            raise ApiError(429, f"the server is full: {service.in_flight} requests in flight "
                           f"({service.config.max_batch_size} decoding, at most {service.config.max_queue} waiting); "
                           "retry later", code="queue_full", headers={"Retry-After": str(service.config.retry_after_s)})
    except ApiError as error:
        return _error(error, service)
    loop = asyncio.get_running_loop()
    ticket = Ticket(key=key, make_engine=make_engine, request=engine_request, method=spec, loop=loop,
                    events=asyncio.Queue(), arrived=arrived)
    service.in_flight += 1
    service.worker.submit(ticket)
    return _Generation(service, ticket, parsed)


class _Generation(Response):
    """Runs one generation to the client, streamed (server-sent events) or as one JSON body, and cancels
    it when the client disconnects or the task is cancelled (a shutdown past its grace period)."""

    def __init__(self, service: Service, ticket: Ticket, parsed: protocol.Parsed) -> None:
        self.service, self.ticket, self.parsed = service, ticket, parsed
        self.id = protocol.new_id(parsed.chat)
        self.created = protocol.now()
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watcher = asyncio.create_task(self._watch(receive))
        try:
            if self.parsed.stream:
                await self._stream(send)
            else:
                await self._complete(send)
        except OSError:  # the connection went away while we were writing
            pass
        finally:
            watcher.cancel()
            if not self.ticket.done:
                self.service.worker.cancel(self.ticket)
            self.service.in_flight -= 1

    async def _watch(self, receive: Any) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a broken connection is a disconnect too
            pass
        self.ticket.events.put_nowait(("disconnect",))

    async def _complete(self, send: Any) -> None:
        while True:
            message = await self.ticket.events.get()
            if message[0] == "disconnect":
                return
            if message[0] == "error":
                await _send_json(send, 500, ApiError(500, message[1]).body())
                return
            if message[0] == "tokens":
                continue
            result = message[2]
            if result.finish_reason == "cancelled":
                await _send_json(send, 503, ApiError(503, "the request was cancelled: the server is shutting down")
                                 .body())
                return
            echo = self.service.prompt_text(self.parsed, self.ticket.request.prompt_ids) if self.parsed.echo else ""
            body = protocol.completion_body(self.id, self.parsed.model, self.parsed.chat, echo + result.text,
                                            protocol.FINISH_REASONS.get(result.finish_reason, "stop"),
                                            self.service.usage(result, self.ticket.method), self.created,
                                            self._logprobs(result.logprobs, result.prompt_logprobs))
            await _send_json(send, 200, body)
            return

    def _logprobs(self, entries: list[Any] | None, prompt: list[Any] | None = None, offset: int = 0
                  ) -> dict[str, Any] | None:
        """The choice's `logprobs` for these tokens (and the prompt's, echoed), or None when not asked."""
        if self.parsed.logprobs is None or entries is None:
            return None
        piece = self.service.piece
        if self.parsed.chat:
            return protocol.chat_logprobs(entries, piece)
        ids = [e.token_id for e in entries]
        if prompt is not None:
            ids, entries = list(self.ticket.request.prompt_ids) + ids, list(prompt) + list(entries)
        return protocol.completion_logprobs(ids, entries, piece, offset)

    async def _stream(self, send: Any) -> None:
        parsed = self.parsed
        usage_on = parsed.include_usage
        running = parsed.include_usage and parsed.continuous_usage  # vLLM's rule: only with include_usage
        prompt_tokens = len(self.ticket.request.prompt_ids)
        generated = 0

        def chunk(**kwargs: Any) -> bytes:
            counts = {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                      "total_tokens": prompt_tokens + generated} if running else None
            return protocol.chunk(self.id, parsed.model, parsed.chat, self.created, with_usage=usage_on,
                                  usage_body=counts, **kwargs)

        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})

        async def body(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        if parsed.chat:
            await body(chunk(role=True, text=""))
        sent = []
        scored = 0  # tokens whose log-probabilities went out
        offset = 0  # completions' text_offset: characters of the token texts so far
        echo = self.service.prompt_text(parsed, self.ticket.request.prompt_ids) if parsed.echo else None
        if echo is not None and parsed.logprobs is None:
            await body(chunk(text=echo))
            echo = None

        def scores(entries: list[Any] | None, prompt: list[Any] | None = None) -> dict[str, Any] | None:
            nonlocal offset, scored
            lp = self._logprobs(entries, prompt, offset)
            if lp is not None and not parsed.chat and lp["tokens"]:
                offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
            scored += len(entries or ())
            return lp

        while True:
            message = await self.ticket.events.get()
            if message[0] == "disconnect":
                return
            if message[0] == "error":
                await body(protocol.sse(ApiError(500, message[1]).body()))
                await body(protocol.DONE, more=False)
                return
            done = message[0] == "done"
            result = message[2] if done else None
            if echo is not None:  # the prompt first, with its tokens' scores (they come with the first event)
                await body(chunk(text=echo, logprobs=scores([], result.prompt_logprobs if done else message[4])))
                echo = None
            if done:
                generated = len(result.token_ids)
            else:
                generated += message[2]
            lp = None
            if parsed.logprobs is not None:
                entries = result.logprobs[scored:] if done and result.logprobs is not None else \
                    [] if done else message[3]
                lp = scores(entries) if entries else None
            if message[1] or lp is not None:
                sent.append(message[1])
                await body(chunk(text=message[1], logprobs=lp))
            if not done:
                continue
            if result.finish_reason == "cancelled":
                await body(protocol.sse(ApiError(503, "the request was cancelled: the server is shutting down")
                                        .body()))
                await body(protocol.DONE, more=False)
                return
            text = "".join(sent)
            rest = result.text[len(text):] if result.text.startswith(text) else ""  # what the last step released
            if rest:
                await body(chunk(text=rest))
            finish = protocol.FINISH_REASONS.get(result.finish_reason, "stop")
            await body(chunk(text="" if not parsed.chat else None, finish_reason=finish))
            if usage_on:
                await body(protocol.usage_chunk(self.id, parsed.model, parsed.chat, self.created,
                                                self.service.usage(result, self.ticket.method)))
            await body(protocol.DONE, more=False)
            return


async def _send_json(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _models(service: Service, request: HttpRequest) -> Response:
    try:
        _authorize(service, request)
    except ApiError as error:
        return _error(error, service)
    config = service.config
    return JSONResponse({"object": "list", "data": [{
        "id": config.model_name, "object": "model", "created": service.created, "owned_by": "draftwise",
        "max_model_len": service.window,
        "draftwise": {"method": config.method, "methods": service.runnable(), "gamma": config.gamma,
                      "max_batch_size": config.max_batch_size, "max_queue": config.max_queue},
    }]})


async def _health(service: Service, request: HttpRequest) -> Response:
    if service.stopping or not service.worker.alive:
        return JSONResponse({"status": "stopping"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _metrics(service: Service, request: HttpRequest) -> Response:
    return Response(service.metrics.render(), media_type=CONTENT_TYPE)
