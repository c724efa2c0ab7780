"""`draftwise serve`: an OpenAI-compatible HTTP server on the batched engine.

    service = Service(ServerConfig(model_name="smollm2-135m", method="sd"), target, draft)
    serve(create_app(service), host="127.0.0.1", port=8000)          # blocks; SIGTERM shuts it down cleanly

`ThreadedServer` runs the same app in a background thread on a free loopback port (tests, benchmarks).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from draftwise.errors import DraftwiseError
from draftwise.server.app import create_app
from draftwise.server.service import ServerConfig, Service

__all__ = ["ServerConfig", "Service", "ThreadedServer", "bind", "create_app", "serve"]


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound now, so a busy port is a one-line error before any model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and accepted
        # connections inherit it (without it a keep-alive response waits ~40 ms for Nagle and delayed ACKs)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        raise DraftwiseError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.set_inheritable(True)
    return sock


KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this
REQUEST_TIMEOUT_S = 30.0  # a request's headers and body must arrive within this, or the connection is closed
ANSWER_S = 5.0  # after the grace period, the time cancelled requests get to write their 503


def _config(app: Any, *, log_level: str, shutdown_timeout: float, access_log: bool,
            request_timeout: float = REQUEST_TIMEOUT_S) -> Any:
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, access_log=access_log,
                          timeout_graceful_shutdown=shutdown_timeout + ANSWER_S, timeout_keep_alive=KEEP_ALIVE_S,
                          lifespan="on", loop="asyncio", http=_protocol(request_timeout), ws="none")


def _protocol(request_timeout: float) -> type:
    """uvicorn's h11 protocol with a deadline on receiving each request: uvicorn closes idle connections only
    after a response, so a client that connects and sends nothing (or half a header, or half a body) would
    hold its connection for ever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._check()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(request_timeout, self._expire)
            self._check()

        def _check(self) -> None:  # the request is in: no deadline while the app answers it
            if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
                self._disarm()

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return Protocol


def _server(app: Any, config: Any, shutdown_timeout: float) -> Any:
    """uvicorn's server, whose shutdown cancels what is still decoding when the grace period ends, so those
    requests are answered (503, or an error event and [DONE] on a stream) before uvicorn's own deadline."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            service = getattr(getattr(app, "state", None), "service", None)
            handle = None
            if service is not None:
                service.stopping = True
                handle = asyncio.get_running_loop().call_later(shutdown_timeout, service.worker.cancel_all)
            try:
                await super().shutdown(sockets)
            finally:
                if handle is not None:
                    handle.cancel()

    return Server(config)


def serve(app: Any, sock: socket.socket, *, log_level: str = "info", shutdown_timeout: float = 30.0,
          access_log: bool = True) -> None:
    """Serve until SIGTERM / SIGINT. In-flight requests get `shutdown_timeout` seconds to finish; the rest are
    cancelled (their rows freed, their clients answered 503), then the engine thread stops."""
    config = _config(app, log_level=log_level, shutdown_timeout=shutdown_timeout, access_log=access_log)
    _server(app, config, shutdown_timeout).run(sockets=[sock])


class ThreadedServer:
    """The app served by uvicorn in a background thread, on 127.0.0.1 and a free port."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 30.0,
                 log_level: str = "warning", request_timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = _server(app, _config(app, log_level=log_level, shutdown_timeout=shutdown_timeout,
                                           access_log=False, request_timeout=request_timeout), shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="draftwise-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """What SIGTERM does: stop accepting, let in-flight requests finish (up to the grace period), stop."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ThreadedServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
