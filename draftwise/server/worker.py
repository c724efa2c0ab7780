"""The engine thread: one thread owns every `Engine` and steps them; the event loop talks to it by queues.

An `Engine` runs one method with fixed options, so the server keeps one per (method, options) key,
each with its own KV cache over the same loaded weights, made on first use and dropped when idle
and more than `max_engines` exist. The engines with work are stepped in turn; `--max-batch-size`
bounds the rows decoding across all of them (a row freed in one engine can go to another's request).

Asyncio -> thread: `submit` and `cancel` put commands on a thread-safe queue (the thread blocks on
it when no engine has work). Thread -> asyncio: each request's events go to its own asyncio queue
through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from draftwise.engine.core import Engine
from draftwise.engine.rows import Request, Result
from draftwise.server.metrics import Metrics

log = logging.getLogger("draftwise.server")


@dataclass(eq=False)
class Ticket:
    """One request in flight, shared by its handler (event loop) and the engine thread."""

    key: Hashable  # the engine it runs on
    make_engine: Callable[[], Engine]  # builds that engine from already-loaded models, on first use
    request: Request
    method: Any  # the Method (for the per-request stats)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # ("tokens", text, n, logprobs, prompt_logprobs) / ("done", text, Result) / ("error", message) / ("disconnect",)
    arrived: float = field(default_factory=time.perf_counter)
    engine_id: int | None = None  # the engine's id for it, once submitted
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False  # set by the engine thread when its last message is sent

    def post(self, message: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, message)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineWorker:
    def __init__(self, *, metrics: Metrics, max_batch_size: int, max_engines: int = 8,
                 on_finish: Callable[[Ticket, Result], None] | None = None) -> None:
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_engines = max_engines
        self.on_finish = on_finish
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._engines: OrderedDict[Hashable, Engine] = OrderedDict()
        self._tickets: dict[tuple[Hashable, int], Ticket] = {}
        self._thread = threading.Thread(target=self._run, name="draftwise-engine", daemon=True)
        self.alive = False

    # ---- event-loop side ----

    def start(self) -> None:
        """Start the engine thread (once: a later call does nothing)."""
        if self._thread.ident is None:
            self.alive = True
            self._thread.start()

    def adopt(self, key: Hashable, engine: Engine) -> None:
        """Keep an engine built before the thread starts, or on it (the warm-up's), for the requests of its key."""
        if self.alive and threading.current_thread() is not self._thread:
            raise RuntimeError("adopt() after start(): the engines belong to the engine thread")
        self._engines[key] = engine

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread (starting it if need be) and return what it returns, or raise what it
        raised. Work that runs engines belongs there: PyTorch's OpenMP keeps a team of threads for each thread that
        runs parallel work, and an engine stepped on the engine thread after a warm-up on the main thread decoded
        about 1.5x slower (SmolLM2-135M in bf16: 20 against 13.5 ms a token)."""
        self.start()
        done, box = threading.Event(), {}
        self._commands.put(("call", (fn, done, box)))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def submit(self, ticket: Ticket) -> None:
        self._commands.put(("submit", ticket))

    def cancel(self, ticket: Ticket) -> None:
        self._commands.put(("cancel", ticket))

    def cancel_all(self) -> None:
        """Cancel every request in flight (a shutdown past its grace period): each handler gets 'done' with
        finish_reason 'cancelled' and answers its client."""
        self._commands.put(("cancel_all", None))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is still in flight (its handlers get 'done' with finish_reason 'cancelled') and end."""
        if self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join(timeout)
        self.alive = False

    def snapshot(self) -> dict[str, Any]:
        """Engines and their rows (read without a lock: for tests and /health, a moment's view)."""
        return {str(key): {"live": len(e.admitted), "waiting": len(e.waiting)} for key, e in list(self._engines.items())}

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            while True:
                busy = any(engine.has_work for engine in self._engines.values())
                if not self._drain(block=not busy):
                    break
                self._step_all()
                self._gauges()
        except Exception:  # noqa: BLE001 - a bug here must not leave handlers waiting forever
            log.exception("the engine thread failed")
            for ticket in list(self._tickets.values()):
                self._fail(ticket, "the engine thread failed; see the server log")
        finally:
            self.alive = False
            for ticket in list(self._tickets.values()):
                self._fail(ticket, "the server is shutting down")

    def _drain(self, *, block: bool) -> bool:
        """Apply the waiting commands; False on 'stop'."""
        while True:
            try:
                kind, ticket = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind in ("stop", "cancel_all"):
                for key, engine in list(self._engines.items()):
                    for row in [*engine.waiting, *engine.admitted]:
                        engine.cancel(row.id)
                        self._finished(key, engine, row.id, "")
                if kind == "stop":
                    return False
            if kind == "call":
                fn, done, box = ticket
                try:
                    box["value"] = fn()
                except BaseException as error:  # noqa: BLE001 - handed to the caller, which raises it
                    box["error"] = error
                finally:
                    done.set()
            elif kind == "submit":
                self._submit(ticket)
            elif kind == "cancel" and not ticket.done and ticket.engine_id is not None:
                engine = self._engines.get(ticket.key)
                if engine is not None and engine.cancel(ticket.engine_id):
                    self._finished(ticket.key, engine, ticket.engine_id, "")

    def _submit(self, ticket: Ticket) -> None:
        engine = self._engines.get(ticket.key)
        if engine is None:
            try:
                engine = ticket.make_engine()
            except Exception as error:  # noqa: BLE001 - reported to that request; the server goes on
                log.exception("building an engine failed")
                self._fail(ticket, f"building the engine failed: {type(error).__name__}: {error}", track=False)
                return
            self._evict_idle()
            self._engines[ticket.key] = engine
        self._engines.move_to_end(ticket.key)
        ticket.engine_id = engine.submit(ticket.request)
        self._tickets[(ticket.key, ticket.engine_id)] = ticket

    def _evict_idle(self) -> None:
        for key in [k for k, e in self._engines.items() if not e.has_work]:
            if len(self._engines) < self.max_engines:
                break
            del self._engines[key]  # its KV cache goes with it; the weights are shared and stay

    def _step_all(self) -> None:
        for key, engine in list(self._engines.items()):
            if not engine.has_work:
                continue
            others = sum(len(e.admitted) for k, e in self._engines.items() if k != key)
            engine.max_batch_size = max(0, self.max_batch_size - others)  # rows are shared by every engine
            # another engine's rows are decoding: this one's prompts go in short chunks, not wide ones
            engine.others_decoding = any(e.live for k, e in self._engines.items() if k != key)
            try:
                events = engine.step()
            except Exception as error:  # noqa: BLE001 - fail this engine's requests, keep serving the rest
                log.exception("an engine step failed")
                for (k, _), ticket in list(self._tickets.items()):
                    if k == key:
                        self._fail(ticket, f"decoding failed: {type(error).__name__}: {error}")
                del self._engines[key]  # its state is unknown: the next request builds a fresh one
                continue
            if events:
                self.metrics.observe("engine_step_rows", len(events))
            now = time.perf_counter()
            for event in events:
                ticket = self._tickets.get((key, event.request_id))
                if ticket is None:
                    continue
                if event.token_ids:
                    if ticket.first_token_at is None:
                        ticket.first_token_at = now
                        self.metrics.observe("time_to_first_token_seconds", now - ticket.arrived)
                    else:
                        self.metrics.observe("inter_token_latency_seconds", now - ticket.last_token_at)
                    ticket.last_token_at = now
                if event.finished:
                    self._finished(key, engine, event.request_id, event.text)
                elif event.text or event.token_ids:
                    ticket.post(("tokens", event.text, len(event.token_ids), event.logprobs, event.prompt_logprobs))

    def _finished(self, key: Hashable, engine: Engine, request_id: int, text: str) -> None:
        ticket = self._tickets.pop((key, request_id), None)
        result = engine.finished.pop(request_id, None)  # a long-lived server keeps no finished results
        if ticket is None or result is None:
            return
        end = ticket.last_token_at if ticket.last_token_at is not None else time.perf_counter()
        if result.finish_reason != "cancelled":
            self.metrics.observe("e2e_request_latency_seconds", end - ticket.arrived)
        if self.on_finish is not None:
            self.on_finish(ticket, result)
        ticket.done = True
        ticket.post(("done", text, result))

    def _fail(self, ticket: Ticket, message: str, *, track: bool = True) -> None:
        if track:
            self._tickets.pop((ticket.key, ticket.engine_id), None)
        if ticket.done:
            return
        self.metrics.inc("request_failure_total")
        ticket.done = True
        ticket.post(("error", message))

    def _gauges(self) -> None:
        engines = list(self._engines.values())
        self.metrics.set("num_requests_running", sum(len(e.admitted) for e in engines))
        self.metrics.set("num_requests_waiting", sum(len(e.waiting) for e in engines) + self._commands.qsize())
