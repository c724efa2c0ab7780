"""The OpenAI-compatible ASGI app (Starlette): completions, chat, models, health and metrics.

A request goes: API key -> JSON content type -> body size -> JSON -> OpenAI parameters (`protocol.parse`) -> model
name -> method and options (`Service.prepare`, with the API's own checks) -> queue room -> the engine thread. Every
refusal is OpenAI's error JSON. A POST's body must be declared `application/json` (else 415), so a web page cannot
send one as a "simple" cross-site request (text/plain, a form) that no CORS preflight guards; CORS itself is off
unless `ServerConfig.cors_origins` (`serve --cors-origin`) names the origins it allows. A generation is answered by
`_Generation`, an ASGI response that also listens for the client going away: then (or on a server shutdown that
runs out of time) the engine request is cancelled and its row freed.
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
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from draftwise.server import protocol
from draftwise.server.metrics import CONTENT_TYPE
from draftwise.server.protocol import ApiError
from draftwise.server.worker import Ticket
from draftwise.server.service import Service


log = logging.getLogger("draftwise.server")


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
    middleware = []
    if service.config.cors_origins:  # asked for: only then may another origin's page read the answers
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(service.config.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
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


JSON_TYPE = "application/json"


def _require_json(request: HttpRequest) -> None:
    """415 unless the request declares a JSON body (`application/json`, parameters such as charset allowed), as
    vLLM's server: text/plain, form and multipart bodies, or none declared, are what a browser sends cross-site
    without a CORS preflight, so serving them would let any web page spend this machine's compute."""
    declared = request.headers.get("content-type")
    if declared is None or declared.split(";", 1)[0].strip().lower() != JSON_TYPE:
        got = f"got {protocol.short(declared, 80)}" if declared is not None else "none was given"
        raise ApiError(415, f"the request body must be JSON with the header 'Content-Type: {JSON_TYPE}'; {got}",
                       param="Content-Type", code="unsupported_media_type")


class _ClientGone(Exception):
    """The client closed the connection before its request body arrived: nobody to answer."""


async def _read_json(request: HttpRequest, limit: int, timeout: float = 10.0) -> Any:
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "bad Content-Length header")
        if int(declared) > limit:
            raise too_big
    chunks: list[bytes] = []
    size = 0

    async def collect() -> None:
        nonlocal size
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise too_big
            chunks.append(piece)

    try:
        await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        of = f" of the {declared} its Content-Length says" if declared is not None else ""
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s ({size} bytes{of})",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise _ClientGone from None
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
        _require_json(request)  # every /v1 POST: both generation paths come here
        if service.stopping or not service.worker.alive:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
        parsed = protocol.parse(await _read_json(request, service.config.max_body_bytes,
                                                 service.config.body_timeout_s), chat=chat)
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
    except _ClientGone:  # no one to answer: counted, not logged as a server error
        service.metrics.inc("request_rejected_total", status=499)
        return Response(status_code=499)
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
                                            self._logprobs(result.logprobs, result.prompt_logprobs),
                                            self._prompt_scores(result.prompt_logprobs))
            await _send_json(send, 200, body)
            return

    def _prompt_scores(self, entries: list[Any] | None) -> list[Any] | None:
        """vLLM's prompt_logprobs of the choice, when asked: the prompt tokens' scores and their k best."""
        k = self.parsed.prompt_logprobs
        if k is None or entries is None:
            return None
        entries = [None if e is None else dataclasses.replace(e, top=e.top[:k]) for e in entries]
        return protocol.prompt_logprobs(list(self.ticket.request.prompt_ids), entries, self.service.piece)

    def _logprobs(self, entries: list[Any] | None, prompt: list[Any] | None = None, offset: int = 0
                  ) -> dict[str, Any] | None:
        """The choice's `logprobs` for these tokens (and the prompt's, echoed), or None when not asked."""
        if self.parsed.logprobs is None or entries is None:
            return None
        piece = self.service.piece
        if self.parsed.chat:
            return protocol.chat_logprobs(entries, piece)
        ids = [e.token_id for e in entries]
        if prompt is not None:  # echo: the prompt's tokens with logprobs k (prompt_logprobs may have asked more)
            prompt = [None if e is None else dataclasses.replace(e, top=e.top[: self.parsed.logprobs]) for e in prompt]
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

        pending_prompt = True  # the prompt's scores come with the first event

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
            first_scores = (result.prompt_logprobs if done else message[4]) if pending_prompt else None
            pending_prompt = False
            if echo is not None:  # the prompt first, with its tokens' scores (they come with the first event)
                await body(chunk(text=echo, logprobs=scores([], first_scores),
                                 prompt_scores=self._prompt_scores(first_scores)))
                echo = None
            elif parsed.prompt_logprobs is not None and first_scores is not None:
                await body(chunk(text="", prompt_scores=self._prompt_scores(first_scores)))
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
