"""The Python API: `generate` and `stream`.

Both take the same arguments; every check on them runs before any model does.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from draftwise.errors import DraftwiseError, DraftwiseWarning
from draftwise.models.runner import kv_bytes_per_token
from draftwise.engine.rows import ParamError, Result, TokenLogprob
from draftwise.methods import METHODS, Method
from draftwise.builder import build_engine
from draftwise.plan import Plan, check_batch_size, make_plan, request_for, request_params, split_options, with_params
from draftwise.prompts import check_prompt, encode_prompt, split_prompts


@dataclass
class Generation:
    token_ids: list[int]  # new tokens only (an end-of-sequence token that ended generation included)
    text: str  # decoded new tokens, special tokens skipped, cut before a matched stop string
    stats: dict[str, Any]
    logprobs: list[TokenLogprob] | None = None  # per new token, when asked (`logprobs=k`)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (None for the first), when asked

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target call, bonus/recovered token included (`ar` = 1.0)."""
        return self.stats["new_tokens"] / max(self.stats["target_calls"], 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted-and-verified (0 when nothing was drafted)."""
        return self.stats["accepted"] / self.stats["drafted"] if self.stats["drafted"] else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "stats": self.stats,
            "rates": {"mean_accepted_length": self.mean_accepted_length, "acceptance_rate": self.acceptance_rate},
            **({"logprobs": [t.to_dict() for t in self.logprobs]} if self.logprobs is not None else {}),
            **({"prompt_logprobs": [t and t.to_dict() for t in self.prompt_logprobs]}
               if self.prompt_logprobs is not None else {}),
        }


def generate(
    target: Any,
    prompt: Any = None,
    *,
    messages: Any = None,
    draft: Any = None,
    method: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    gamma: int = 4,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    response_format: Any = None,
    max_batch_size: int = 16,
    kv_budget_mb: float | None = None,
    prefix_cache_mb: float = 0.0,
    **options: Any,
) -> Generation | list[Generation]:
    """Decode `prompt` with `method`; returns the new tokens, their text and the step counters.

    `method` left out: 'sd' with the draft given or the registry's draft for the target; for a target with neither
    (your own GGUF file, say) 'suffix', which needs none, with a one-line `DraftwiseWarning` saying so.

    A list of prompts (strings, token-id lists, chats) is decoded batched, `max_batch_size` rows at a
    time with continuous batching, and returns a list of `Generation`s in prompt order. `seed` seeds
    every request alike: request i gives the same tokens as `generate(target, prompts[i], seed=seed)`.
    Every random number is keyed by (seed, position, purpose) (engine/keyed.py), never taken from a stream, and
    lossless methods commit the target's own Gumbel-max draw at every position (the drafter-invariant coupling,
    `coupling="gumbel"`, the default): at any temperature they write `ar`'s tokens for the same seed, alone or
    batched, whatever their drafts, draft lengths or the suffix tries' history. `sd` with `coupling="rejection"`
    (standard speculative sampling, which accepts more) and the lossy rules (`lossy`, cascades) depend on which
    positions were drafted, so on draft lengths, though not on the batch-mates' draws.
    `kv_budget_mb` bounds the target's KV cache: a request joins only when its prompt plus
    `max_new_tokens` fits beside the live ones (one request always runs, whatever its size).
    `options` are the method's options (`draftwise methods`) and the request's (`engine.rows.RequestParams`: each
    field is a keyword, e.g. `presence_penalty=0.5`); a bad value is a one-line DraftwiseError naming it.
    `logprobs=k` gives each new token's log-probability under the target and its k most likely tokens
    (`Generation.logprobs`), read from the verification forward; `prompt_logprobs=k` the same for the prompt.
    Both are the target's raw log-softmax (before temperature, top-k / top-p and penalties).
    `frequency_penalty` and `presence_penalty` are OpenAI's: the target's logit of a token already generated in this
    request drops by frequency_penalty per time it was generated, plus presence_penalty once; `logit_bias`
    ({token id: bias}) adds to the target's logits. Like `repetition_penalty` they shape the target's distribution,
    which lossless methods then reproduce exactly; a row's penalties read its own tokens only, never a batch-mate's.
    `prefix_cache_mb` (a list of prompts) keeps that many megabytes of prompt prefixes' keys and values: a
    request admitted after another with the same prefix (64-token blocks) copies it instead of prefilling
    (`stats["cached_tokens"]`).
    `grammar` ({"json_schema": {...}}, {"json_object": True}, {"regex": "..."} or {"lark": "..."}) or OpenAI's
    `response_format` constrains every new token: the target's and the draft's logits are masked at every
    position, so a lossless method is exact towards the masked target distribution.
    """
    prompts, batch = split_prompts(messages if prompt is None and messages is not None else prompt)
    if prompt is not None and messages is not None:
        raise DraftwiseError("give a prompt or messages=..., not both")
    check_batch_size(max_batch_size)
    if kv_budget_mb is not None and (not isinstance(kv_budget_mb, (int, float)) or isinstance(kv_budget_mb, bool)
                                     or not kv_budget_mb > 0):
        raise DraftwiseError(f"kv_budget_mb must be a number > 0 (megabytes), got {kv_budget_mb!r}")
    if not isinstance(prefix_cache_mb, (int, float)) or isinstance(prefix_cache_mb, bool) \
            or not 0 <= prefix_cache_mb < float("inf"):
        raise DraftwiseError(f"prefix_cache_mb must be a number >= 0 (megabytes; 0: off), got {prefix_cache_mb!r}")
    for other in prompts[1:]:
        check_prompt(other)
    asked, method_options = split_options(options)
    params = request_params(asked, response_format=response_format)
    plan = make_plan(target=target, prompt=prompts[0], draft=draft, method=method, max_new_tokens=max_new_tokens,
                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, gamma=gamma, stop=stop,
                 ignore_eos=ignore_eos, method_options=method_options)
    plan = with_params(plan, params)
    if not batch:
        run = _Run(plan, streaming=False)
        for _ in run.pieces():
            pass
        return run.result()
    requests = [request_for(plan, plan.prompt_ids)] + [
        request_for(plan, encode_prompt(p, plan.target, plan.vocab_size)) for p in prompts[1:]]
    # the caller waits for every request: prompts are prefilled first, so the rows decode together (vLLM's offline
    # schedule); a server keeps the time budget that spares its decoding rows
    engine = build_engine(plan, max_batch_size, prefix_cache_mb=prefix_cache_mb, prefill_first=True)
    if kv_budget_mb is not None:
        engine.kv_budget_tokens = int(kv_budget_mb * 2**20 // kv_bytes_per_token(plan.target.model))
    ids = [engine.submit(request) for request in requests]
    cut = [r.max_new_tokens < plan.requested_new_tokens for r in requests]  # the window cut the budget
    if any(cut[1:]):  # the first prompt's cut was announced by make_plan
        warnings.warn(f"{sum(cut[1:])} more prompt(s) leave less than max_new_tokens={plan.requested_new_tokens} "
                      f"in the context window of {plan.window} (finish_reason 'context' where that ends them)",
                      DraftwiseWarning, stacklevel=2)
    engine.run()
    out = [generation_from(engine.result(i), plan.method) for i in ids]
    for generation, limited in zip(out, cut):
        if limited and generation.stats["finish_reason"] == "length":
            generation.stats["finish_reason"] = "context"
    return out


def stream(
    target: Any,
    prompt: Any = None,
    *,
    messages: Any = None,
    draft: Any = None,
    method: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    gamma: int = 4,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    response_format: Any = None,
    events: bool = False,
    **options: Any,
) -> Iterator[str] | Iterator[StreamEvent]:
    """Like `generate`, but yields text pieces as tokens are committed; they join to `generate(...).text`.

    With `events=True` it yields `StreamEvent`s instead: each piece of text with the token ids committed
    since the previous event (and their `logprobs`, when asked), and a last event (`finished=True`) carrying
    `finish_reason` and the stats.
    Arguments are checked (and models loaded) here, before the first piece is asked for.
    """
    if prompt is not None and messages is not None:
        raise DraftwiseError("give a prompt or messages=..., not both")
    asked, method_options = split_options(options)
    params = request_params(asked, response_format=response_format)
    if params.prompt_logprobs is not None:
        raise ParamError("prompt_logprobs", "stream does not return prompt_logprobs: use generate(..., "
                         "prompt_logprobs=k)")
    plan = make_plan(target=target, prompt=prompt if messages is None else None, messages=messages, draft=draft,
                 method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                 seed=seed, gamma=gamma, stop=stop, ignore_eos=ignore_eos, method_options=method_options)
    run = _Run(with_params(plan, params), streaming=True)
    return _stream_events(run) if events else run.pieces()


@dataclass(frozen=True)
class StreamEvent:
    """One step of `stream(..., events=True)`."""

    text: str  # new text (may be empty)
    token_ids: list[int]  # tokens committed since the previous event
    finished: bool = False
    finish_reason: str | None = None  # on the last event: "eos", "length", "stop", "context"
    stats: dict[str, Any] | None = None  # on the last event: the same stats as `generate`
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, with `logprobs=k`


def _stream_events(run: "_Run") -> Iterator[StreamEvent]:
    seen = 0

    def logprobs(end: int) -> list[TokenLogprob] | None:
        return None if run.plan.params.logprobs is None else run.logprobs[seen:end]

    for piece in run.pieces():
        end = len(run.token_ids)
        yield StreamEvent(piece, list(run.token_ids[seen:end]), logprobs=logprobs(end))
        seen = end
    yield StreamEvent("", list(run.token_ids[seen:]), True, run.stats.get("finish_reason"), dict(run.stats),
                      logprobs(len(run.token_ids)))


def batched_methods() -> list[str]:
    """Methods the batched engine runs: every method."""
    return list(METHODS)


def generation_from(result: Result, spec: Method) -> Generation:
    stats = dict(result.stats)
    if spec.kind.objective:
        stats["verifier_calls"] = stats["drafted"]  # the verifier scores every drafted token
    else:
        stats.pop("verifier_accepted", None)
    return Generation(token_ids=result.token_ids, text=result.text, stats=stats, logprobs=result.logprobs,
                      prompt_logprobs=result.prompt_logprobs)


class _Run:
    """One request in flight on an engine of its own: its text, tokens, log-probabilities and stats."""

    def __init__(self, plan: Plan, *, streaming: bool) -> None:
        self.plan = plan
        self.streaming = streaming
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text = ""
        self.stats: dict[str, Any] = {}
        self.result_logprobs: tuple[Any, Any] = (None, None)

    def pieces(self) -> Iterator[str]:
        """The request on the engine (a batch of one), its text piece by piece when streaming."""
        plan = self.plan
        engine = build_engine(plan, 1, stream_text=self.streaming)
        request_id = engine.submit(request_for(plan, plan.prompt_ids))
        try:
            while engine.has_work:
                for event in engine.step():
                    self.token_ids.extend(event.token_ids)
                    self.logprobs.extend(event.logprobs or ())
                    if self.streaming and event.text:
                        yield event.text
        finally:
            if engine.has_work:
                engine.cancel(request_id)
            result = engine.result(request_id)
            if result is not None:  # None only when a forward raised: the error propagates
                self.text = result.text
                self.result_logprobs = (result.logprobs, result.prompt_logprobs)
                self.stats = generation_from(result, plan.method).stats
                if plan.context_limited and result.finish_reason == "length":
                    self.stats["finish_reason"] = "context"

    def result(self) -> Generation:
        return Generation(token_ids=list(self.token_ids), text=self.text, stats=self.stats,
                          logprobs=self.result_logprobs[0], prompt_logprobs=self.result_logprobs[1])
