"""Issue 55 through the server: JSON only (415 for any other declared body, or none), CORS off unless asked, and
temperatures below 1e-5 answered greedily."""

from __future__ import annotations

import http.client
import json

import pytest

import draftwise
from test_server import (AUTH, KEY, MODEL, _assert_error, _client, _metrics, _start, _total, bare, models,  # noqa: F401
                         served)

POST_PATHS = {"/v1/completions": {"model": MODEL, "prompt": "the cat", "max_tokens": 2, "temperature": 0},
              "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}],
                                       "max_tokens": 2, "temperature": 0}}
NOT_JSON = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", "text/json", "application/jsonl", "application/json-patch+json", "",
            None]


def _request(url, path, body: bytes | None, headers: dict[str, str], method: str = "POST"):
    """(status, parsed JSON or text, headers): http.client adds no Content-Type of its own (urllib would)."""
    host, port = url.split("//")[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw), response.headers
        except ValueError:
            return response.status, raw.decode(), response.headers
    finally:
        connection.close()


def _headers(content_type: str | None, **extra: str) -> dict[str, str]:
    return {**({"Content-Type": content_type} if content_type is not None else {}), **extra}


@pytest.mark.parametrize("path", sorted(POST_PATHS))
@pytest.mark.parametrize("content_type", NOT_JSON)
def test_a_post_that_is_not_json_gets_415(served, path, content_type):
    """Whatever the bytes (here valid JSON), a body not declared application/json is refused before any work."""
    before = _total(_metrics(served["url"]), "request_rejected_total", status=415)
    status, body, _ = _request(served["url"], path, json.dumps(POST_PATHS[path]).encode(),
                               _headers(content_type, **AUTH))
    _assert_error(status, body, 415, param="Content-Type", code="unsupported_media_type", says="application/json")
    assert _total(_metrics(served["url"]), "request_rejected_total", status=415) == before + 1


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_without_a_key_a_cross_site_simple_post_is_415_and_runs_nothing(bare, content_type):
    """The probe's case: no API key, a body a web page can send cross-site with no preflight."""
    before = _metrics(bare["url"])
    status, body, _ = _request(bare["url"], "/v1/completions", json.dumps(POST_PATHS["/v1/completions"]).encode(),
                               _headers(content_type, Origin="http://evil.example"))
    _assert_error(status, body, 415, code="unsupported_media_type")
    after = _metrics(bare["url"])
    for name in ("prompt_tokens_total", "generation_tokens_total"):
        assert _total(after, name) == _total(before, name)


def test_the_key_is_checked_before_the_content_type(served):
    status, body, _ = _request(served["url"], "/v1/completions", b"x", _headers("text/plain"))
    _assert_error(status, body, 401)


@pytest.mark.parametrize("path", sorted(POST_PATHS))
@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", " application/json ;charset=UTF-8"])
def test_json_in_its_spellings_is_served(served, path, content_type):
    status, body, _ = _request(served["url"], path, json.dumps(POST_PATHS[path]).encode(),
                               _headers(content_type, **AUTH))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1


def test_the_openai_client_is_served(served):
    out = _client(served["url"]).completions.create(model=MODEL, prompt="the cat", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_other_methods_and_paths_keep_their_answers(served):
    status, body, _ = _request(served["url"], "/v1/models", b"{}", _headers("text/plain", **AUTH))
    _assert_error(status, body, 405)
    status, body, _ = _request(served["url"], "/v1/models", None, AUTH, method="GET")
    assert status == 200 and body["data"][0]["id"] == MODEL


# ---- CORS: off unless asked

PREFLIGHT = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type"}


def test_cors_is_off_by_default(bare):
    status, _, head = _request(bare["url"], "/v1/completions", None, PREFLIGHT, method="OPTIONS")
    assert status == 405
    assert not any(name.lower().startswith("access-control-") for name in head)
    status, _, head = _request(bare["url"], "/v1/completions", json.dumps(POST_PATHS["/v1/completions"]).encode(),
                               _headers("application/json", Origin="http://evil.example"))
    assert status == 200  # served (curl, scripts), but a browser shows the page nothing: no Allow-Origin
    assert not any(name.lower().startswith("access-control-") for name in head)


def test_cors_when_asked_allows_the_named_origins_only(models):
    _, server = _start(models, draft=False, cors_origins=("http://ui.example",))
    try:
        ok = {**PREFLIGHT, "Origin": "http://ui.example"}
        status, _, head = _request(server.url, "/v1/completions", None, ok, method="OPTIONS")
        assert status == 200 and head["access-control-allow-origin"] == "http://ui.example"
        status, _, head = _request(server.url, "/v1/completions", None, PREFLIGHT, method="OPTIONS")
        assert status == 400 and "access-control-allow-origin" not in head
        status, body, head = _request(server.url, "/v1/completions", b"{}", _headers("text/plain",
                                                                                     Origin="http://ui.example"))
        _assert_error(status, body, 415)  # JSON only, CORS or not
    finally:
        server.stop()


def test_serve_help_documents_the_cors_flag(capsys):
    from draftwise.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--cors-origin ORIGIN" in out and "Off by default" in out and "415" in out


# ---- temperatures below 1e-5 are greedy

@pytest.mark.parametrize("path", sorted(POST_PATHS))
def test_a_tiny_temperature_through_the_server_is_the_greedy_answer(models, served, path):
    """`"temperature": 1e-300` once sampled garbage (every logit divided into +-inf); now it is greedy."""
    def answer(temperature):
        body = {**POST_PATHS[path], "max_tokens": 12, "temperature": temperature, "seed": 3,
                "draftwise": {"ignore_eos": True}}
        status, out, _ = _request(served["url"], path, json.dumps(body).encode(), _headers("application/json", **AUTH))
        assert status == 200, out
        choice = out["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    greedy = answer(0)
    assert [answer(t) for t in (1e-300, 5e-324, 1e-20, 9e-6)] == [greedy] * 4
    if path == "/v1/completions":
        alone = draftwise.generate(models["target"], "the cat", draft=models["draft"], method="sd", temperature=0,
                                   max_new_tokens=12, ignore_eos=True)
        assert greedy == alone.text


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_a_tiny_temperature_through_the_api_is_the_greedy_answer(models, method):
    def text(temperature):
        return draftwise.generate(models["target"], "the cat sat on", draft=models["draft"] if method == "sd" else None,
                                  method=method, temperature=temperature, seed=3, max_new_tokens=16,
                                  ignore_eos=True).text

    assert text(1e-300) == text(0) == text(1e-6)
