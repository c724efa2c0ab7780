"""`draftwise loadtest`: a bounded load test against a running OpenAI-compatible server on loopback.

For each concurrency C, C client threads send `num_requests` streamed requests between them (a new
connection each, stdlib `http.client`: no openai package needed) and time every server-sent event:
- TTFT: request sent -> first chunk carrying text;
- ITL: the gaps between consecutive chunks carrying text (a speculative step may carry several tokens);
- TPOT: (last text chunk - first) / (completion tokens - 1), per request;
- throughput: completion tokens of every finished request / the level's wall time.
Token counts and speculative statistics come from each response's final usage chunk
(`stream_options.include_usage`). The whole run stops at `timeout_s`: no new request starts after it,
and a request still open then is abandoned and counted as failed.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import platform
import socket
import threading
import time
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

import numpy as np

from draftwise.errors import DraftwiseError


def check_url(url: str, *, allow_remote: bool = False) -> tuple[str, int, str]:
    """(host, port, base path) of an http:// URL; a host that is not loopback needs `allow_remote`."""
    parsed = urlparse(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise DraftwiseError(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    try:
        port = parsed.port or 80
        addresses = {info[4][0] for info in socket.getaddrinfo(parsed.hostname, port, type=socket.SOCK_STREAM)}
    except (OSError, ValueError) as error:
        raise DraftwiseError(f"--url {url}: cannot resolve the host ({error})") from None
    if not allow_remote and not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise DraftwiseError(f"--url {url} is not a loopback address: a load test runs against a server on this "
                             "machine (pass --allow-remote to load a server you run elsewhere)")
    return parsed.hostname, port, parsed.path.rstrip("/")


class Client:
    def __init__(self, url: str, *, api_key: str | None = None, allow_remote: bool = False) -> None:
        self.host, self.port, self.base = check_url(url, allow_remote=allow_remote)
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def models(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        connection = self._connection(timeout)
        try:
            connection.request("GET", self.base + "/v1/models", headers=self.headers)
            response = connection.getresponse()
            body = response.read()
        except OSError as error:
            raise DraftwiseError(f"no server answers at http://{self.host}:{self.port} ({error}); start one with "
                                 "`draftwise serve`") from None
        finally:
            connection.close()
        if response.status != 200:
            raise DraftwiseError(f"GET /v1/models answered {response.status}: {_message(body)}")
        return json.loads(body)["data"]

    def stream(self, path: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """One streamed request, timed chunk by chunk; never runs past `deadline` (time.perf_counter())."""
        start = time.perf_counter()
        record: dict[str, Any] = {"ok": False, "start": start}
        connection = self._connection(max(0.5, deadline - start))
        try:
            connection.request("POST", self.base + path, body=json.dumps(body).encode(), headers=self.headers)
            response = connection.getresponse()
            if response.status != 200:
                record.update(status=response.status, error=_message(response.read()))
                return record
            stamps: list[float] = []
            text: list[str] = []
            usage = None
            finished = False
            while True:
                if time.perf_counter() > deadline:
                    record["error"] = "timed out (--timeout)"
                    return record
                line = response.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    finished = True
                    break
                event = json.loads(data)
                if "error" in event:
                    record["error"] = event["error"].get("message", str(event["error"]))
                    return record
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if piece:
                        stamps.append(time.perf_counter())
                        text.append(piece)
            end = time.perf_counter()
        except (OSError, http.client.HTTPException, ValueError) as error:
            record["error"] = f"{type(error).__name__}: {error}"
            return record
        finally:
            connection.close()
        if not finished or usage is None:
            record["error"] = "the stream ended without [DONE] and a usage chunk"
            return record
        tokens = usage["completion_tokens"]
        record.update(ok=True, end=end, e2e_s=end - start, text="".join(text), usage=usage, completion_tokens=tokens,
                      ttft_s=(stamps[0] - start) if stamps else None,
                      itl_s=[b - a for a, b in zip(stamps, stamps[1:])],
                      tpot_s=(stamps[-1] - stamps[0]) / (tokens - 1) if stamps and tokens > 1 else None)
        return record


def _message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def raw_post(url: str, body: bytes, *, api_key: str, read: int | None, wait: float = 0.0,
             path: str = "/v1/completions") -> bytes:
    """One HTTP/1.1 POST over a plain socket, for clients that misbehave on purpose: read everything (read=None),
    the first `read` bytes then close, or nothing (read=0, after `wait` seconds)."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                     + f"Authorization: Bearer {api_key}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                       .encode() + body)
        if wait:
            time.sleep(wait)
        got = b""
        while read is None or len(got) < read:
            piece = sock.recv(65536 if read is None else max(1, read - len(got)))
            if not piece:
                break
            got += piece
        return got


def percentiles(values: Sequence[float], points: Sequence[float] = (50, 95, 99)) -> dict[str, float | None]:
    """Linear-interpolated percentiles (numpy's default) and the mean; None when there is no value."""
    present = [v for v in values if v is not None]
    cuts = [float(v) for v in np.percentile(present, points)] if present else [None] * len(points)
    out: dict[str, float | None] = {f"p{p:g}": cut for p, cut in zip(points, cuts)}
    out["mean"] = sum(present) / len(present) if present else None
    return out


def request_body(prompt: Any, *, model: str, chat: bool, max_tokens: int, temperature: float,
                 override: dict[str, Any] | None, seed: int | None = None) -> tuple[str, dict[str, Any]]:
    """(path, body) of one streamed request with usage at the end."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    if override:
        body["draftwise"] = override
    if chat:
        body["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    if not isinstance(prompt, str):
        raise DraftwiseError("a raw-text load test (--no-chat) needs text prompts, not chat messages")
    body["prompt"] = prompt
    return "/v1/completions", body


def run_level(client: Client, bodies: Sequence[tuple[str, dict[str, Any]]], concurrency: int,
              deadline: float) -> dict[str, Any]:
    """Send every body with `concurrency` threads; the level's records and aggregates."""
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    position = iter(range(len(bodies)))

    def worker() -> None:
        while time.perf_counter() < deadline:
            with lock:
                index = next(position, None)
            if index is None:
                return
            path, body = bodies[index]
            record = client.stream(path, body, deadline)
            record["index"] = index
            with lock:
                records.append(record)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()) + 5.0)
    wall = time.perf_counter() - start
    return summarize(records, concurrency=concurrency, wall_s=wall, asked=len(bodies))


def summarize(records: list[dict[str, Any]], *, concurrency: int, wall_s: float, asked: int) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    spec = [r["usage"].get("draftwise") or {} for r in ok]
    calls = sum(s.get("target_calls", 0) for s in spec)
    drafted = sum(s.get("drafted", 0) for s in spec)
    return {
        "concurrency": concurrency,
        "requests_asked": asked,
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "requests_not_started": asked - len(records),
        "errors": sorted({r.get("error", f"HTTP {r.get('status')}") for r in failed})[:5],
        "wall_s": wall_s,
        "completion_tokens": tokens,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_s": percentiles([r["ttft_s"] for r in ok]),
        "itl_s": percentiles([gap for r in ok for gap in r["itl_s"]]),
        "tpot_s": percentiles([r["tpot_s"] for r in ok]),
        "e2e_s": percentiles([r["e2e_s"] for r in ok]),
        "mean_accepted_length": tokens / calls if calls else None,
        "acceptance_rate": sum(s.get("accepted", 0) for s in spec) / drafted if drafted else None,
        "method": sorted({s.get("method") for s in spec if s.get("method")}),
    }


def default_prompts(count: int) -> list[str]:
    """Spec-Bench evaluation prompts (first turns), round-robin over its tasks."""
    from draftwise.bench.datasets import load_prompts

    return [p.text for p in load_prompts(num_prompts=min(count, 96))]


def run(url: str, *, concurrency: Sequence[int], num_requests: int, max_tokens: int = 64, temperature: float = 0.0,
        chat: bool = True, prompts: Sequence[Any] | None = None, model: str | None = None, api_key: str | None = None,
        override: dict[str, Any] | None = None, seed: int | None = None, timeout_s: float = 600.0, warmup: int = 1,
        allow_remote: bool = False, progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The load test: warm-up requests at concurrency 1, then each level in order, all within `timeout_s`."""
    if num_requests < 1:
        raise DraftwiseError(f"--num-requests must be >= 1, got {num_requests}")
    if not concurrency or any(c < 1 or c > 1024 for c in concurrency):
        raise DraftwiseError(f"--concurrency takes numbers in [1, 1024], got {list(concurrency)}")
    if not timeout_s > 0:
        raise DraftwiseError(f"--timeout must be > 0 seconds, got {timeout_s}")
    deadline = time.perf_counter() + timeout_s
    client = Client(url, api_key=api_key, allow_remote=allow_remote)
    served = client.models()
    names = [m["id"] for m in served]
    model = model or names[0]
    if model not in names:
        raise DraftwiseError(f"the server serves {', '.join(names)}, not {model!r}")
    prompts = list(prompts) if prompts else default_prompts(num_requests)
    bodies = [request_body(prompts[i % len(prompts)], model=model, chat=chat, max_tokens=max_tokens,
                           temperature=temperature, override=override, seed=seed) for i in range(num_requests)]
    warm = [client.stream(*bodies[i % len(bodies)], deadline) for i in range(warmup)]
    if warm and not any(r["ok"] for r in warm):
        raise DraftwiseError(f"the warm-up request failed: {warm[0].get('error') or warm[0].get('status')}")
    levels = []
    for c in concurrency:
        if time.perf_counter() >= deadline:
            levels.append({"concurrency": c, "skipped": "timeout"})
            continue
        level = run_level(client, bodies, c, deadline)
        levels.append(level)
        if progress is not None:
            progress(level)
    base = next((lv for lv in levels if lv.get("concurrency") == 1 and lv.get("throughput_tok_s")), None)
    for level in levels:
        if base is not None and level.get("throughput_tok_s"):
            level["throughput_vs_c1"] = level["throughput_tok_s"] / base["throughput_tok_s"]
    return {
        "config": {"url": url, "model": model, "override": override or {}, "concurrency": list(concurrency),
                   "num_requests": num_requests, "max_tokens": max_tokens, "temperature": temperature, "chat": chat,
                   "seed": seed, "warmup": warmup, "timeout_s": timeout_s, "prompts": len(prompts),
                   "server": served[0].get("draftwise", {}) if served else {}},
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "levels": levels,
    }


def write_json(path: str, data: Any) -> None:
    """Atomically (a temporary file in the same folder, then os.replace): the benchmarks' writer."""
    from draftwise.atomic import write_json as write_atomically

    write_atomically(data, path)


def table(levels: Sequence[dict[str, Any]]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [f"{'conc':>4} {'ok':>5} {'fail':>4} {'tok/s':>8} {'vs c1':>6} {'TTFT p50':>9} {'p95':>7} "
             f"{'ITL p50':>8} {'p95':>7} {'MAL':>5}   (ms)"]
    for lv in levels:
        if "skipped" in lv:
            lines.append(f"{lv['concurrency']:>4} skipped ({lv['skipped']})")
            continue
        ratio = lv.get("throughput_vs_c1")
        mal = lv.get("mean_accepted_length")
        lines.append(
            f"{lv['concurrency']:>4} {lv['requests_ok']:>5} {lv['requests_failed']:>4} "
            f"{lv['throughput_tok_s'] or 0:>8.1f} {'-' if ratio is None else f'{ratio:.2f}x':>6} "
            f"{ms(lv['ttft_s']['p50']):>9} {ms(lv['ttft_s']['p95']):>7} {ms(lv['itl_s']['p50']):>8} "
            f"{ms(lv['itl_s']['p95']):>7} {'-' if mal is None else f'{mal:.2f}':>5}")
    return "\n".join(lines)
