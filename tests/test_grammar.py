"""Structured output under speculation: every committed token obeys the request's grammar.

- Exactness: `sd` with a grammar samples the *masked* target distribution. The joint distribution of the
  first two new tokens over N_EXACT seeded runs is compared (Pearson chi-square, cells expected below 5
  pooled, significance ALPHA) with the exact one computed here without the engine: a cache-free forward of
  the target per prefix, softmax over the tokens the grammar allows there (llguidance's mask), multiplied.
  Negative control: the same runs with the target's mask switched off in verification (drafts still
  masked) must be rejected.
- Every output parses: many seeds, every batched method, a JSON schema and a regular expression.
- The matcher follows drafts and rolls back on rejection (tested directly), and bad grammars are one-line
  DraftwiseErrors; the server's response_format is 400 for bad input and parses for good.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import draftwise
from conftest import json_tokenizer, near_copy, tiny_llama
from test_exactness import pooled_chisquare
from draftwise.errors import DraftwiseError
from draftwise.engine.grammar import GrammarCompiler, grammar_from
from draftwise.models.loading import load_model

ALPHA = 1e-3  # significance of each goodness-of-fit test
N_EXACT = 2000  # seeded runs per goodness-of-fit test
PROMPT = [34, 1]  # '{"'
REGEX = r"(cat|dog|fal)[0-9]"  # a finite language: every answer ends
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["cat", "dog"]}},
          "required": ["a", "b"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def pair():
    tok = json_tokenizer(64)
    target = tiny_llama(0, init=0.3, eos=0)
    return (load_model(target, tokenizer=tok), load_model(near_copy(target, scale=0.2), tokenizer=tok), tok)


def _masked_joint(model, tok, prompt, grammar) -> dict[tuple[int, ...], float]:
    """P(first two new tokens) under the masked target at T=1, with llguidance's masks, no engine."""
    compiler = GrammarCompiler(tok, 64, [0])
    out: dict[tuple[int, ...], float] = {}

    def logp(prefix):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt + prefix])).logits[0, -1].float(), -1)

    state = compiler.state(grammar, torch.device("cpu"))
    first = state.mask()
    p1 = torch.softmax(logp([]).masked_fill(~first, float("-inf")), -1)
    for t1 in first.nonzero()[:, 0].tolist():
        if t1 == 0:  # EOS ends the answer: a one-token outcome
            out[(t1,)] = p1[t1].item()
            continue
        assert state.follow([t1]) == 1
        second = state.masks(1)[1]
        p2 = torch.softmax(logp([t1]).masked_fill(~second, float("-inf")), -1)
        for t2 in second.nonzero()[:, 0].tolist():
            out[(t1, t2)] = p1[t1].item() * p2[t2].item()
        state.rewind()
    return out


def _runs(target, draft, grammar, n, rates=None):
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(n):
        out = draftwise.generate(target, PROMPT, draft=draft, method="sd", temperature=1.0, seed=seed,
                                 max_new_tokens=2, gamma=3, grammar=grammar)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        if rates is not None:
            rates.append((out.stats["accepted"], out.stats["drafted"]))
    return counts


def _p_value(counts, exact):
    assert set(counts) <= set(exact), f"outcomes outside the grammar: {set(counts) - set(exact)}"
    cells = sorted(exact)
    return pooled_chisquare(np.array([counts.get(c, 0) for c in cells], float), np.array([exact[c] for c in cells]))


def test_sd_with_a_grammar_samples_the_masked_target_distribution(pair):
    target, draft, tok = pair
    grammar = {"regex": "[a-z]+[0-9]"}
    exact = _masked_joint(target.model, tok, PROMPT, grammar_from(grammar))
    assert len(exact) > 50  # many outcomes, so drafts are both accepted and rejected
    rates: list[tuple[int, int]] = []
    counts = _runs(target, draft, grammar, N_EXACT, rates)
    accepted, drafted = (sum(x) for x in zip(*rates))
    assert 0.2 < accepted / drafted < 0.9  # drafts were both accepted and rejected
    assert _p_value(counts, exact) > ALPHA


def test_negative_control_an_unmasked_target_is_caught(pair, monkeypatch):
    from draftwise.engine.core import Engine

    target, draft, tok = pair
    grammar = {"regex": "[a-z]+[0-9]"}
    exact = _masked_joint(target.model, tok, PROMPT, grammar_from(grammar))
    monkeypatch.setattr(Engine, "_grammar_masked", lambda self, rows, grammars, d, logits: logits)
    counts = _runs(target, draft, grammar, N_EXACT // 2)  # observed: 689 of 1000 outside the grammar
    outside = sum(n for c, n in counts.items() if c not in exact)
    inside = {c: n for c, n in counts.items() if c in exact}
    assert outside > 0 or _p_value(inside, exact) < ALPHA


@pytest.mark.parametrize("method", ["sd", "ar", "prompt-lookup", "suffix", "lossy", "cascade", "token-cascade",
                                    "fly", "hybrid", "oracle-diff", "seq-cascade"])
def test_every_output_parses(pair, method):
    target, draft, _ = pair
    needs_draft = method in ("sd", "lossy", "cascade", "token-cascade", "fly", "hybrid", "oracle-diff", "seq-cascade")
    kwargs = {"draft": draft} if needs_draft else {}
    seeds = 200 if method == "sd" else 25
    for seed in range(seeds):
        out = draftwise.generate(target, PROMPT, method=method, seed=seed, temperature=1.0, max_new_tokens=40,
                                 response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": SCHEMA}},
                                 **kwargs)
        value = json.loads(out.text)
        assert set(value) == {"a", "b"} and isinstance(value["a"], bool) and value["b"] in ("cat", "dog")
        regex = draftwise.generate(target, PROMPT, method=method, seed=seed, temperature=1.0, max_new_tokens=10,
                                   grammar={"regex": REGEX}, **kwargs)
        assert re.fullmatch(REGEX, regex.text), regex.text


def test_greedy_with_a_grammar_equals_ar_with_it_and_batches_agree(pair):
    target, draft, _ = pair
    prompts = [PROMPT, [34], [1, 16]]
    grammar = {"json_schema": SCHEMA}
    ar = [draftwise.generate(target, p, method="ar", temperature=0, max_new_tokens=40, grammar=grammar).token_ids
          for p in prompts]
    sd = draftwise.generate(target, prompts, draft=draft, method="sd", temperature=0, max_new_tokens=40,
                            grammar=grammar)
    assert [g.token_ids for g in sd] == ar
    assert sd[0].stats["accepted"] > 0


def test_the_matcher_follows_drafts_and_rolls_back(pair):
    _, _, tok = pair
    state = GrammarCompiler(tok, 64, [0]).state(grammar_from({"regex": REGEX}), torch.device("cpu"))
    cat, dog = tok("cat")["input_ids"], tok("dog")["input_ids"]
    assert state.follow(cat + [5]) == len(cat) + 1
    assert state.follow(dog + [0]) == len(dog)  # EOS is refused before a digit
    masks = state.masks(len(dog))
    assert masks.shape == (len(dog) + 1, 64) and not masks[-1, 0] and masks[-1, 3:13].all()
    state.commit(dog[:1])
    assert state.path == [] and state.follow(dog[1:]) == len(dog) - 1
    state.rewind()
    assert state.path == [] and state.mask().sum() < 64


@pytest.mark.parametrize("value,says", [
    ({"regex": "(("}, "does not compile"), ({"yaml": "x"}, "unknown grammar kind"), ({"regex": ""}, "non-empty"),
    ("x", "grammar must be one of"), ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_object": 1}, "takes True")])
def test_bad_grammars_are_one_line_errors(pair, value, says):
    target, _, _ = pair
    with pytest.raises(DraftwiseError, match=says) as caught:
        draftwise.generate(target, PROMPT, method="ar", grammar=value)
    assert "\n" not in str(caught.value)


def test_refusals_name_the_reason(pair):
    target, draft, _ = pair
    with pytest.raises(DraftwiseError, match="mtjd cannot apply a grammar: its beams are searched without"):
        draftwise.generate(target, PROMPT, method="mtjd", temperature=0, grammar={"regex": REGEX})
    with pytest.raises(DraftwiseError, match="ignore_eos"):
        draftwise.generate(target, PROMPT, method="ar", ignore_eos=True, grammar={"regex": REGEX})
    with pytest.raises(DraftwiseError, match="not both"):
        draftwise.generate(target, PROMPT, method="ar", grammar={"regex": REGEX},
                           response_format={"type": "json_object"})
    with pytest.raises(DraftwiseError, match="response_format type"):
        draftwise.generate(target, PROMPT, method="ar", response_format={"type": "xml"})


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server(pair):
    from draftwise.server import ServerConfig, Service, ThreadedServer, create_app

    target, draft, _ = pair
    service = Service(ServerConfig(model_name="tiny", method="sd"), target, draft)
    running = ThreadedServer(create_app(service)).start()
    yield running.url
    running.stop()


def _post(url, body, path="/v1/completions"):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    if body.get("stream"):
        chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        return 200, "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return 200, json.loads(raw)


def test_server_response_format_and_grammar_field(server):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    for seed in range(10):
        status, body = _post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "seed": seed,
                                      "response_format": schema})
        assert status == 200 and json.loads(body["choices"][0]["text"])["b"] in ("cat", "dog")
        status, text = _post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "seed": seed,
                                      "stream": True, "draftwise": {"grammar": {"regex": REGEX}}})
        assert status == 200 and re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}, "response_format"),
    ({"draftwise": {"grammar": {"regex": "(("}}}, "draftwise.grammar"),
    ({"draftwise": {"method": "ar"}, "ignore_eos": True, "response_format": {"type": "json_object"}},
     "response_format")])
def test_server_bad_grammars_are_400(server, body, param):
    status, answer = _post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **body})
    assert status == 400 and answer["error"]["param"] == param and "\n" not in answer["error"]["message"]


def test_cli_takes_a_regex_a_schema_file_and_logprobs(tmp_path, capsys):
    from draftwise.cli import main

    directory = tmp_path / "target"
    tiny_llama(0, init=0.3, eos=0).save_pretrained(directory)
    json_tokenizer(64).save_pretrained(directory)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    base = ["generate", "--target", str(directory), "--method", "ar", "--no-chat", "--max-new-tokens", "40",
            "--json", "-", "--logprobs", "2"]
    assert main(base + ["--regex", REGEX, '{"']) == 0
    out = json.loads(capsys.readouterr().out)
    assert re.fullmatch(REGEX, out["text"]) and len(out["logprobs"]) == len(out["token_ids"])
    assert main(base + ["--json-schema", str(schema), '{"']) == 0
    assert json.loads(json.loads(capsys.readouterr().out)["text"])["b"] in ("cat", "dog")
    assert main(["generate", "--target", str(directory), "--method", "ar", "--regex", "((", "x"]) == 2
    assert "does not compile" in capsys.readouterr().err
