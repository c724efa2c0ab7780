"""Structured output under speculation (`benchmarks/structured.py`): chat prompts that each ask for a JSON object
about a city, decoded with the JSON schema SCHEMA (`run(..., schema=True)`) or without one; `valid` says whether an
answer parses and matches the schema; `summary` gives a round's tokens, speed and speculative counters."""

from __future__ import annotations

import json

import draftwise

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number"},
        "famous_for": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["name", "country", "population_millions", "famous_for"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Madrid", "Rome", "Seoul", "Nairobi", "Toronto",
          "Sydney", "Mumbai", "Lagos", "Hanoi", "Dublin"]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe the city of {CITIES[i % len(CITIES)]} as a JSON object with "
              "the keys name, country, population_millions and famous_for (a list)."}] for i in range(n)]


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
            and isinstance(value["population_millions"], (int, float)) and isinstance(value["famous_for"], list))


def run(target, draft, chats, *, method, seed, schema, max_new_tokens, batch) -> list:
    kwargs = {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}} \
        if schema else {}
    out = []
    for start in range(0, len(chats), batch):  # one seed per request: a batch of one shares nothing
        group = chats[start: start + batch]
        if batch == 1:
            out.append(draftwise.generate(target, messages=group[0], draft=draft, method=method, seed=seed + start,
                                          max_new_tokens=max_new_tokens, **kwargs))
        else:
            out += draftwise.generate(target, group, draft=draft, method=method, seed=seed + start,
                                      max_new_tokens=max_new_tokens, max_batch_size=batch, **kwargs)
    return out


def summary(out: list) -> dict:
    """Tokens, speed after each first token, and the speculative counters of a round's generations."""
    tokens = sum(len(g.token_ids) for g in out)
    calls = sum(g.stats["target_calls"] for g in out)
    drafted = sum(g.stats["drafted"] for g in out)
    decode_s = sum(g.stats["wall_time_s"] - (g.stats["time_to_first_token_s"] or 0.0) for g in out)
    return {"requests": len(out), "new_tokens": tokens, "target_calls_per_token": calls / max(tokens, 1),
            # after each request's first token: no prefill, no per-request set-up (answers differ in length)
            "decode_tokens_per_s": sum(max(len(g.token_ids) - 1, 0) for g in out) / max(decode_s, 1e-9),
            "mean_accepted_length": tokens / max(calls, 1),
            "acceptance_rate": sum(g.stats["accepted"] for g in out) / max(drafted, 1),
            "finish_reasons": {r: sum(g.stats["finish_reason"] == r for g in out)
                               for r in sorted({g.stats["finish_reason"] for g in out})}}
