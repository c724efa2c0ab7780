"""Log-probabilities: each committed token's target log-probability (and top alternatives) read from the
verification forward, checked against a cache-free forward of the whole sequence under speculative methods
(accepted, rejected and bonus positions alike), the prompt's through prefill, and OpenAI's fields on both
endpoints, streamed and not."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

import draftwise
from conftest import near_copy, tiny_llama
from draftwise.errors import DraftwiseError
from draftwise.models.loading import load_model

PROMPT = [3, 17, 42, 8, 25, 3, 17]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return load_model(target), load_model(near_copy(target, scale=0.3))


def _reference(model, ids):
    """log-softmax of a cache-free forward over the whole sequence: [len(ids), vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("method,temperature", [("ar", 0.0), ("sd", 1.0), ("sd", 0.0), ("lossy", 1.0),
                                                ("prompt-lookup", 0.0), ("mtad", 1.0), ("mtjd", 0.0),
                                                ("oracle-diff", 1.0)])
def test_each_token_logprob_is_the_targets_at_its_position(models, method, temperature):
    target, draft = models
    kwargs = {"draft": draft} if method in ("sd", "lossy", "mtad", "oracle-diff") else {}
    for seed in range(3):
        out = draftwise.generate(target, PROMPT, method=method, temperature=temperature, seed=seed,
                                 max_new_tokens=20, logprobs=4, prompt_logprobs=2, **kwargs)
        assert len(out.logprobs) == len(out.token_ids)
        ref = _reference(target.model, PROMPT + out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(ref[len(PROMPT) - 1 + i, token].item(), abs=1e-4)
            values, ids = ref[len(PROMPT) - 1 + i].topk(4)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
        for i in range(1, len(PROMPT)):
            assert out.prompt_logprobs[i].logprob == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-4)
            assert len(out.prompt_logprobs[i].top) == 2
        if method == "sd":  # the check covered rejections: some step kept fewer than it drafted
            assert out.stats["accepted"] < out.stats["drafted"]


def test_greedy_tokens_are_the_top_alternative_and_batches_agree(models):
    target, draft = models
    prompts = [PROMPT, [5, 6, 5, 6, 5], [9, 10, 11, 12]]
    batch = draftwise.generate(target, prompts, draft=draft, method="sd", temperature=0, max_new_tokens=12,
                               logprobs=1)
    for prompt, out in zip(prompts, batch):
        alone = draftwise.generate(target, prompt, draft=draft, method="sd", temperature=0, max_new_tokens=12,
                                   logprobs=1)
        assert out.token_ids == alone.token_ids
        assert [e.logprob for e in out.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-4)
        assert all(e.top[0][0] == e.token_id for e in out.logprobs)


def test_stream_events_carry_the_logprobs_of_their_tokens(models):
    target, draft = models
    events = list(draftwise.stream(target, PROMPT, draft=draft, method="sd", temperature=0, max_new_tokens=12,
                                   logprobs=0, events=True))
    whole = draftwise.generate(target, PROMPT, draft=draft, method="sd", temperature=0, max_new_tokens=12, logprobs=0)
    assert all(len(e.logprobs) == len(e.token_ids) for e in events)
    assert [x.logprob for e in events for x in e.logprobs] == pytest.approx([x.logprob for x in whole.logprobs])
    assert not without_logprobs(target)


def without_logprobs(target):
    return draftwise.generate(target, PROMPT, method="ar", temperature=0, max_new_tokens=3).logprobs


def test_bad_values_and_methods_off_the_engine_are_refused(models):
    target, draft = models
    for bad in (-1, 21, 2.0, True, "3"):
        with pytest.raises(DraftwiseError, match="logprobs must be"):
            draftwise.generate(target, PROMPT, method="ar", logprobs=bad)
    with pytest.raises(DraftwiseError, match="seq-cascade cannot apply logprobs: a kept response is never scored"):
        draftwise.generate(target, PROMPT, draft=draft, method="seq-cascade", temperature=0, logprobs=1)


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import save_pair
    from draftwise.heads.loading import load_draft
    from draftwise.server import ServerConfig, Service, ThreadedServer, create_app

    target_dir, draft_dir = save_pair(tmp_path_factory.mktemp("logprob-models"))
    target = load_model(target_dir, dtype="float32")  # the reference forward below is fp32 too
    target.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                                      "{% if add_generation_prompt %}the{% endif %}")
    service = Service(ServerConfig(model_name="tiny", method="sd"), target, load_draft(draft_dir, target))
    running = ThreadedServer(create_app(service)).start()
    yield {"url": running.url, "target": target}
    running.stop()


def _post(url, path, body):
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read().decode()
    if not body.get("stream"):
        return json.loads(raw)
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def test_completions_logprobs_and_echo_match_a_cache_free_forward(server):
    target = server["target"]
    body = {"model": "tiny", "prompt": "the cat sat on", "max_tokens": 6, "temperature": 0, "logprobs": 3,
            "ignore_eos": True, "echo": True}
    out = _post(server["url"], "/v1/completions", body)
    choice = out["choices"][0]
    prompt_ids = target.tokenizer("the cat sat on")["input_ids"]
    lp = choice["logprobs"]
    n = len(lp["tokens"]) - len(prompt_ids)
    assert n == out["usage"]["completion_tokens"] and choice["text"].startswith("the cat sat on")
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _reference(target.model, prompt_ids)
    for i in range(1, len(prompt_ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, prompt_ids[i]].item(), abs=1e-4)
        assert len(lp["top_logprobs"][i]) <= 4 and lp["top_logprobs"][i][lp["tokens"][i]] == lp["token_logprobs"][i]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(t for t in lp["tokens"] if t != "</s>") == choice["text"]  # every token's text but EOS's
    streamed = _post(server["url"], "/v1/completions", {**body, "stream": True})
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in streamed:
        part = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
        for key in joined:
            joined[key] += part[key] if part else []
    assert joined == lp
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == choice["text"]


def test_completions_top_logprobs_hold_the_sampled_token(server):
    """Issue 39's probe: with logprobs=k, a sampled token outside the k best was missing from its top_logprobs;
    OpenAI and vLLM give up to k + 1 entries, the chosen token included."""
    body = {"model": "tiny", "prompt": "the cat sat on", "max_tokens": 24, "temperature": 1.0, "logprobs": 1,
            "ignore_eos": True, "seed": 3}
    lp = _post(server["url"], "/v1/completions", body)["choices"][0]["logprobs"]
    widths = []
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == logprob and 1 <= len(top) <= 2
        widths.append(len(top))
    assert 2 in widths  # at T=1 the tiny model samples tokens outside its best one


def test_chat_logprobs_streamed_equal_non_streamed(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the dog"}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    out = _post(server["url"], "/v1/chat/completions", body)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6
               and bytes(c["bytes"]).decode() == c["token"] for c in content)
    streamed = _post(server["url"], "/v1/chat/completions", {**body, "stream": True})
    parts = [x for c in streamed if c["choices"] and c["choices"][0]["logprobs"]
             for x in c["choices"][0]["logprobs"]["content"]]
    assert parts == content
    plain = _post(server["url"], "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"] == out["choices"][0]["message"]


@pytest.mark.parametrize("body,says", [({"top_logprobs": 2}, "needs logprobs"),
                                       ({"logprobs": True, "top_logprobs": 30}, "top_logprobs must be"),
                                       ({"logprobs": 2}, "logprobs must be true or false")])
def test_chat_logprob_errors_are_400(server, body, says):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "the dog"}], **body}
    with pytest.raises(urllib.error.HTTPError) as caught:
        _post(server["url"], "/v1/chat/completions", request)
    assert caught.value.code == 400 and says in json.loads(caught.value.read())["error"]["message"]


def test_prompt_logprobs_as_vllm_gives_them(server):
    """Issue 39's probe: the server refused vLLM's `prompt_logprobs` though generate() takes it. Each prompt token
    after the first: its own score, its true rank and the k best (a cache-free forward is the reference); the
    stream's first chunk carries the same; chat takes it too; echo keeps its own k."""
    target = server["target"]
    body = {"model": "tiny", "prompt": "the cat sat on the mat", "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 2, "ignore_eos": True}
    choice = _post(server["url"], "/v1/completions", body)["choices"][0]
    ids = target.tokenizer(body["prompt"])["input_ids"]
    ref = _reference(target.model, ids)
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None and choice["logprobs"] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        mine = scores[i][str(ids[i])]
        assert mine["logprob"] == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert mine["rank"] == int((row > row[ids[i]]).sum()) + 1
        assert mine["decoded_token"] == target.tokenizer.decode([ids[i]])
        best = row.topk(2).indices.tolist()
        assert set(scores[i]) == {str(t) for t in best} | {str(ids[i])}
        assert [scores[i][str(t)]["rank"] for t in best] == [1, 2]
    streamed = _post(server["url"], "/v1/completions", {**body, "stream": True})
    assert [c["choices"][0].get("prompt_logprobs") for c in streamed if c["choices"]][0] == scores
    echoed = _post(server["url"], "/v1/completions", {**body, "echo": True, "logprobs": 1})["choices"][0]
    assert echoed["prompt_logprobs"] == scores  # k = 2 for prompt_logprobs ...
    assert all(len(top) <= 2 for top in echoed["logprobs"]["top_logprobs"][1:])  # ... and 1 (+ the token) for echo
    chat = _post(server["url"], "/v1/chat/completions", {"model": "tiny", "prompt_logprobs": 0, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "the dog"}]})
    assert chat["choices"][0]["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["choices"][0]["prompt_logprobs"][1:])


@pytest.mark.parametrize("body,says", [
    ({"min_tokens": 10, "max_tokens": 3}, "min_tokens (10) must be at most max_tokens (3)"),
    ({"max_tokens": 10**30}, "context window is 256 tokens"),
    ({"max_tokens": 247}, "asks for 257 (10 in the prompt, 247 to generate)"),
    ({"seed": 2**64}, "seed must be an integer in [0, 2**64)"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be"),
])
def test_request_sizes_past_their_limits_are_400(server, body, says):
    """Issue 39's probe: these were accepted silently (vLLM answers 400); the seed's range was [0, 2**63) here and
    [0, 2**64) in generate()."""
    request = {"model": "tiny", "prompt": list(range(5, 15)), **body}  # 10 token ids
    with pytest.raises(urllib.error.HTTPError) as caught:
        _post(server["url"], "/v1/completions", request)
    assert caught.value.code == 400 and says in json.loads(caught.value.read())["error"]["message"]
    fits = {"model": "tiny", "prompt": list(range(5, 15)), "max_tokens": 246, "seed": 2**64 - 1, "min_tokens": 246}
    assert _post(server["url"], "/v1/completions", fits)["usage"]["completion_tokens"] == 246
