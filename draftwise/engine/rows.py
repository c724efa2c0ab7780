"""What the engine keeps per request: the request and its options (`RequestParams`), its row, counters,
log-probabilities, text, and what a step reports (`Event`) and a finished request leaves (`Result`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from draftwise.errors import DraftwiseError
from draftwise.engine.grammar import Grammar, GrammarState, grammar_from
from draftwise.engine.sampling import SamplingConfig

MAX_LOGPROBS = 20  # top alternatives a request may ask for (vLLM's default max_logprobs)


class ParamError(DraftwiseError):
    """A request option with a bad value, or one the method cannot apply: the message is one line and names it;
    `param` is the option's name (the server's 400 names it too)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Param:
    """How a request option is checked and offered, kept in its field's metadata (see `param`)."""

    check: Callable[[Any, int | None], Any]  # (value, vocabulary size or None) -> the value kept; DraftwiseError
    doc: str
    flag: type | None = None  # `draftwise generate --NAME` of this type; None: no flag
    feature: str | None = None  # the name a method's `refuses` uses (default: the option's own name)


def param(default: Any, check: Callable[[Any, int | None], Any], doc: str, **spec: Any) -> Any:
    """A field of RequestParams: its default (the value that turns it off), its check and what it does."""
    return field(default=default, metadata={"param": Param(check, doc, **spec)})


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < float("inf")


def _penalty(name: str) -> Callable[[Any, int | None], float]:
    def check(value: Any, vocab_size: int | None) -> float:
        if not _finite(value):
            raise DraftwiseError(f"{name} must be a finite number (0 turns it off; OpenAI's range is [-2, 2]), got "
                                 f"{value!r}")
        return float(value)
    return check


def _repetition_penalty(value: Any, vocab_size: int | None) -> float:
    if not _finite(value) or not value > 0:
        raise DraftwiseError(f"repetition_penalty must be a number > 0 (1 turns it off), got {value!r}")
    return float(value)


def _count(value: Any, vocab_size: int | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DraftwiseError(f"min_new_tokens must be an integer >= 0, got {value!r}")
    return value


def check_logprobs(value: Any, name: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not 0 <= value <= MAX_LOGPROBS):
        raise DraftwiseError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (how many top alternatives "
                             f"to return beside each token's own), got {value!r}")
    return value


def bias_pairs(logit_bias: Any, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """logit_bias ({token id: bias}; ids as integers or as OpenAI's strings; or the (id, bias) pairs this returns)
    as sorted (id, bias) pairs, checked (against the vocabulary when its size is given)."""
    if logit_bias is None:
        return ()
    if isinstance(logit_bias, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in logit_bias):
        logit_bias = dict(logit_bias)  # pairs already checked once, checked again (now against the vocabulary)
    if not isinstance(logit_bias, dict):
        raise DraftwiseError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
    pairs = {}
    for key, bias in logit_bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else \
            int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if token is None or token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f" in [0, {vocab_size})" if vocab_size is not None else " >= 0"
            raise DraftwiseError(f"logit_bias: key {key!r} is not a token id{where}")
        if not _finite(bias):
            raise DraftwiseError(f"logit_bias[{key!r}] must be a finite number (OpenAI's range is [-100, 100]), got "
                                 f"{bias!r}")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _grammar(value: Any, vocab_size: int | None) -> Grammar | None:
    return value if value is None or isinstance(value, Grammar) else grammar_from(value)


@dataclass(frozen=True)
class RequestParams:
    """A request's options beyond its prompt, budget, sampling and stops: what shapes the target's distribution
    (penalties, bias, the grammar) and what its result reports (log-probabilities). One object from the server's
    request (`server.protocol.parse`) and the API's keywords (`generate(..., presence_penalty=0.5)`) through
    the plan (`plan.with_params`, which checks it against the method) to the engine's row (`row.request.params`;
    `row.request.<name>` reads it too).

    Adding an option is its field here (default = off, its check, its doc; `flag=` gives it a `draftwise generate`
    flag) and the code that applies it in the engine; the API, the plan and the server take it by its name. A
    method that cannot apply it lists it in its `refuses`; the server reads it from the request body by its name
    (server/protocol.py: OpenAI's stricter ranges and vLLM's names). Every layer looks the class up as
    `rows.RequestParams` when it runs (tests/test_request_params.py adds one that way)."""

    repetition_penalty: float = param(1.0, _repetition_penalty, "transformers' rule on the target's logits: a token "
                                      "already in the sequence has its logit / penalty if > 0, * if < 0 (1: off)",
                                      flag=float)
    min_new_tokens: int = param(0, _count, "end-of-sequence tokens get probability 0 before this many new tokens",
                                flag=int)
    # OpenAI's penalties on the target's logits: minus frequency_penalty x (times the token was generated in this
    # request) minus presence_penalty where it was generated at all; logit_bias adds (token id, bias) pairs
    frequency_penalty: float = param(0.0, _penalty("frequency_penalty"), "OpenAI's: a token's logit drops by this "
                                     "per time this request generated it (0: off)", flag=float)
    presence_penalty: float = param(0.0, _penalty("presence_penalty"), "OpenAI's: a token's logit drops by this once "
                                    "this request generated it (0: off)", flag=float)
    logit_bias: tuple[tuple[int, float], ...] = param((), bias_pairs, "{token id: bias} added to the target's logits "
                                                      "(kept as (id, bias) pairs, ids ascending)")
    logprobs: int | None = param(None, lambda v, _: check_logprobs(v, "logprobs"), "each new token's target "
                                 "log-probability and this many top alternatives", flag=int)
    prompt_logprobs: int | None = param(None, lambda v, _: check_logprobs(v, "prompt_logprobs"), "the same for "
                                        "every prompt token after the first (prefilled alone)")
    grammar: Grammar | None = param(None, _grammar, "every new token obeys it (structured output; see grammar.py)",
                                    feature="a grammar")

    @classmethod
    def specs(cls) -> Iterator[tuple[str, Any, Param]]:
        """(name, default, Param) of each option."""
        for f in dataclasses.fields(cls):
            yield f.name, f.default, f.metadata["param"]

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: dict[str, Any], vocab_size: int | None = None) -> "RequestParams":
        """The options given by name, each checked (ParamError names the first bad one); the rest keep their
        defaults."""
        specs = {name: spec for name, _, spec in cls.specs()}
        kept = {}
        for name, value in options.items():
            try:
                kept[name] = specs[name].check(value, vocab_size)
            except DraftwiseError as error:
                raise ParamError(name, str(error)) from None
        return cls(**kept)

    def checked(self, vocab_size: int | None) -> "RequestParams":
        """Every option checked again, now against the vocabulary (token ids)."""
        return self.from_options({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, vocab_size)

    def asked(self) -> list[tuple[str, str]]:
        """(name, feature) of each option that is on (differs from its default)."""
        return [(name, spec.feature or name) for name, default, spec in self.specs() if getattr(self, name) != default]


@dataclass(frozen=True, init=False)
class Request:
    """What a caller asks for; validated by the API before it reaches the engine. Its options live in `params`
    and read as attributes too (`request.presence_penalty`); `Request(ids, presence_penalty=0.5)` and
    `dataclasses.replace(request, logprobs=2)` set them."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingConfig = SamplingConfig()
    max_new_tokens: int = 128
    eos_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    params: RequestParams = RequestParams()

    def __init__(self, prompt_ids: tuple[int, ...], sampling: SamplingConfig = SamplingConfig(),
                 max_new_tokens: int = 128, eos_token_ids: frozenset[int] = frozenset(), stop: tuple[str, ...] = (),
                 seed: int | None = None, params: RequestParams | None = None, **options: Any) -> None:
        params = RequestParams() if params is None else params
        if options:
            params = dataclasses.replace(params, **options)
        for name, value in (("prompt_ids", prompt_ids), ("sampling", sampling), ("max_new_tokens", max_new_tokens),
                            ("eos_token_ids", eos_token_ids), ("stop", stop), ("seed", seed), ("params", params)):
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:  # only for names that are no attribute: the options
        params = self.__dict__.get("params")
        if params is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(params, name)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target and the target's `top` most likely tokens there.

    From the target's raw logits at that position (log-softmax before temperature, top-k / top-p and
    penalties, as vLLM's default `raw_logprobs`): for a lossy method it is still the target's view of the
    token committed, which may be far from the target's own choice."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first
    rank: int | None = None  # 1 + the number of tokens more likely than this one (vLLM's rank)

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": self.logprob, "rank": self.rank,
                "top": [{"token_id": t, "logprob": lp} for t, lp in self.top]}


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits: [n, vocab] raw, the distribution before each of `tokens` (n of them)."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, vocab]
    index = torch.tensor(list(tokens), device=logp.device)
    picked = logp.gather(1, index[:, None])  # [n, 1]
    ranks = ((logp > picked).sum(-1) + 1).tolist()
    chosen = picked[:, 0].tolist()
    if top:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprob(int(t), lp, alt, rank) for t, lp, alt, rank in zip(tokens, chosen, alternatives, ranks)]


def cut_at_eos(committed: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """The committed tokens up to and including the first end-of-sequence token."""
    for i, token in enumerate(committed):
        if token in eos_token_ids:
            return committed[: i + 1]
    return committed


@dataclass
class RowCounters:
    """One request's raw counts; rates are computed when reported. `steps` = verification calls this request took
    part in."""

    gamma: int
    steps: int = 0
    drafted: int = 0  # drafted tokens sent to verification
    accepted: int = 0  # drafted tokens kept
    accepted_per_position: list[int] = field(default_factory=list)  # [gamma]: kept at draft position i
    drafted_per_position: list[int] = field(default_factory=list)  # [gamma]: verified at draft position i
    target_tokens: int = 0  # tokens this request fed the target (prefill included)
    draft_calls: int = 0  # drafting forwards (draft model or head) this request took part in
    prefill_calls: int = 0
    verifier_accepted: int = 0  # drafted tokens kept on a verifier's word (SPRINTER)
    proposed: int = 0  # drafted tokens before the select phase (SV discards some unverified)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.gamma
        self.drafted_per_position = [0] * self.gamma

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def record_tree(self, nodes: int, depth: int, num_accepted: int) -> None:
        """A token tree's step: `nodes` candidates verified over `depth` positions, `num_accepted` kept."""
        self.steps += 1
        self.drafted += nodes
        self.accepted += num_accepted
        for i in range(min(depth, len(self.drafted_per_position))):
            self.drafted_per_position[i] += 1
        for i in range(min(num_accepted, len(self.accepted_per_position))):
            self.accepted_per_position[i] += 1


class Detokenizer:
    """Incremental detokenisation: each push decodes a short window, never the whole output.

    The window starts at the previous release point (`prefix`), so byte-level pieces and
    leading spaces decode as in the full text; text is released only when the window's
    text grew and does not end in an incomplete character (U+FFFD)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens whose text has been released

    def push(self, tokens: Sequence[int]) -> str:
        self.tokens.extend(tokens)
        if self.tokenizer is None:
            return ""
        before = self.tokenizer.decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.tokens[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.tokens)
            return after[len(before) :]
        return ""


@dataclass
class Row:
    id: int
    request: Request
    generator: torch.Generator
    counters: RowCounters
    detok: Detokenizer
    sequence: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # text so far (stop strings cut)
    emitted: int = 0  # characters of `text` handed out as events
    finish_reason: str | None = None
    submitted: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    fed: int = 0  # prompt tokens in the target's cache (while prefilling)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per new token (Request.logprobs)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # per prompt token, None first
    grammar: GrammarState | None = None  # the request's grammar matcher (Request.grammar)
    cached: int = 0  # prompt positions restored from the prefix store
    prefill_states: list = field(default_factory=list)  # the prompt's target features, for a drafter that wants them
    # The prompt's last block for the prefix store, when the prompt's last token completes it: that token is fed by
    # the first decoding step, so the block is stored after it (its features so far, for a drafter that wants them)
    last_block_pending: bool = False
    last_block_states: Any = None
    # keyed randomness (keyed.py): the request's seed (drawn when it gave none; reported in its stats) and whether
    # its draft and target are Gumbel-coupled (the exact rule's default) rather than by rejection sampling
    seed: int = 0
    gumbel: bool = False

    @property
    def unfed(self) -> int:
        """Prompt tokens still to prefill (the last one is fed by the first decoding step)."""
        return len(self.request.prompt_ids) - 1 - self.fed

    @property
    def budget(self) -> int:
        return self.request.max_new_tokens - len(self.token_ids)


@dataclass(frozen=True)
class Event:
    """What a step produced for one request: new tokens, new safe text, and whether it ended."""

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a request's first event, when it asked


@dataclass
class Result:
    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict[str, Any]
    logprobs: list[TokenLogprob] | None = None  # Request.logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # Request.prompt_logprobs
