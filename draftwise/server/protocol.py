"""OpenAI's wire format: request checks, response bodies, stream chunks and error bodies.

Pure functions over JSON-like values; nothing here touches a model. A parameter OpenAI defines but
draftwise does not implement is refused unless it holds its neutral value (`logprobs: null`,
`best_of: 1`, ...), so a client never gets an answer that silently ignored what it asked.
"""

from __future__ import annotations

import json
import numbers
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from draftwise.engine import rows
from draftwise.errors import short

# What `finish_reason` the engine reports -> OpenAI's word for it.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}

# The request options (engine.rows.RequestParams) are parameters too, by name (see wire_options)
_COMMON = ("model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options", "user",
           "draftwise",
           # vLLM's extensions that benchmark and evaluation clients send (guidellm, lm-eval)
           "top_k", "ignore_eos", "response_format", "prompt_logprobs")
COMPLETION_PARAMS = frozenset(_COMMON + ("prompt", "logprobs", "echo"))
# tools are accepted and answered in text; only a request that requires a tool call is refused (see _tools)
CHAT_PARAMS = frozenset(_COMMON + ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                   "tool_choice", "parallel_tool_calls", "functions", "function_call"))

# OpenAI parameters draftwise does not implement: accepted only at these neutral values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None,), "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "functions": (None, []), "function_call": (None, "none"),
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
}

# Keys of the `draftwise` body field that are not method options.
OVERRIDE_KEYS = ("method", "gamma", "top_k", "ignore_eos", "grammar")
MAX_GAMMA = 32  # draft tokens per step a request may ask for (the per-position counters have this many slots)
MAX_PENALTY = 100.0  # repetition_penalty's bound (1 = off): past it every seen token is as good as banned
MAX_OPENAI_PENALTY = 2.0  # frequency_penalty and presence_penalty lie in [-2, 2] (OpenAI's range)
MAX_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)
MAX_BIASED_TOKENS = 300  # OpenAI's limit on logit_bias entries
MAX_NESTING = 32  # JSON nesting a request body may have
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs; OpenAI's limit is 20 in chat, 5 in
# completions)


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
             429: "rate_limit_error",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.TYPES.get(self.status, "invalid_request_error"), self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class Parsed:
    """A checked request. `prompt` (completions) is text or token ids; `messages` (chat) are OpenAI's."""

    chat: bool
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None  # None: until the context window (chat's default)
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    top_k: int = 0  # 0: off
    # the request options read by name (wire_options), checked; service.prepare adds logprobs, prompt_logprobs (from
    # logprobs and echo below) and the grammar, then the plan checks them against the method
    params: rows.RequestParams = field(default_factory=lambda: rows.RequestParams())
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no log-probabilities
    echo: bool = False  # completions: the prompt is part of the answer (with logprobs, its tokens' too)
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt tokens' log-probabilities (and the k best)
    response_format: Any = None  # OpenAI's, checked with the grammar (grammar.grammar_from)
    override: dict[str, Any] = field(default_factory=dict)  # the `draftwise` field


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    for ok in allowed:
        if ok is None or isinstance(ok, bool):
            if value is ok:
                return True
        elif type(value) is type(ok) and value == ok or (_is_number(value) and _is_number(ok) and value == ok):
            return True
    return False


def parse(body: Any, *, chat: bool) -> Parsed:
    """Check a request body against what draftwise serves; raises ApiError(400) naming the parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    supported = (CHAT_PARAMS if chat else COMPLETION_PARAMS) | frozenset(wire_options())
    for key, value in body.items():
        if key in supported:
            continue
        if key in _NEUTRAL and _neutral(value, _NEUTRAL[key]):
            continue
        what = "is not supported by draftwise" if key in _NEUTRAL else "is not a parameter of this endpoint"
        raise ApiError(400, f"parameter {short(key)} {what}; supported: {', '.join(sorted(supported))}",
                       param=key[:40], code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: a model name from GET /v1/models", param="model")
    parsed = Parsed(chat=chat, model=model)
    if chat:
        parsed.messages = _messages(body.get("messages"))
        if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] is not None \
                and body["max_completion_tokens"] is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        parsed.max_tokens = _max_tokens(body.get(name), name, default=None)
    else:
        parsed.prompt = _prompt(body.get("prompt"))
        parsed.max_tokens = _max_tokens(body.get("max_tokens"), "max_tokens", default=16)  # OpenAI's default
    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature) or not 0 <= temperature <= 2:
            raise ApiError(400, f"temperature must be a number in [0, 2] (below 1e-5 means greedy), got "
                           f"{short(temperature)}",
                           param="temperature")
        parsed.temperature = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise ApiError(400, f"top_p must be a number in (0, 1], got {short(top_p)}", param="top_p")
        parsed.top_p = float(top_p)
    parsed.stop = _stop(body.get("stop"))
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed < 2**64:  # generate()'s range: a seed gives the same tokens in both
            raise ApiError(400, f"seed must be an integer in [0, 2**64), got {short(seed)}", param="seed")
        parsed.seed = int(seed)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(400, f"n must be 1 (one choice per request; send several requests for more), got {short(n)}",
                       param="n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {short(stream)}", param="stream")
    parsed.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not parsed.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        keys = ("include_usage", "continuous_usage_stats")
        if not isinstance(options, dict) or set(options) - set(keys) or not all(
                isinstance(options.get(k, False), bool) for k in keys):
            raise ApiError(400, "stream_options takes {'include_usage': true|false, 'continuous_usage_stats': "
                           f"true|false}}, got {short(options)}", param="stream_options")
        parsed.include_usage = bool(options.get("include_usage", False))
        parsed.continuous_usage = bool(options.get("continuous_usage_stats", False))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"user must be a string, got {short(user)}", param="user")
    _extensions(body, parsed)
    parsed.params = _options(body)
    if chat:
        _tools(body)
    _logprobs(body, parsed)
    minimum = parsed.params.min_new_tokens
    if parsed.max_tokens is not None and minimum > parsed.max_tokens:
        raise ApiError(400, f"min_tokens ({minimum}) must be at most max_tokens ({parsed.max_tokens})",
                       param="min_tokens")
    parsed.response_format = body.get("response_format")
    override = body.get("draftwise")
    if override is not None:
        if not isinstance(override, dict):
            raise ApiError(400, "'draftwise' must be an object such as {\"method\": \"sd\", \"gamma\": 4}",
                           param="draftwise")
        parsed.override = dict(override)
    return parsed


def _extensions(body: dict[str, Any], parsed: Parsed) -> None:
    """vLLM's sampling extensions: top_k, ignore_eos."""
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or top_k < -1:
            raise ApiError(400, f"top_k must be an integer >= 0 (0 or -1: off), got {short(top_k)}", param="top_k")
        parsed.top_k = max(0, int(top_k))
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, f"ignore_eos must be true or false, got {short(ignore_eos)}", param="ignore_eos")
        parsed.ignore_eos = ignore_eos


# Request options a body names otherwise (vLLM's min_tokens), and those it carries in its own shape: logprobs and
# prompt_logprobs (_logprobs, with echo), the grammar (response_format or the draftwise field; service.prepare)
WIRE_NAMES = {"min_new_tokens": "min_tokens"}
SHAPED_OPTIONS = ("logprobs", "prompt_logprobs", "grammar")


def wire_options() -> dict[str, str]:
    """Body parameter -> RequestParams name, for each request option a body gives by name."""
    return {WIRE_NAMES.get(name, name): name for name in rows.RequestParams.names() if name not in SHAPED_OPTIONS}


def _penalty_range(name: str, value: Any) -> float:
    if not _is_number(value) or not -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY:
        raise ApiError(400, f"{name} must be a number in [-{MAX_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}] (0: off), "
                       f"got {short(value)}", param=name)
    return float(value)


def _repetition_range(name: str, value: Any) -> float:
    if not _is_number(value) or not 0 < value <= MAX_PENALTY:
        raise ApiError(400, f"repetition_penalty must be a number in (0, {MAX_PENALTY:g}] (1: off), got "
                       f"{short(value)}", param=name)
    return float(value)


def _min_tokens(name: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise ApiError(400, f"min_tokens must be an integer >= 0, got {short(value)}", param=name)
    return int(value)


def _logit_bias(name: str, bias: Any) -> dict[int, float]:
    """{"token id": bias in [-100, 100]}, at most 300 entries; token ids are checked against the vocabulary when
    the request is planned."""
    if not isinstance(bias, dict) or len(bias) > MAX_BIASED_TOKENS:
        raise ApiError(400, f"logit_bias must be an object of at most {MAX_BIASED_TOKENS} entries mapping token ids "
                       f"(as strings) to numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {short(bias)}", param=name)
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()) or len(key) > 12:
            raise ApiError(400, f"logit_bias: key {short(key)} is not a token id (a string of digits)", param=name)
        if not _is_number(value) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise ApiError(400, f"logit_bias[{short(key)}] must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got "
                           f"{short(value)}", param=name)
        out[int(key)] = float(value)
    return out


# OpenAI's and vLLM's ranges, stricter than the Python API's (which any other option keeps): (parameter, value) ->
# the value, or ApiError(400) naming the parameter
WIRE_CHECKS = {"repetition_penalty": _repetition_range, "frequency_penalty": _penalty_range,
               "presence_penalty": _penalty_range, "logit_bias": _logit_bias, "min_tokens": _min_tokens}


def _options(body: dict[str, Any]) -> rows.RequestParams:
    """The request options the body gives by name, checked (ApiError(400) naming the parameter)."""
    values = {}
    for key, name in wire_options().items():
        value = body.get(key)
        if value is not None:
            values[name] = WIRE_CHECKS[key](key, value) if key in WIRE_CHECKS else value
    try:
        return rows.RequestParams.from_options(values)
    except rows.ParamError as error:
        wire = {name: key for key, name in wire_options().items()}
        raise ApiError(400, str(error), param=wire.get(error.param, error.param)) from None


def _tools(body: dict[str, Any]) -> None:
    """Tool definitions are accepted and the model answers in text (tool_choice "auto" or "none": a text answer is
    one of the answers they allow). A request that requires a tool call ("required", or a named function) is
    refused: draftwise does not produce tool calls."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)):
        raise ApiError(400, "tools must be a list of {'type': 'function', 'function': {...}} objects",
                       param="tools")
    functions = body.get("functions")
    if functions is not None and not (isinstance(functions, list) and all(isinstance(f, dict) for f in functions)):
        raise ApiError(400, "functions must be a list of function objects", param="functions")
    for name, free in (("tool_choice", ("none", "auto")), ("function_call", ("none", "auto"))):
        choice = body.get(name)
        if choice is None or choice in free:
            continue
        if choice == "required" or isinstance(choice, dict):
            which = "a call of a named function" if isinstance(choice, dict) else "a tool call"
            raise ApiError(400, f"{name} {short(choice)} requires {which}, and draftwise answers in text only (it "
                           f"does not produce tool calls): send {name} 'auto' or 'none', or leave it out",
                           param=name, code="unsupported_parameter")
        raise ApiError(400, f"{name} must be 'none', 'auto', 'required' or a named function, got {short(choice)}",
                       param=name)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, f"parallel_tool_calls must be true or false, got {short(parallel)}",
                       param="parallel_tool_calls")


def _logprobs(body: dict[str, Any], parsed: Parsed) -> None:
    """Chat: logprobs (true / false) and top_logprobs (0..20). Completions: logprobs (0..20) and echo. Both:
    prompt_logprobs (0..20, vLLM's)."""
    def top(value: Any, name: str) -> int:
        if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
            raise ApiError(400, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {short(value)}", param=name)
        return int(value)

    if body.get("prompt_logprobs") is not None:  # vLLM's extension, both endpoints
        parsed.prompt_logprobs = top(body["prompt_logprobs"], "prompt_logprobs")
    value = body.get("logprobs")
    if parsed.chat:
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"logprobs must be true or false, got {short(value)}", param="logprobs")
        count = body.get("top_logprobs")
        if count is not None and not value:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if value:
            parsed.logprobs = 0 if count is None else top(count, "top_logprobs")
        return
    if value is not None:
        parsed.logprobs = top(value, "logprobs")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ApiError(400, f"echo must be true or false, got {short(echo)}", param="echo")
    parsed.echo = bool(echo)


def text_error(text: str) -> str | None:
    """Why `text` cannot be encoded (a lone surrogate such as '\\ud800'), or None when it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"it holds {text[error.start]!a} at character {error.start}, which is not valid Unicode text"
    return None


def _check_text(text: str, param: str, what: str) -> str:
    problem = text_error(text)
    if problem is not None:
        raise ApiError(400, f"{what}: {problem}", param=param)
    return text


def nesting(value: Any, limit: int = MAX_NESTING) -> bool:
    """True when a parsed JSON value nests deeper than `limit` (no recursion: any depth is safe to check)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _max_tokens(value: Any, name: str, *, default: int | None) -> int | None:
    if value is None:
        return default
    if not _is_int(value) or value < 1:
        raise ApiError(400, f"{name} must be an integer >= 1, got {short(value)}", param=name)
    return int(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16 \
            or any(len(s) > 256 for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of at most 16 of them, each at most 256 "
                       f"characters; got {short(value)}", param="stop")
    return tuple(_check_text(s, "stop", "stop") for s in stops)


def _prompt(value: Any) -> str | list[int]:
    """One prompt: a string or token ids (also as a one-element list, as OpenAI's batch form)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "prompt is empty", param="prompt")
        return _check_text(value, "prompt", "prompt")
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return [int(t) for t in value]
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(400, f"got {len(value)} prompts: draftwise takes one prompt per request (send several "
                       "requests; they decode together)", param="prompt")
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise ApiError(400, "messages must be a non-empty list of {'role': ..., 'content': ...} objects",
                       param="messages")
    for i, message in enumerate(value):
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"messages[{i}]: field(s) {', '.join(sorted(map(str, extra)))[:200]} are not "
                           "supported (text messages only)", param="messages")
        if "name" in message and not (isinstance(message["name"], str) and message["name"]):
            raise ApiError(400, f"messages[{i}]: name must be a non-empty string, got {short(message['name'])}",
                           param="messages")
        if message.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}]: role must be system, developer, user or assistant, got "
                           f"{message.get('role')!r}", param="messages")
        content = message.get("content")
        if not isinstance(content, str) and not (isinstance(content, list) and content and all(
                isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text"
                and isinstance(p["text"], str) for p in content)):
            raise ApiError(400, f"messages[{i}]: content must be a string or a non-empty list of "
                           "{'type': 'text', 'text': ...} parts", param="messages")
        for text in [content] if isinstance(content, str) else [p["text"] for p in content]:
            _check_text(text, "messages", f"messages[{i}].content")
    return [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]} for m in value]


# ---------------------------------------------------------------- responses

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(stats: dict[str, Any], mean_accepted_length: float, acceptance_rate: float) -> dict[str, Any]:
    """OpenAI's usage plus this request's speculative statistics under `draftwise`."""
    drafted_per_position = stats.get("drafted_per_position") or []
    return {
        "prompt_tokens": stats["prompt_tokens"],
        "completion_tokens": stats["new_tokens"],
        "total_tokens": stats["prompt_tokens"] + stats["new_tokens"],
        "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)},
        "draftwise": {
            "method": stats["method"],
            "drafted": stats["drafted"],  # draft tokens sent to verification
            "accepted": stats["accepted"],  # of those, kept
            "num_drafts": drafted_per_position[0] if drafted_per_position else 0,  # steps with a draft
            "target_calls": stats["target_calls"],
            "draft_calls": stats["draft_calls"],
            "mean_accepted_length": mean_accepted_length,  # completion tokens per target call
            "acceptance_rate": acceptance_rate,
            "accepted_per_position": list(stats.get("accepted_per_position") or []),
            "finish_reason": stats["finish_reason"],
        },
    }


def chat_logprobs(entries: list[Any], piece: Any) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: entries are engine.TokenLogprob; piece(token id) -> its text."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(token_ids: list[int], entries: list[Any], piece: Any, offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions `logprobs`: per token its text, log-probability (None for a prompt's first token),
    its top alternatives as {text: logprob} with the token itself among them (up to k + 1 entries, as OpenAI and
    vLLM give) and its character offset in the answer's text (from `offset`)."""
    tokens, offsets = [], []
    for token_id in token_ids:
        tokens.append(piece(token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    def top(e: Any) -> dict[str, float]:  # the k best, and the chosen token when it is not among them (k + 1)
        return {piece(t): lp for t, lp in e.top} | {piece(e.token_id): e.logprob}

    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else top(e) for e in entries], "text_offset": offsets}


def prompt_logprobs(prompt_ids: list[int], entries: list[Any], piece: Any) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first token, then for each prompt token a map from token
    id (a string, in JSON) to {logprob, rank, decoded_token}, for the token itself and the k best."""
    out: list[dict[str, Any] | None] = []
    for token_id, e in zip(prompt_ids, entries):
        if e is None:
            out.append(None)
            continue
        ranked = {t: (lp, i + 1) for i, (t, lp) in enumerate(e.top)}
        ranked.setdefault(token_id, (e.logprob, e.rank))
        out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": piece(t)} for t, (lp, rank) in ranked.items()})
    return out


def completion_body(request_id: str, model: str, chat: bool, text: str, finish_reason: str,
                    usage_body: dict[str, Any], created: int, logprobs: dict[str, Any] | None = None,
                    prompt_scores: list[Any] | None = None) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_scores is not None:
        choice["prompt_logprobs"] = prompt_scores
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage_body}


def chunk(request_id: str, model: str, chat: bool, created: int, *, text: str | None = None,
          role: bool = False, finish_reason: str | None = None, with_usage: bool = False,
          usage_body: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None,
          prompt_scores: list[Any] | None = None) -> bytes:
    """One server-sent event in OpenAI's chunk format (vLLM's prompt_logprobs on the first that has them)."""
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_scores is not None:
        choice["prompt_logprobs"] = prompt_scores
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}
    if with_usage:
        body["usage"] = usage_body  # null, or the running counts (stream_options.continuous_usage_stats)
    return sse(body)


def usage_chunk(request_id: str, model: str, chat: bool, created: int, usage_body: dict[str, Any]) -> bytes:
    """The last chunk with `stream_options: {"include_usage": true}`: no choices, the usage."""
    return sse({"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model, "choices": [], "usage": usage_body})


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
