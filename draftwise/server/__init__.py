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

from ..errors import DraftwiseError
from .app import ServerConfig, Service, create_app

__all__ = ["ServerConfig", "Service", "ThreadedServer", "bind", "create_app", "serve"]


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound now, so a busy port is a one-line error before any model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        raise DraftwiseError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.set_inheritable(True)
    return sock


def _config(app: Any, *, log_level: str, shutdown_timeout: float, access_log: bool) -> Any:
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=shutdown_timeout,
                          lifespan="on", loop="asyncio", http="h11", ws="none")


def serve(app: Any, sock: socket.socket, *, log_level: str = "info", shutdown_timeout: float = 30.0,
          access_log: bool = True) -> None:
    """Serve until SIGTERM / SIGINT. In-flight requests get `shutdown_timeout` seconds to finish; the rest are
    cancelled (their rows freed, their clients told), then the engine thread stops."""
    import uvicorn

    server = uvicorn.Server(_config(app, log_level=log_level, shutdown_timeout=shutdown_timeout, access_log=access_log))
    server.run(sockets=[sock])


class ThreadedServer:
    """The app served by uvicorn in a background thread, on 127.0.0.1 and a free port."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 30.0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(_config(app, log_level=log_level, shutdown_timeout=shutdown_timeout,
                                             access_log=False))
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
