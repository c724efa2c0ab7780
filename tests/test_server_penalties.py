"""The server's frequency_penalty, presence_penalty and logit_bias (OpenAI's semantics, per request) and its
`tools`: accepted, answered in text, refused with a 400 only where a tool call is required."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import draftwise
from conftest import save_pair
from draftwise.heads.loading import load_draft
from draftwise.models.loading import load_model
from draftwise.server import ServerConfig, Service, ThreadedServer, create_app

MODEL = "tiny"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} said {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}the model said{% endif %}")
PROMPTS = [[3, 17, 42, 8, 25, 3, 17], [5, 6, 5, 6, 5], [9, 10, 11, 12], [20, 21, 20]]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    target_dir, draft_dir = save_pair(tmp_path_factory.mktemp("penalty-models"))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(target_dir)
    target = load_model(target_dir)
    draft = load_draft(draft_dir, target)
    service = Service(ServerConfig(model_name=MODEL, method="sd", max_batch_size=8), target, draft)
    server = ThreadedServer(create_app(service), shutdown_timeout=5.0).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    yield {"target": target, "draft": draft, "client": client}
    server.stop()


def _complete(client, prompt, **body):
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, **body.pop("extra", {})}, **body)
    return answer.choices[0].text


def _api(served, prompt, **kwargs):
    return draftwise.generate(served["target"], prompt, draft=served["draft"], method="sd", temperature=0,
                              max_new_tokens=12, ignore_eos=True, **kwargs).text


def test_penalties_and_bias_answer_as_the_python_api_does(served):
    client = served["client"]
    plain = [_complete(client, p) for p in PROMPTS]
    for body, kwargs in ((dict(frequency_penalty=2.0), dict(frequency_penalty=2.0)),
                         (dict(presence_penalty=1.5), dict(presence_penalty=1.5)),
                         (dict(logit_bias={"13": 100}), dict(logit_bias={13: 100.0})),
                         (dict(frequency_penalty=-1.0, logit_bias={"4": 5, "9": -3}),
                          dict(frequency_penalty=-1.0, logit_bias={4: 5.0, 9: -3.0}))):
        answers = [_complete(client, p, **body) for p in PROMPTS]
        assert answers == [_api(served, p, **kwargs) for p in PROMPTS], body
        assert answers != plain, body  # the parameter did something
    # neutral values are the plain answer (the negative control)
    assert [_complete(client, p, frequency_penalty=0, presence_penalty=0.0, logit_bias={}) for p in PROMPTS] == plain


def test_concurrent_requests_with_different_penalties_answer_as_alone(served):
    """A request's penalties read its own tokens only: batch-mates with other settings change nothing."""
    client = served["client"]
    settings = [dict(frequency_penalty=2.0), dict(), dict(presence_penalty=2.0), dict(logit_bias={"13": 100}),
                dict(frequency_penalty=1.0, presence_penalty=-1.0), dict()]
    jobs = [(PROMPTS[i % len(PROMPTS)], s) for i, s in enumerate(settings)] * 2
    alone = [_complete(client, p, **dict(s)) for p, s in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: _complete(client, job[0], **dict(job[1])), jobs))
    assert together == alone


@pytest.mark.parametrize("body", [dict(frequency_penalty=2.5), dict(presence_penalty="1"),
                                  dict(frequency_penalty=True), dict(logit_bias={"x": 1}),
                                  dict(logit_bias={"5": 101}), dict(logit_bias=[5, 1]), dict(logit_bias={"64": 1})])
def test_bad_penalties_are_400_naming_the_parameter(served, body):
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].completions.create(model=MODEL, prompt="the cat", max_tokens=2, **body)
    error = caught.value.response.json()["error"]
    assert error["param"] == next(iter(body)), error


def test_tools_are_accepted_and_answered_in_text(served):
    client = served["client"]
    messages = [{"role": "user", "content": "the cat sat"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    for extra in (dict(tools=TOOLS), dict(tools=TOOLS, tool_choice="auto"), dict(tools=TOOLS, tool_choice="none"),
                  dict(tools=TOOLS, parallel_tool_calls=False), dict(tools=[])):
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, **extra)
        assert answer.choices[0].message.content == plain.choices[0].message.content
        assert not answer.choices[0].message.tool_calls


@pytest.mark.parametrize("extra, param", [
    (dict(tools=TOOLS, tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
    (dict(functions=[TOOLS[0]["function"]], function_call={"name": "get_weather"}), "function_call"),
])
def test_a_required_tool_call_is_a_clear_400(served, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the cat"}],
                                                 max_tokens=4, **extra)
    error = caught.value.response.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert "does not produce tool calls" in error["message"] and f"send {param} 'auto' or 'none'" in error["message"]


@pytest.mark.parametrize("extra, param", [(dict(tools="get_weather"), "tools"), (dict(tool_choice="sometimes"),
                                                                                  "tool_choice"),
                                          (dict(parallel_tool_calls="yes"), "parallel_tool_calls")])
def test_malformed_tool_fields_are_400(served, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the cat"}],
                                                 max_tokens=4, extra_body=extra)
    assert caught.value.response.json()["error"]["param"] == param
