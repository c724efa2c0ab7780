"""`draftwise serve`: the OpenAI-compatible server, driven by the official `openai` client.

Servers run in-process (uvicorn in a thread) on 127.0.0.1 and a free port, over the tiny target/draft
pair that `save_pair` writes (with a chat template added to the target's tokenizer)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai  # the test extra's: the official client is what these tests hold the server to
import pytest

import draftwise
from conftest import save_pair
from draftwise.cli import main
from draftwise.heads.loading import load_draft
from draftwise.models.loading import load_model
from draftwise.models.tiny import word_prompt
from draftwise.server import ServerConfig, Service, ThreadedServer, create_app

KEY = "test-key-0123456789"
MODEL = "tiny"
# words from the tiny tokenizer's corpus, so every prompt is a few tokens
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} said {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}the model said{% endif %}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoTokenizer

    target_dir, draft_dir = save_pair(tmp_path_factory.mktemp("server-models"))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(target_dir)
    target = load_model(target_dir)
    return {"target_dir": target_dir, "draft_dir": draft_dir, "target": target, "draft": load_draft(draft_dir, target)}


def _start(models, *, draft=True, shutdown_timeout=30.0, **config):
    settings = {"model_name": MODEL, "method": "sd" if draft else "ar", "max_body_bytes": 16 * 1024, **config}
    service = Service(ServerConfig(**settings), models["target"], models["draft"] if draft else None)
    server = ThreadedServer(create_app(service), shutdown_timeout=shutdown_timeout).start()
    return service, server


@pytest.fixture(scope="module")
def served(models):
    """The main server: sd with the tiny draft, an API key, 16 rows, a 16 KiB body limit."""
    service, server = _start(models, api_key=KEY, max_batch_size=16, max_queue=64)
    yield {"service": service, "server": server, "url": server.url}
    server.stop()


@pytest.fixture(scope="module")
def bare(models):
    """A second server: ar only (no draft loaded), no key, one row and one queue slot."""
    service, server = _start(models, draft=False, max_batch_size=1, max_queue=1)
    yield {"service": service, "server": server, "url": server.url}
    server.stop()


def _client(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(served):
    return _client(served["url"])


def _raw(url, path, body=None, *, headers=None, method=None):
    """(status, parsed JSON or text, headers) of one plain HTTP request."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, raw, head = response.status, response.read(), response.headers
    except urllib.error.HTTPError as error:
        status, raw, head = error.code, error.read(), error.headers
    try:
        return status, json.loads(raw), head
    except ValueError:
        return status, raw.decode(), head


def _metrics(url) -> dict[tuple[str, tuple], float]:
    status, text, _ = _raw(url, "/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)', line)
        assert match, f"not Prometheus text: {line!r}"
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(3) or "")))
        out[(match.group(1), labels)] = float(match.group(4))
    return out


def _total(metrics, name, **where) -> float:
    return sum(v for (n, labels), v in metrics.items()
               if n == "draftwise:" + name and all((k, str(w)) in labels for k, w in where.items()))


def _stats(usage) -> dict:
    return usage.draftwise if hasattr(usage, "draftwise") else usage.model_extra["draftwise"]


# ---------------------------------------------------------------- endpoints

def test_models_health_and_metrics_endpoints(served, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert "cascade" in models.data[0].model_extra["draftwise"]["methods"]
    assert _raw(served["url"], "/health")[:2] == (200, {"status": "ok"})
    metrics = _metrics(served["url"])
    assert ("draftwise:num_requests_running", (("model_name", MODEL),)) in metrics


# ---------------------------------------------------------------- completions and chat

def test_completion_streamed_equals_non_streamed_and_decoding_alone(models, client):
    prompt = "the cat sat on the"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    alone = draftwise.generate(models["target"], prompt, draft=models["draft"], method="sd", temperature=0,
                               max_new_tokens=24)
    assert whole.object == "text_completion" and whole.choices[0].text == alone.text
    assert streamed == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason] == [{"length": "length", "eos": "stop"}[alone.stats["finish_reason"]]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert _stats(chunks[-1].usage) == _stats(whole.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_equals_non_streamed_and_applies_the_template(models, client):
    messages = [{"role": "system", "content": "the dog"}, {"role": "user", "content": "a tiny model"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    alone = draftwise.generate(models["target"], messages=messages, draft=models["draft"], method="sd", temperature=0,
                               max_new_tokens=20)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == streamed == alone.text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    templated = models["target"].tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert whole.usage.prompt_tokens == len(templated) == alone.stats["prompt_tokens"]


def test_stop_strings_and_seeded_sampling(client):
    first = client.completions.create(model=MODEL, prompt="the cat", max_tokens=30, temperature=0)
    text = first.choices[0].text
    stop = text[5:7] if len(text) > 8 else None
    if stop and stop.strip():
        cut = client.completions.create(model=MODEL, prompt="the cat", max_tokens=30, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]
    a, b = (client.completions.create(model=MODEL, prompt="the dog", max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize("override", [{"method": "ar"}, {}, {"method": "prompt-lookup"},
                                      {"method": "cascade", "rule": "token-v3", "alpha": 0.3},
                                      {"method": "sd", "gamma": 2}])
def test_usage_statistics_add_up(models, client, override):
    prompt = "the cat sat on the mat and the cat sat on the"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                         extra_body={"draftwise": override} if override else None)
    usage = response.usage
    stats = _stats(usage)
    assert stats["method"] == override.get("method", "sd")
    assert usage.prompt_tokens == len(models["target"].tokenizer(prompt)["input_ids"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= stats["accepted"] <= stats["drafted"]
    assert sum(stats["accepted_per_position"]) == stats["accepted"]
    assert stats["num_drafts"] <= stats["target_calls"]
    assert usage.completion_tokens <= stats["accepted"] + stats["target_calls"]  # one target token a step, at most
    assert stats["mean_accepted_length"] == pytest.approx(usage.completion_tokens / stats["target_calls"])
    if stats["method"] == "ar":
        assert stats["drafted"] == stats["num_drafts"] == 0 and stats["target_calls"] == usage.completion_tokens
    if stats["method"] in ("sd", "cascade"):
        assert stats["drafted"] > 0 and len(stats["accepted_per_position"]) == override.get("gamma", 4)


def test_a_companion_loaded_at_start_serves_the_companion_methods(models):
    """--companion: loaded once at start; `staged` then runs per request, and equals decoding alone."""
    companion = load_model(models["draft_dir"])
    service = Service(ServerConfig(model_name=MODEL, method="sd"), models["target"], models["draft"], companion)
    without = Service(ServerConfig(model_name=MODEL, method="sd"), models["target"], models["draft"])
    assert "staged" in service.runnable() and "companion" in without.refused["staged"]
    with ThreadedServer(create_app(service)) as server:
        response = _client(server.url).completions.create(model=MODEL, prompt="the cat sat", max_tokens=16,
                                                          temperature=0, extra_body={"draftwise": {"method": "staged"}})
    alone = draftwise.generate(models["target"], "the cat sat", draft=models["draft"], companion=companion,
                               method="staged", temperature=0, max_new_tokens=16)
    assert response.choices[0].text == alone.text and _stats(response.usage)["method"] == "staged"


# ---------------------------------------------------------------- bad input

def _assert_error(status, body, want_status, *, param=None, code=None, says=""):
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and says in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_invalid_json_is_400(served):
    status, body, _ = _raw(served["url"], "/v1/completions", b'{"model": "tiny", "prompt": ', headers=AUTH)
    _assert_error(status, body, 400, code="invalid_json", says="not valid JSON")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="the cat", max_tokens=4)
    _assert_error(404, caught.value.response.json(), 404, param="model", code="model_not_found", says="'gpt-4'")


@pytest.mark.parametrize("field,value", [("max_tokens", -3), ("max_tokens", 0), ("temperature", -1), ("top_p", 0),
                                         ("n", 2), ("stop", 5), ("seed", "x"), ("logprobs", 21), ("logprobs", True),
                                         ("echo", "yes")])
def test_bad_parameters_are_400_naming_the_parameter(served, field, value):
    status, body, _ = _raw(served["url"], "/v1/completions", {"model": MODEL, "prompt": "the cat", field: value},
                           headers=AUTH)
    _assert_error(status, body, 400, param=field)


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "function": {"name": "f"}}]),  # chat only
                                         ("best_of", 3), ("suffix", "x"), ("frobnicate", 1)])
def test_unsupported_parameters_are_refused_not_ignored(served, field, value):
    status, body, _ = _raw(served["url"], "/v1/completions", {"model": MODEL, "prompt": "the cat", field: value},
                           headers=AUTH)
    _assert_error(status, body, 400, param=field, code="unsupported_parameter")
    neutral = {"model": MODEL, "prompt": "the cat", "max_tokens": 2, "logprobs": None, "echo": False,
               "presence_penalty": 0, "best_of": 1}
    assert _raw(served["url"], "/v1/completions", neutral, headers=AUTH)[0] == 200


def test_unknown_method_override_is_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, extra_body={"draftwise": {"method": "nope"}})
    _assert_error(400, caught.value.response.json(), 400, code="unknown_method", says="this server runs: ar, sd")
    with pytest.raises(openai.BadRequestError) as caught:  # an option the method does not have
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=4,
                                  extra_body={"draftwise": {"method": "ar", "alpha": 0.3}})
    _assert_error(400, caught.value.response.json(), 400, says="has no option 'alpha'")
    with pytest.raises(openai.BadRequestError) as caught:  # a method that needs a file the server was not given
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=4,
                                  extra_body={"draftwise": {"method": "sprinter"}})
    _assert_error(400, caught.value.response.json(), 400, code="method_unavailable", says="needs a trained file")
    for method in ("mtad", "mtjd", "oracle-diff", "seq-cascade"):  # every method runs on the batched engine
        out = client.completions.create(model=MODEL, prompt="the cat", max_tokens=4,
                                        extra_body={"draftwise": {"method": method}})
        assert out.choices[0].finish_reason in ("length", "stop"), method


def test_an_override_never_loads_a_model_or_reads_a_file(models, bare, served, monkeypatch, tmp_path):
    from draftwise import plan
    from draftwise.heads import sprinter
    from draftwise.models import loading

    calls = []
    monkeypatch.setattr(sprinter.Verifier, "load", classmethod(lambda cls, *a, **k: calls.append(a)))
    for module in (plan, loading):
        original = module.load_model
        monkeypatch.setattr(module, "load_model", lambda spec, *a, _original=original, **k: calls.append(spec)
                            if isinstance(spec, str) else _original(spec, *a, **k))
    status, body, _ = _raw(bare["url"], "/v1/completions", {"model": MODEL, "prompt": "the cat",
                                                            "draftwise": {"method": "sd"}})
    _assert_error(status, body, 400, code="method_unavailable", says="needs a draft model")
    for override in ({"method": "sprinter", "verifier": str(tmp_path / "v.pt")},
                     {"method": "specdec++", "head": "/etc/hostname"},
                     {"method": "staged", "companion": models["draft_dir"]},
                     {"method": "sd", "companion": models["draft_dir"]}):
        status, body, _ = _raw(served["url"], "/v1/completions", {"model": MODEL, "prompt": "the cat",
                                                                  "draftwise": override}, headers=AUTH)
        assert status == 400, (override, body)
        _assert_error(status, body, 400)
    assert calls == []


def test_oversized_body_is_413(served):
    status, body, _ = _raw(served["url"], "/v1/completions", {"model": MODEL, "prompt": "the cat " * 5000},
                           headers=AUTH)
    _assert_error(status, body, 413, code="request_too_large", says="16384 bytes")


def test_prompt_over_the_context_window_is_400_with_the_sizes(served):
    status, body, _ = _raw(served["url"], "/v1/completions", {"model": MODEL, "prompt": list(range(1, 60)) * 5},
                           headers=AUTH)
    _assert_error(status, body, 400, param="prompt", code="context_length_exceeded", says="295 tokens")
    assert "256" in body["error"]["message"]


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Basic {KEY}", f"Bearer {KEY}x"])
def test_missing_or_wrong_api_key_is_401(served, header):
    status, body, head = _raw(served["url"], "/v1/completions", {"model": MODEL, "prompt": "the cat"},
                              headers={"Authorization": header} if header else {})
    _assert_error(status, body, 401, code="invalid_api_key")
    assert head["WWW-Authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        _client(served["url"], key="nope").completions.create(model=MODEL, prompt="the cat", max_tokens=2)
    assert _raw(served["url"], "/v1/models")[0] == 401


def test_unknown_route_uses_the_error_shape(served):
    status, body, _ = _raw(served["url"], "/v1/embeddings", {"model": MODEL}, headers=AUTH)
    _assert_error(status, body, 404)


# ---------------------------------------------------------------- concurrency and backpressure

def _rows(service) -> int:
    return sum(e["live"] + e["waiting"] for e in service.worker.snapshot().values())


def _wait(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_client_disconnect_stops_its_generation(served, client):
    service = served["service"]
    before = _metrics(served["url"])
    stream = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=230, temperature=0, stream=True,
                                       extra_body={"draftwise": {"ignore_eos": True}})
    pieces = iter(stream)
    next(pieces), next(pieces)
    stream.close()  # the client goes away mid-stream
    assert _wait(lambda: _rows(service) == 0 and service.in_flight == 0), service.worker.snapshot()
    cancelled = _total(before, "request_cancelled_total") + 1  # the metrics follow the rows' release a moment later
    assert _wait(lambda: _total(_metrics(served["url"]), "request_cancelled_total") == cancelled)
    after = _metrics(served["url"])
    generated = _total(after, "generation_tokens_total") - _total(before, "generation_tokens_total")
    assert 0 < generated < 230


def test_client_disconnect_stops_a_non_streamed_generation(served):
    import socket

    service = served["service"]
    before = _metrics(served["url"])
    body = json.dumps({"model": MODEL, "prompt": "the dog sat", "max_tokens": 230, "temperature": 0,
                       "draftwise": {"method": "sd", "ignore_eos": True}}).encode()
    with socket.create_connection((served["server"].host, served["server"].port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        assert _wait(lambda: _rows(service) == 1)
    assert _wait(lambda: _rows(service) == 0 and service.in_flight == 0)
    after = _metrics(served["url"])
    assert _total(after, "request_cancelled_total") == _total(before, "request_cancelled_total") + 1
    assert _total(after, "generation_tokens_total") - _total(before, "generation_tokens_total") < 230


def test_full_queue_is_429_with_retry_after(bare):
    service, client = bare["service"], _client(bare["url"], key="unused")
    body = dict(model=MODEL, prompt="the cat", max_tokens=230, temperature=0, stream=True,
                extra_body={"draftwise": {"ignore_eos": True}})
    running = client.completions.create(**body)  # takes the one row
    next(iter(running))
    waiting = client.completions.create(**body)  # takes the one queue slot
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="the dog", max_tokens=2)
        assert caught.value.response.headers["Retry-After"] == "1"
        _assert_error(429, caught.value.response.json(), 429, code="queue_full")
    finally:
        running.close()
        waiting.close()
    assert _wait(lambda: service.in_flight == 0 and _rows(service) == 0)
    after = client.completions.create(model=MODEL, prompt="the dog", max_tokens=2, extra_body={"draftwise": {
        "ignore_eos": True}})  # room again
    assert after.usage.completion_tokens == 2


OVERRIDES = [{}, {"method": "ar"}, {"method": "prompt-lookup"}, {"method": "cascade", "rule": "token-v3", "alpha": 0.3}]


def test_concurrent_load_no_request_lost_duplicated_or_mixed_and_metrics_add_up(models, served, client):
    """64 requests from 16 clients, over four engines at once: each answer equals its prompt decoded alone."""
    n, tokens = 64, 12
    prompts = [word_prompt(i) for i in range(n)]
    overrides = [OVERRIDES[i % len(OVERRIDES)] for i in range(n)]
    before = _metrics(served["url"])

    def ask(i):
        extra = {"draftwise": overrides[i]} if overrides[i] else None
        if i % 2:
            chunks = list(client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=tokens, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body=extra))
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
        response = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=tokens, temperature=0,
                                             extra_body=extra)
        return response.choices[0].text, response.usage

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(n)))
    after = _metrics(served["url"])

    for i, (text, usage) in enumerate(answers):
        options = dict(overrides[i])
        method = options.pop("method", "sd")
        draft = models["draft"] if draftwise.METHODS[method].needs_draft else None
        alone = draftwise.generate(models["target"], prompts[i], draft=draft, method=method, temperature=0,
                                   max_new_tokens=tokens, **options)
        assert text == alone.text, (i, method)
        assert usage.completion_tokens == alone.stats["new_tokens"] and _stats(usage)["method"] == method
    # the requests decoded together: some engine steps had several rows
    assert _total(after, "engine_step_rows_count") > _total(after, "engine_step_rows_bucket", le="1.0")
    # /metrics counters moved by exactly the sum of the responses' statistics
    stats = [_stats(u) for _, u in answers]
    for metric, total in [
        ("spec_decode_num_drafts_total", sum(s["num_drafts"] for s in stats)),
        ("spec_decode_num_draft_tokens_total", sum(s["drafted"] for s in stats)),
        ("spec_decode_num_accepted_tokens_total", sum(s["accepted"] for s in stats)),
        ("spec_decode_num_target_calls_total", sum(s["target_calls"] for s in stats)),
        ("prompt_tokens_total", sum(u.prompt_tokens for _, u in answers)),
        ("generation_tokens_total", sum(u.completion_tokens for _, u in answers)),
        ("request_success_total", n),
    ]:
        assert _total(after, metric) - _total(before, metric) == total, metric
    for position in range(4):
        moved = (_total(after, "spec_decode_num_accepted_tokens_per_pos_total", position=position)
                 - _total(before, "spec_decode_num_accepted_tokens_per_pos_total", position=position))
        assert moved == sum(s["accepted_per_position"][position] for s in stats
                            if position < len(s["accepted_per_position"]))
    assert _total(after, "time_to_first_token_seconds_count") - _total(before, "time_to_first_token_seconds_count") == n
    assert _total(after, "e2e_request_latency_seconds_count") - _total(before, "e2e_request_latency_seconds_count") == n


# ---------------------------------------------------------------- shutdown

def test_shutdown_lets_in_flight_requests_finish(models):
    service, server = _start(models, draft=False)
    client = _client(server.url, key="unused")
    stream = client.completions.create(model=MODEL, prompt="the cat", max_tokens=120, temperature=0, stream=True,
                                       extra_body={"draftwise": {"ignore_eos": True}})
    pieces = iter(stream)
    first = next(pieces)
    stopper = threading.Thread(target=server.stop)  # what SIGTERM does: should_exit, then a graceful drain
    stopper.start()
    rest = list(pieces)
    stopper.join(30)
    assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices[0].finish_reason] == ["length"]
    assert not server.thread.is_alive() and not service.worker.alive


def test_shutdown_past_its_grace_period_cancels_in_flight_requests(models, monkeypatch):
    from draftwise.models.runner import ModelRunner

    forward = ModelRunner.forward_rows

    def slow(self, *args, **kwargs):  # the tiny model would finish 230 tokens before the stop lands
        time.sleep(0.01)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward_rows", slow)
    service, server = _start(models, draft=False, shutdown_timeout=0.0)
    client = _client(server.url, key="unused")
    stream = client.completions.create(model=MODEL, prompt="the cat", max_tokens=230, temperature=0, stream=True,
                                       extra_body={"draftwise": {"ignore_eos": True}})
    pieces = iter(stream)
    next(pieces)
    server.stop()
    try:
        chunks = list(pieces)
    except (openai.APIError, OSError, ValueError):  # the connection closed mid-stream
        chunks = []
    assert not any(c.choices and c.choices[0].finish_reason for c in chunks)
    assert not server.thread.is_alive() and not service.worker.alive
    assert _rows(service) == 0
    cancelled = service.metrics.render()
    assert re.search(r'draftwise:request_cancelled_total\{[^}]*\} 1', cancelled)


# ---------------------------------------------------------------- the command line

def test_loadtest_command_against_a_running_server(served, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(word_prompt(i) for i in range(4)))
    out = tmp_path / "out" / "load.json"
    code = main(["loadtest", "--url", served["url"], "--concurrency", "1,3", "--num-requests", "4", "--no-chat",
                 "--prompts-file", str(prompts), "--max-tokens", "8", "--api-key", KEY, "--method", "prompt-lookup",
                 "--option", "max_ngram=2", "--ignore-eos", "--timeout", "60", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert level["requests_ok"] == 4 and level["requests_failed"] == 0
        assert level["completion_tokens"] == 32 and level["method"] == ["prompt-lookup"]
        assert 0 < level["ttft_s"]["p50"] <= level["ttft_s"]["p95"] and level["itl_s"]["p50"] > 0
    assert report["config"]["override"] == {"method": "prompt-lookup", "max_ngram": 2, "ignore_eos": True}
    assert "TTFT p50" in printed.out


def test_loadtest_refuses_a_remote_url_and_serve_a_busy_port(models, served, capsys):
    assert main(["loadtest", "--url", "http://192.0.2.1:8000", "--num-requests", "1"]) == 2
    assert "not a loopback address" in capsys.readouterr().err
    port = served["server"].port
    assert main(["serve", "--target", models["target_dir"], "--method", "ar", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", "--target", models["target_dir"], "--max-batch-size", "0"]) == 2
    assert "--max-batch-size must be >= 1" in capsys.readouterr().err


def test_sigterm_drains_a_real_serve_process(models):
    """`draftwise serve` as a process: SIGTERM lets the in-flight stream finish, then the process exits."""
    import os
    import signal
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "draftwise", "serve", "--target", models["target_dir"], "--method", "ar", "--port", "0",
         "--served-model-name", MODEL, "--log-level", "warning", "--threads", "1"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "DRAFTWISE_API_KEY": ""})
    try:
        line = process.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert match, line + process.stderr.read()
        url = f"http://127.0.0.1:{match.group(1)}"
        assert _wait(lambda: _raw(url, "/health")[0] == 200 if _port_open(url) else False, 30)
        stream = _client(url, key="unused").completions.create(
            model=MODEL, prompt="the cat", max_tokens=150, temperature=0, stream=True,
            extra_body={"draftwise": {"ignore_eos": True}})
        pieces = iter(stream)
        first = next(pieces)
        process.send_signal(signal.SIGTERM)
        rest = list(pieces)
        assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices[0].finish_reason] == ["length"]
        assert process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean drain
        assert not _port_open(url)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _port_open(url) -> bool:
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, int(port))) == 0


def test_requests_above_t0_draft_with_the_sampled_answer_head(tmp_path):
    """Issue 39: the server picked its draft once, without a temperature, so T > 0 requests drafted with the greedy
    head. With both heads loaded, a T=0 request drafts with the greedy one and a T=1 request with the sampled one,
    each on its own engine; methods that take no head are unaffected."""
    import torch
    from conftest import tiny_llama, tiny_tokenizer
    from test_eagle3 import _head

    from draftwise.server import protocol
    from draftwise.server.service import ServerConfig, Service

    tiny_llama(0, layers=4, width=32).save_pretrained(tmp_path / "target")
    tiny_tokenizer(64).save_pretrained(tmp_path / "target")
    target = load_model(str(tmp_path / "target"), dtype="float32")
    greedy, sampled = _head(target.model, torch.arange(64), seed=3), _head(target.model, torch.arange(64), seed=4)
    calls = {"greedy": 0, "sampled": 0}
    for name, head in (("greedy", greedy), ("sampled", sampled)):
        logits = head.logits  # every drafted token goes through the head's logits

        def counted(*args, _name=name, _logits=logits, **kwargs):
            calls[_name] += 1
            return _logits(*args, **kwargs)

        head.logits = counted
    service = Service(ServerConfig(model_name="tiny", method="sd"), target, greedy, sampled_draft=sampled)
    keys = []
    for temperature, used in ((0.0, "greedy"), (1.0, "sampled")):
        parsed = protocol.parse({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": temperature,
                                 "seed": 1}, chat=False)
        key, make_engine, request, spec = service.prepare(parsed)
        assert service.draft_for(spec, request.sampling) is {"greedy": greedy, "sampled": sampled}[used]
        before = dict(calls)
        engine = make_engine()
        engine.submit(request)
        engine.run()
        assert calls[used] > before[used] and calls[{"greedy": "sampled", "sampled": "greedy"}[used]] == \
            before[{"greedy": "sampled", "sampled": "greedy"}[used]]
        keys.append(key)
    assert keys[0] != keys[1]
    suffix = protocol.parse({"model": "tiny", "prompt": [5, 6], "temperature": 1.0, "draftwise": {"method": "suffix"}},
                            chat=False)
    assert service.prepare(suffix)[3].name == "suffix"


def test_work_called_on_the_engine_thread_runs_there_and_returns_or_raises():
    from draftwise.server.metrics import Metrics
    from draftwise.server.worker import EngineWorker

    worker = EngineWorker(metrics=Metrics("tiny"), max_batch_size=2)
    try:
        assert worker.call(threading.current_thread) is worker._thread
        with pytest.raises(ZeroDivisionError):
            worker.call(lambda: 1 / 0)
        worker.start()  # a second start does nothing
        assert worker.call(lambda: 7) == 7
    finally:
        worker.stop()
    assert not worker.alive


def test_the_warm_up_runs_the_default_engine_once_and_leaves_nothing_behind(models):
    """`draftwise serve` warms up before taking requests: one request through the default method's engine, which
    the worker then keeps for requests of its key. No metric, result or stored prefix stays from it, and the
    first real request answers as on a server that did not warm up."""
    from draftwise.server import service as service_module

    def start(warm: bool):
        service = Service(ServerConfig(model_name=MODEL, method="sd"), models["target"], models["draft"])
        seconds = service.warm_up() if warm else None
        return service, seconds

    ran_on = []
    from draftwise.engine.core import Engine

    real_run = Engine.run

    def run(self, *args, **kwargs):
        ran_on.append(threading.current_thread())
        return real_run(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "run", run)
        warmed, seconds = start(True)
    assert seconds is not None and seconds > 0
    # on the engine thread, which steps that engine later: stepping it on another thread than the one that warmed it
    # up ran ~1.5x slower (OpenMP's thread teams are per calling thread)
    assert ran_on == [warmed.worker._thread]
    (engine,) = warmed.worker._engines.values()
    assert engine.finished == {} and not engine.has_work
    assert engine.prefixes is None or engine.prefixes.lookup(list(range(1, 300))) == []
    assert engine._decode_s is not None  # the engine's timings are measured already
    cold, _ = start(False)
    body = {"model": MODEL, "prompt": word_prompt(3), "max_tokens": 12, "temperature": 0}
    answers = []
    for service in (warmed, cold):
        server = ThreadedServer(create_app(service)).start()
        try:
            status, answer, _ = _raw(server.url, "/v1/completions", body)
            assert status == 200, answer
            answers.append(answer["choices"][0]["text"])
            metrics = _metrics(server.url)
        finally:
            server.stop()
        assert sum(v for (name, _), v in metrics.items() if name.endswith("request_success_total")) == 1  # this one
    assert answers[0] == answers[1]
    assert len(warmed.worker._engines) == 1  # the request ran on the warm engine
    assert service_module.WARM_UP_TOKENS > 128  # longer than a prefill chunk
