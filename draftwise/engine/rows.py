"""What the engine keeps per request: the request, its row, counters, log-probabilities, text, and what a step
reports (`Event`) and a finished request leaves (`Result`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from draftwise.engine.grammar import Grammar, GrammarState
from draftwise.engine.sampling import SamplingConfig


@dataclass(frozen=True)
class Request:
    """What a caller asks for; validated by the API before it reaches the engine."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingConfig = SamplingConfig()
    max_new_tokens: int = 128
    eos_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    repetition_penalty: float = 1.0  # transformers' rule on the target's logits: / penalty if > 0, * if < 0
    min_new_tokens: int = 0  # end-of-sequence tokens get probability 0 before this many new tokens
    # OpenAI's penalties on the target's logits: minus frequency_penalty x (times the token was generated in this
    # request) minus presence_penalty where it was generated at all; logit_bias adds (token id, bias) pairs
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # each new token's target log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (prefilled alone)
    grammar: Grammar | None = None  # every new token obeys it (structured output; see grammar.py)


MAX_LOGPROBS = 20  # top alternatives a request may ask for (vLLM's default max_logprobs)


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
