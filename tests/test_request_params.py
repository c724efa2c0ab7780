"""One request-parameters object (engine.rows.RequestParams): a new request option is its field there (edit 1), the
engine code that applies it (edit 2) and, where a method cannot apply it, that method's `refuses` (edit 3). The
Python API, the plan, the server's request parsing, the CLI's flags and the row take it by name, with no edit.

The toy option here is one field on a subclass installed as `rows.RequestParams` (where every layer looks the
class up): that single declaration makes `generate(..., toy=3)`, a request body's `"toy": 3` and
`draftwise generate --toy 3` reach the engine's row, and bad values fail in one line naming it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

import draftwise
from draftwise.engine import rows
from draftwise.engine.core import Engine
from draftwise.errors import DraftwiseError
from draftwise.methods import METHODS
from draftwise.models.loading import load_model
from draftwise.models.tiny import tiny_llama
from draftwise.server import ServerConfig, Service, protocol

PROMPT = [3, 17, 42, 8, 25]


def _toy(value, vocab_size):
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 9:
        raise DraftwiseError(f"toy must be an integer in [0, 9], got {value!r}")
    return value


@dataclass(frozen=True)
class WithToy(rows.RequestParams):
    toy: int = rows.param(0, _toy, "a toy option: it reaches the row and changes nothing", flag=int)  # edit 1


@pytest.fixture(scope="module")
def target():
    return load_model(tiny_llama(0, eos=7))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(rows, "RequestParams", WithToy)
    submitted = []
    submit = Engine.submit

    def recording(engine, request):  # the request each row is made from, and the row itself
        row_id = submit(engine, request)
        submitted.append(next(row for row in engine.waiting if row.id == row_id))
        return row_id

    monkeypatch.setattr(Engine, "submit", recording)
    return submitted


def test_without_the_field_the_option_is_unknown_everywhere(target):
    with pytest.raises(DraftwiseError, match="no option 'toy'"):
        draftwise.generate(target, PROMPT, method="ar", max_new_tokens=2, toy=3)
    with pytest.raises(protocol.ApiError) as caught:
        protocol.parse({"model": "m", "prompt": "x", "toy": 3}, chat=False)
    assert caught.value.param == "toy" and caught.value.code == "unsupported_parameter"


def test_the_api_takes_the_new_option_to_the_row(target, toy):
    for call in (draftwise.generate, lambda *a, **k: "".join(draftwise.stream(*a, **k))):
        toy.clear()
        call(target, PROMPT, method="ar", max_new_tokens=2, toy=3)
        (row,) = toy
        assert row.request.params.toy == 3 and row.request.toy == 3
        assert isinstance(row.request.params, WithToy)
    toy.clear()
    draftwise.generate(target, [PROMPT, PROMPT[:3]], method="ar", max_new_tokens=2, toy=5)  # a batch: every row
    assert [row.request.toy for row in toy] == [5, 5]
    toy.clear()
    draftwise.generate(target, PROMPT, method="ar", max_new_tokens=2)
    assert toy[0].request.toy == 0  # the default: off


def test_a_bad_value_is_one_line_naming_the_option_before_any_model_loads(toy):
    for bad in (-1, 10, "3", True):
        with pytest.raises(rows.ParamError, match=r"^toy must be an integer in \[0, 9\]") as caught:
            draftwise.generate("/nonexistent/model", PROMPT, method="ar", toy=bad)
        assert caught.value.param == "toy" and "\n" not in str(caught.value)


def test_a_method_that_refuses_it_says_so(target, toy, monkeypatch):
    refusing = dataclasses.replace(METHODS["ar"], refuses=(("toy", "it has no toys"),))  # edit 3, where needed
    monkeypatch.setitem(METHODS, "ar", refusing)
    with pytest.raises(rows.ParamError, match="ar cannot apply toy: it has no toys"):
        draftwise.generate(target, PROMPT, method="ar", max_new_tokens=2, toy=3)
    draftwise.generate(target, PROMPT, method="ar", max_new_tokens=2)  # off: nothing to refuse


def test_the_server_parses_it_by_name_and_takes_it_to_the_row(target, toy):
    parsed = protocol.parse({"model": "m", "prompt": "x", "toy": 4}, chat=False)
    assert parsed.params.toy == 4
    for body in ({"toy": 12}, {"toy": "4"}):
        with pytest.raises(protocol.ApiError) as caught:
            protocol.parse({"model": "m", "prompt": "x", **body}, chat=False)
        assert caught.value.status == 400 and caught.value.param == "toy" and "toy must be" in caught.value.message
    service = Service(ServerConfig(model_name="m", method="ar", max_batch_size=2), target, None)
    _, make_engine, request, _ = service.prepare(
        protocol.parse({"model": "m", "prompt": PROMPT, "max_tokens": 2, "toy": 4}, chat=False))
    assert request.toy == 4
    engine = make_engine()
    engine.submit(request)
    assert toy[-1].request.params.toy == 4


def test_the_cli_has_a_flag_for_it(toy, capsys):
    from draftwise.cli import main

    assert main(["generate", "--target", "/nonexistent/model", "--method", "ar", "--toy", "12", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--toy must be an integer in [0, 9], got 12") and "\n" not in err, err


def test_the_shipped_options_keep_their_checks():
    """The options today: each bad value is one ParamError naming it; the server keeps OpenAI's ranges."""
    for name, bad in (("repetition_penalty", 0), ("min_new_tokens", -1), ("frequency_penalty", float("nan")),
                      ("presence_penalty", "1"), ("logit_bias", [3, 1.0]), ("logprobs", 21), ("prompt_logprobs", -1),
                      ("grammar", {"regex": ""})):
        with pytest.raises(rows.ParamError) as caught:
            rows.RequestParams.from_options({name: bad})
        assert caught.value.param == name and name in str(caught.value)
    assert rows.RequestParams.from_options({"logit_bias": {"5": 2}}).checked(64).logit_bias == ((5, 2.0),)
    with pytest.raises(rows.ParamError, match="logit_bias: key 99 is not a token id in"):
        rows.RequestParams.from_options({"logit_bias": {99: 1.0}}).checked(64)
    for body, param in (({"presence_penalty": 2.5}, "presence_penalty"), ({"min_tokens": -1}, "min_tokens"),
                        ({"repetition_penalty": 101}, "repetition_penalty"),
                        ({"logit_bias": {"1": 101}}, "logit_bias")):
        with pytest.raises(protocol.ApiError) as caught:
            protocol.parse({"model": "m", "prompt": "x", **body}, chat=False)
        assert caught.value.param == param
