"""The fault probe's findings (issue 23), one test each: inputs an attacker or a new user sends, answered 4xx,
never 500 and never with unbounded work; connections that misbehave; shutdown past its grace period."""

from __future__ import annotations

import functools
import json
import socket
import time

import openai
import pytest

from draftwise.server import ThreadedServer, bind, create_app
from draftwise.server.loadtest import raw_post
from test_server import (AUTH, KEY, MODEL, _assert_error, _client, _metrics, _raw, _rows, _start,  # noqa: F401
                         _total, _wait, models, served)


def _post(url, body, path="/v1/completions"):
    return _raw(url, path, body, headers=AUTH)


# ---- 1. every size a request can set is bounded

@pytest.mark.parametrize("override", [{"gamma": 1_000_000}, {"gamma": 33}, {"method": "bild", "max_window": 10**6},
                                      {"method": "token-cascade", "max_run": 10**6},
                                      {"method": "prompt-lookup", "max_ngram": 10**6},
                                      {"method": "suffix", "global_tokens": 10**12}])
def test_unbounded_integer_options_are_400(served, override):
    status, body, _ = _post(served["url"], {"model": MODEL, "prompt": "the cat", "max_tokens": 2, "draftwise": override})
    _assert_error(status, body, 400, says="<=" if "gamma" not in override else "[1, 32]")
    assert len(json.dumps(body)) < 2000


def test_per_position_counters_have_a_fixed_size(served):
    before = _metrics(served["url"])
    status, body, _ = _post(served["url"], {"model": MODEL, "prompt": "the cat", "max_tokens": 8,
                                            "draftwise": {"gamma": 32, "ignore_eos": True}})
    assert status == 200
    assert len(body["usage"]["draftwise"]["accepted_per_position"]) == 32
    positions = {dict(labels).get("position") for (name, labels) in _metrics(served["url"])
                 if name == "draftwise:spec_decode_num_accepted_tokens_per_pos_total"}
    assert positions - {None} <= {str(i) for i in range(32)}
    assert before  # the endpoint answered before and after


def test_api_and_cli_bound_gamma_and_window_options(models, capsys):
    import draftwise
    from draftwise import DraftwiseError
    from draftwise.cli import main

    with pytest.raises(DraftwiseError, match=r"gamma .* \[1, 32\]"):
        draftwise.generate(models["target"], "the cat", draft=models["draft"], gamma=10**6, max_new_tokens=2)
    with pytest.raises(DraftwiseError, match="max_window.*<= 64"):
        draftwise.generate(models["target"], "the cat", draft=models["draft"], method="bild", max_window=10**6,
                           temperature=0, max_new_tokens=2)
    assert main(["generate", "--target", str(models["target_dir"]), "--draft", str(models["draft_dir"]), "--gamma",
                 "1000000", "the cat"]) == 2
    err = capsys.readouterr().err.strip()
    assert "gamma" in err and len(err.splitlines()) == 1


# ---- 4. 400s, not 500s

def test_deeply_nested_json_is_400(served):
    deep = b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body, _ = _raw(served["url"], "/v1/completions", deep[:16_000], headers=AUTH)  # cut: invalid JSON
    _assert_error(status, body, 400)
    inner = [1]
    for _ in range(40):
        inner = [inner]
    nested = {"model": MODEL, "prompt": "x", "draftwise": {"a": inner}}
    status, body, _ = _post(served["url"], nested)
    _assert_error(status, body, 400, code="invalid_json", says="nests deeper")
    recursion = b"[" * 3000 + b"]" * 3000  # deep enough for the C parser's recursion limit
    status, body, _ = _raw(served["url"], "/v1/completions", recursion, headers=AUTH)
    _assert_error(status, body, 400)


@pytest.mark.parametrize("key", ["draft", "target", "max_new_tokens", "temperature", "top_p", "seed", "stop",
                                 "draft_given", "method_options", "frobnicate"])
def test_draftwise_keys_that_are_not_options_are_400(served, key):
    status, body, _ = _post(served["url"], {"model": MODEL, "prompt": "the cat", "max_tokens": 2,
                                            "draftwise": {key: 1}})
    _assert_error(status, body, 400, param=f"draftwise.{key}", code="unknown_option", says="has no option")


def test_lone_surrogates_are_400(served):
    for path, body in (("/v1/completions", b'{"model": "tiny", "prompt": "hi \\ud800"}'),
                       ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udfff"}]}'),
                       ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}')):
        status, answer, _ = _raw(served["url"], path, body, headers=AUTH)
        _assert_error(status, answer, 400, says="not valid Unicode")


# ---- 14. malformed chat messages

@pytest.mark.parametrize("message", [{"role": "user", "content": []}, {"role": "user", "content": "hi", "name": 5},
                                     {"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]},
                                     {"role": "user", "content": "hi", "name": ""}])
def test_malformed_messages_are_400(served, message):
    status, body, _ = _post(served["url"], {"model": MODEL, "messages": [message]}, "/v1/chat/completions")
    _assert_error(status, body, 400, param="messages")


# ---- 6. what benchmark and evaluation clients send (vLLM's extensions)

def test_guidellm_style_streaming_request_is_served_with_running_usage(served):
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 12, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "top_k": 5, "min_tokens": 3, "repetition_penalty": 1.1, "temperature": 0}
    status, text, _ = _post(served["url"], body)
    assert status == 200, text
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]
    assert counts == sorted(counts) and counts[-1] == 12  # ignore_eos: the whole budget
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks if c.get("usage"))
    for field, value in (("top_k", -2), ("min_tokens", -1), ("repetition_penalty", 0), ("repetition_penalty", 1e9),
                         ("ignore_eos", "yes")):
        status, answer, _ = _post(served["url"], {"model": MODEL, "prompt": "the cat", field: value})
        _assert_error(status, answer, 400, param=field)


def test_min_tokens_holds_back_end_of_sequence(models, served):
    eos = next(iter(models["target"].eos_token_ids))
    status, body, _ = _post(served["url"], {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 20, "min_tokens": 20,
                                            "temperature": 0, "draftwise": {"method": "ar"}})
    assert status == 200 and body["usage"]["completion_tokens"] == 20
    assert body["choices"][0]["finish_reason"] == "length" and eos is not None


# ---- 8. no key, no answer about what exists

def test_unknown_paths_and_methods_need_the_key_first(served):
    for path, method in (("/v1/embeddings", "POST"), ("/v1/nothing/here", "GET"), ("/v1/completions", "GET"),
                         ("/v1/models", "DELETE")):
        status, body, _ = _raw(served["url"], path, {} if method == "POST" else None, method=method)
        _assert_error(status, body, 401, code="invalid_api_key")
    assert _raw(served["url"], "/v1/embeddings", {}, headers=AUTH)[0] == 404
    assert _raw(served["url"], "/v1/completions", None, headers=AUTH, method="GET")[0] == 405


# ---- 5. TCP_NODELAY on accepted connections

def test_accepted_connections_have_tcp_nodelay():
    import asyncio

    sock = bind("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    seen = []

    async def main():
        async def handle(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


# ---- 9. idle and half-sent connections are closed

def test_idle_and_half_sent_connections_are_closed(models):
    service, _ = None, None
    from draftwise.server import ServerConfig, Service

    service = Service(ServerConfig(model_name=MODEL, method="ar"), models["target"])
    server = ThreadedServer(create_app(service), request_timeout=0.5).start()
    try:
        sockets = []
        for payload in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mo"):
            sock = socket.create_connection((server.host, server.port))
            sock.settimeout(5)
            sock.sendall(payload)
            sockets.append(sock)
        started = time.monotonic()
        for sock in sockets:
            data = sock.recv(4096)
            while data:  # a 4xx may come first; then the server closes
                data = sock.recv(4096)
            sock.close()
        assert time.monotonic() - started < 4
        assert _raw(server.url, "/health")[0] == 200  # the server is fine
    finally:
        server.stop()


# ---- 3. SIGTERM past the grace period: every client is answered

def test_shutdown_past_its_grace_period_answers_every_client(models, monkeypatch):
    import threading

    from draftwise.models.runner import ModelRunner

    forward = ModelRunner.forward_rows

    def slow(self, *args, **kwargs):
        time.sleep(0.01)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward_rows", slow)
    service, server = _start(models, draft=False, shutdown_timeout=0.3)
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 230, "temperature": 0, "ignore_eos": True}
    answers = {}

    def call(name, stream):
        answers[name] = _raw(server.url, "/v1/completions", {**body, "stream": stream})

    threads = [threading.Thread(target=call, args=(name, name == "stream")) for name in ("stream", "whole")]
    for thread in threads:
        thread.start()
    assert _wait(lambda: _rows(service) == 2)
    server.stop()
    for thread in threads:
        thread.join(30)
    status, text, _ = answers["stream"]
    assert status == 200
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    status, whole, _ = answers["whole"]
    _assert_error(status, whole, 503, says="shutting down")
    assert not service.worker.alive and _rows(service) == 0


# ---- 10-13. the API and the command line

def test_api_refuses_bad_text_and_stop_with_a_draftwise_error(models):
    import draftwise
    from draftwise import DraftwiseError

    for kwargs, says in ((dict(prompt="hi \ud800"), "not valid Unicode"), (dict(prompt="hi", stop=5), "stop must be"),
                         (dict(prompt="hi", stop=["\udfff"]), "stop string"),
                         (dict(prompt=[{"role": "user", "content": "x\ud801"}]), "not valid Unicode")):
        with pytest.raises(DraftwiseError, match=says):
            draftwise.generate(models["target"], method="ar", max_new_tokens=2, **kwargs)


def test_cli_errors_are_one_line(models, capsys, tmp_path):
    from draftwise.cli import main

    def one_line(argv, says, code=2):
        if code == "exit":
            with pytest.raises(SystemExit) as caught:
                main(argv)
            assert caught.value.code == 2
        else:
            assert main(argv) == code
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err

    target = str(models["target_dir"])
    one_line(["generate", "--target", target, "--method", "ar", "--no-chat", "caf\udce9"], "not valid UTF-8: byte 0xe9")
    one_line(["generate", "--target", str(tmp_path / "nope"), "hi"], "not found")
    one_line(["generate", "--bogus", "hi"], "unrecognized arguments: --bogus", code="exit")
    one_line(["serve", "--port", "x"], "invalid int value", code="exit")
    one_line(["generate", "--target", target, "--method", "ar", "--json", "hi"], "--json took 'hi'")
    # issue 39's probe: an output nothing can be written to is refused before any work (not a traceback after it)
    one_line(["generate", "--target", target, "--method", "ar", "--json", "/proc/x.json", "hi"],
             "--json /proc/x.json: cannot write in /proc")
    # ... and a target that is no model is reported as such, not as what the default method (sd) would need
    (tmp_path / "not-a-model.gguf").write_text("hello")
    (tmp_path / "empty").mkdir()
    one_line(["generate", "--target", str(tmp_path / "not-a-model.gguf"), "hi"], "not a GGUF file")
    one_line(["generate", "--target", str(tmp_path / "empty"), "hi"], "directory has no config.json")


def test_generate_json_takes_a_path_like_bench(models, capsys, tmp_path):
    from draftwise.cli import main

    out = tmp_path / "out.json"
    argv = ["generate", "--target", str(models["target_dir"]), "--method", "ar", "--temperature", "0",
            "--max-new-tokens", "3", "--no-chat"]
    assert main(argv + ["--json", str(out), "the cat"]) == 0
    written = json.loads(out.read_text())
    # The test models are random: the answer may end at EOS before its 3 tokens.
    assert 1 <= len(written["token_ids"]) <= 3
    assert len(written["token_ids"]) == 3 or written["stats"]["finish_reason"] == "eos"
    assert main(argv + ["the cat", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == written["token_ids"]


# ---- the fault suite: misbehaving clients mixed with good ones

_socket_request = functools.partial(raw_post, api_key=KEY)  # a raw POST: read all, some bytes, or nothing


def test_fault_suite_loses_mixes_and_leaks_nothing(models, served):
    """48 clients at once: good ones (streamed and not), ones that disconnect at random points, ones that never
    read, and malformed bodies. Every good answer equals its prompt decoded alone, every malformed one is a
    4xx, and afterwards no request holds a row or counts as in flight."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    import draftwise
    from draftwise.models.tiny import word_prompt

    service = served["service"]
    rng = random.Random(0)
    kinds = ["good", "good_stream", "disconnect", "never_read", "malformed"] * 10
    rng.shuffle(kinds)
    kinds = kinds[:48]

    def client(i):
        kind = kinds[i]
        body = {"model": MODEL, "prompt": word_prompt(i), "max_tokens": 12, "temperature": 0,
                "stream": kind != "good"}
        data = json.dumps(body).encode()
        if kind == "malformed":
            data = [data[: len(data) // 2], b"{\"model\": ", b"[1, 2", json.dumps({"model": MODEL}).encode()][i % 4]
            return kind, _socket_request(served["url"], data, read=None)
        if kind == "disconnect":
            return kind, _socket_request(served["url"], data, read=random.Random(i).randint(1, 400))
        if kind == "never_read":
            return kind, _socket_request(served["url"], data, read=0, wait=0.3)
        return kind, _socket_request(served["url"], data, read=None)

    with ThreadPoolExecutor(48) as pool:
        answers = list(pool.map(client, range(48)))
    for i, (kind, raw) in enumerate(answers):
        head, _, payload = raw.partition(b"\r\n\r\n")
        if kind == "malformed":
            assert head.split(b" ")[1].startswith(b"4"), raw[:200]
        elif kind in ("good", "good_stream"):
            assert head.startswith(b"HTTP/1.1 200"), raw[:200]
            text = payload.decode()
            if kind == "good":
                text = json.loads(text)["choices"][0]["text"]
            else:
                chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
                text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            alone = draftwise.generate(models["target"], word_prompt(i), draft=models["draft"], method="sd",
                                       temperature=0, max_new_tokens=12)
            assert text == alone.text, (i, kind)
    assert _wait(lambda: service.in_flight == 0 and _rows(service) == 0, timeout=20)


def test_a_body_shorter_than_its_content_length_gets_408_and_no_error_log(models, caplog):
    """Issue 39's probe: `Content-Length: 100` and 10 bytes was held until the connection timeout (30 s) and closed
    without an answer, logging `unhandled error ... ClientDisconnect`. Now: 408 after the body timeout; a client
    that leaves mid-body is counted (status 499), not logged as a server error."""
    from draftwise.server import ServerConfig, Service

    service = Service(ServerConfig(model_name=MODEL, method="ar", body_timeout_s=0.5), models["target"])
    server = ThreadedServer(create_app(service)).start()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    try:
        with caplog.at_level("INFO", logger="draftwise.server"):
            with socket.create_connection((server.host, server.port), timeout=10) as sock:
                started = time.monotonic()
                sock.sendall(head + b'{"model": ')
                answer = b""
                while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                    piece = sock.recv(4096)
                    if not piece:
                        break
                    answer += piece
                assert time.monotonic() - started < 5
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "request_timeout" and "10 bytes of the 100" in error["message"]
            with socket.create_connection((server.host, server.port), timeout=10) as sock:
                sock.sendall(head + b'{"model": ')
            assert _wait(lambda: _total(_metrics(server.url), "request_rejected_total", status=499) == 1, timeout=10)
            assert _raw(server.url, "/health")[0] == 200
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
    finally:
        server.stop()
