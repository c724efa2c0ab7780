"""The batched engine: continuous batching over one target and one drafter.

A request is one row of the target's position-indexed KV cache (and of the
drafter's, when it has one). Live rows are kept contiguous (`0 .. rows - 1`): a
finished or cancelled row is replaced by the last live row (`move_row`), so every
forward runs on a slice of the cache, never a gather.

One `step()`:
1. **admit**: waiting requests join while the batch has room and the KV budget
   allows. Their prompts (all but the last token, left for the first decoding
   step) are fed in chunks that share the verification forward with the decoding
   rows: at most a time budget per step (`prefill_share` of a decoding step), so a
   long prompt never stalls the others; with nothing decoding, in wide chunks.
   Rows still prefilling sit after the live rows in the cache;
2. **draft**: the drafter proposes up to `min(gamma, budget - 1)` tokens per row;
   rows stop on their own rule (EOS, a stop rule, a lookup miss);
3. **verify**: one target forward feeds each row its pending token and its drafts
   (`1 + k_b` tokens, right-padded);
4. **accept**: the rule gives pi, the vectorised sampler accepts / recovers /
   draws a bonus per row, one device-to-host copy;
5. **rewind**: each row keeps its sequence minus the newest token, in the target
   and in the drafter; then **record** (counters) and emit text.

Interface (for the API, the server and Speculative Verification): `submit`,
`step`, `cancel`, `results` / `result`, `has_work`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from .acceptance import StepDistributions, TargetRule
from .batched import sample_rows, speculative_sample_rows, warp_rows
from .errors import DraftwiseError
from .grammar import Grammar, GrammarState, compiler_for, mask_logits, mask_rows, push_rows
from .models.kvcache import release_heap
from .models.runner import ModelRunner, RowsOutput, fast_model
from .policies import FixedLength, LengthPolicy
from .sampling import SamplingConfig, make_generator


# ---------------------------------------------------------------- requests and counters

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

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top": [{"token_id": t, "logprob": lp} for t, lp in self.top]}


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits: [n, vocab] raw, the distribution before each of `tokens` (n of them)."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, vocab]
    index = torch.tensor(list(tokens), device=logp.device)
    chosen = logp.gather(1, index[:, None])[:, 0].tolist()
    if top:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprob(int(t), lp, alt) for t, lp, alt in zip(tokens, chosen, alternatives)]


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
class _Row:
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


# ---------------------------------------------------------------- drafters over rows

@dataclass(frozen=True)
class RowsDraft:
    tokens: torch.Tensor  # [rows, k] int64, padded past counts[b]
    probs: torch.Tensor  # [rows, k, vocab] the distributions the tokens were drawn from
    counts: list[int]  # [rows] drafted tokens per row (k = max)
    raw_probs: torch.Tensor | None = None  # [rows, k, vocab] unwarped, when the rule reads them
    verdicts: torch.Tensor | None = None  # [rows, k] bool: a verifier's word per drafted token (SPRINTER)
    companion_probs: torch.Tensor | None = None  # [rows, k + 1, vocab] a companion's warped distributions (SV)
    companion_raw: torch.Tensor | None = None  # [rows, k + 1, vocab] the same, unwarped
    joint: torch.Tensor | None = None  # [rows, k] log q(x_1..x_j) of a beam drafter (MTAD)

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def prefix(self, counts: Sequence[int]) -> "RowsDraft":
        """The draft cut to its first counts[b] tokens per row (the select phase's choice)."""
        counts = [min(int(c), d) for c, d in zip(counts, self.counts)]
        k = max(counts, default=0)

        def cut(t: torch.Tensor | None, width: int = k) -> torch.Tensor | None:
            return None if t is None else t[:, :width]

        return RowsDraft(self.tokens[:, :k], self.probs[:, :k], counts, cut(self.raw_probs), cut(self.verdicts),
                         cut(self.companion_probs, k + 1), cut(self.companion_raw, k + 1), cut(self.joint))


class RowsDrafter(Protocol):
    """Proposes per-row drafts and follows the rows the engine keeps (admit / move / rewind)."""

    calls: int
    wants_features: bool  # the verify forward hands it the target's states (`observe`)
    feature_layers: tuple[int, ...]  # which target layers those states come from (EAGLE-3: several; () the last)

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None: ...

    def propose(self, rows: Sequence[_Row], limits: Sequence[int]) -> RowsDraft: ...

    def rewind(self, row: int, keep: int) -> None: ...

    def move_row(self, src: int, dst: int) -> None: ...

    def release(self, live: int) -> None: ...

    def observe(self, row: int, start: int, states: torch.Tensor) -> None: ...


class VerifySelector(Protocol):
    """The select phase: how many of each row's drafted tokens the target verifies (a prefix; the
    rest are discarded). Reads draft-side information only, so exact rules stay exact."""

    discards: bool  # may discard drafted tokens unverified (a request's stats then report what was proposed)

    def limits(self, rows: Sequence[_Row], limits: list[int]) -> list[int]:
        """Each row's drafting limit this step (at most the engine's)."""

    def select(self, rows: Sequence[_Row], draft: RowsDraft) -> list[int]: ...

    def observe(self, rows: Sequence[_Row], draft: RowsDraft, target_probs: torch.Tensor,
                target_logits: torch.Tensor, num_accepted: Sequence[int]) -> None:
        """After acceptance: what the target said (history-based selectors and profiling learn here)."""


class VerifyAll:
    """The default select phase: every drafted token is verified."""

    discards = False

    def limits(self, rows: Sequence[_Row], limits: list[int]) -> list[int]:
        return limits

    def select(self, rows: Sequence[_Row], draft: RowsDraft) -> list[int]:
        return draft.counts

    def observe(self, rows, draft, target_probs, target_logits, num_accepted) -> None:
        pass


def empty_draft(rows: int, vocab: int, device: torch.device) -> RowsDraft:
    return RowsDraft(torch.zeros(rows, 0, dtype=torch.long, device=device), torch.zeros(rows, 0, vocab, device=device),
                     [0] * rows)


class NoRowsDrafter:
    """Proposes nothing: every step is one target token per row (`ar`)."""

    calls = 0
    wants_features = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self._empty: dict[int, RowsDraft] = {}

    def admit(self, row, prompt_ids) -> None: pass

    def propose(self, rows, limits) -> RowsDraft:
        n = len(rows)
        if n not in self._empty:
            self._empty[n] = empty_draft(n, self.vocab_size, self.device)
        return self._empty[n]

    def rewind(self, row, keep) -> None: pass

    def move_row(self, src, dst) -> None: pass

    def release(self, live) -> None: pass

    def observe(self, row, start, states) -> None: pass


class LookupRowsDrafter(NoRowsDrafter):
    """Prompt lookup per row (n-gram continuation of the row's own text), one-hot draft distributions."""

    def __init__(self, vocab_size: int, device: torch.device, *, max_ngram: int, min_ngram: int,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        super().__init__(vocab_size, device)
        self.ngrams = {"max_ngram": max_ngram, "min_ngram": min_ngram}
        self.eos = eos_token_ids

    def propose(self, rows, limits) -> RowsDraft:
        from .lookup import prompt_lookup

        # a continuation stops after an end-of-sequence token: nothing past it is drafted
        found = [cut_at_eos(prompt_lookup(r.sequence, limit, **self.ngrams), self.eos) for r, limit in zip(rows, limits)]
        return one_hot_draft(found, self.vocab_size, self.device)


def one_hot_draft(found: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> RowsDraft:
    """Deterministic drafts (lookup, suffix tries): each row's tokens with one-hot distributions."""
    tokens, counts = pad_rows(found)
    if tokens.shape[1] == 0:
        return empty_draft(len(found), vocab_size, device)
    tokens = tokens.to(device)
    probs = torch.zeros(*tokens.shape, vocab_size, device=device).scatter_(-1, tokens[..., None], 1.0)
    return RowsDraft(tokens, probs, counts)


class RetiringRows:
    """Per-row state of a rows drafter that outlives its row: when a request leaves (its row is reused,
    overwritten by a move, or dropped), `retire(state)` receives what it held."""

    def __init__(self) -> None:
        self.rows: list[Any] = []

    def put(self, row: int, state: Any) -> None:
        while len(self.rows) <= row:
            self.rows.append(None)
        self._retire(row)
        self.rows[row] = state

    def move_row(self, src: int, dst: int) -> None:
        self._retire(dst)
        self.rows[dst] = self.rows[src]
        self.rows[src] = None

    def release(self, live: int) -> None:
        for row in range(live, len(self.rows)):
            self._retire(row)
        del self.rows[live:]

    def retire(self, state: Any) -> None:
        raise NotImplementedError

    def _retire(self, row: int) -> None:
        state = self.rows[row] if row < len(self.rows) else None
        if state is not None:
            self.retire(state)
            self.rows[row] = None


class ModelRowsDrafter:
    """An independent draft model over rows: each row samples from its own warped distribution with its
    own generator. A row stops drafting at EOS, at its limit, or when its length policy says so."""

    wants_features = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self, runner: ModelRunner, vocab_size: int, *, eos_token_ids: frozenset[int] = frozenset(),
                 keep_raw: bool = False, policy: LengthPolicy | None = None) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=runner.device)
        self.policy = policy or FixedLength()
        self.keep_raw = keep_raw
        self.prefill_calls = 0

    @property
    def calls(self) -> int:
        """Drafting forwards (prefill forwards are counted apart, in `prefill_calls`)."""
        return self.runner.calls - self.prefill_calls

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None:
        self.runner.cache.reset_row(row)
        if len(prompt_ids) - 1 <= CATCH_UP:  # a longer prompt is caught up in drafting steps (see `propose`)
            self.prefill_calls += len(_prefill(self.runner, row, prompt_ids[:-1]))

    def propose(self, rows: Sequence[_Row], limits: Sequence[int]) -> RowsDraft:
        from .sampling import unwarped

        width = max(limits, default=0)
        n = len(rows)
        if width == 0:
            return empty_draft(n, self.vocab_size, self.runner.device)
        device = self.runner.device
        policy = self.policy
        lengths = self.runner.lengths
        # 1 or 2 tokens a row; a row admitted with a long prompt feeds it CATCH_UP tokens a step and drafts
        # nothing until its cache has caught up, so its prompt never stalls the other rows' step
        behind = [len(r.sequence) - lengths[b] > CATCH_UP for b, r in enumerate(rows)]
        feed, counts = pad_rows([r.sequence[lengths[b]: lengths[b] + CATCH_UP] for b, r in enumerate(rows)])
        limits = [0 if late else limit for late, limit in zip(behind, limits)]
        at = torch.tensor(counts, device=device)[:, None] - 1  # [rows, 1] the last fed position
        configs = [r.request.sampling for r in rows]
        greedy = [c.greedy for c in configs]
        generators = [r.generator for r in rows]
        active = torch.tensor([limit > 0 for limit in limits], device=device)  # [rows] still drafting
        limit_t = torch.tensor(list(limits), device=device)
        drafted = torch.zeros(n, dtype=torch.long, device=device)
        tokens, probs, raws, verdicts = [], [], [], []
        policy.start(n, device)
        for step in range(width):
            out = self.runner.forward_rows(feed, counts, logits_at=at, hidden=policy.needs_hidden)
            logits, active = mask_rows(rows, out.logits[:, -1], active)  # [rows, vocab]; a grammar's mask
            raw = unwarped(logits) if self.keep_raw or policy.needs_raw else None  # [rows, vocab]
            active &= ~policy.stop_before(raw)
            if self.keep_raw:
                raws.append(raw)
            step_probs = warp_rows(logits, configs)  # [rows, vocab]
            token = sample_rows(step_probs, generators, active.tolist(), greedy)  # [rows]
            active = push_rows(rows, token, active)
            drafted += active.long()
            tokens.append(token)
            probs.append(step_probs)
            hidden = out.hidden.gather(1, at[:, :, None].expand(-1, -1, out.hidden.shape[-1]))[:, -1] \
                if policy.needs_hidden else None  # [rows, hidden] at the last fed position
            stop, verdict = policy.after(hidden, token, raw)
            if verdict is not None:
                verdicts.append(verdict)
            # a row stops after drafting EOS, on its policy's word, or at its limit; the rest go on
            active &= ~torch.isin(token, self.eos) & ~stop & (drafted < limit_t)
            if step + 1 < width:
                if not bool(active.any()):
                    break
                feed, counts = token[:, None], [1] * n
                at = torch.zeros(n, 1, dtype=torch.long, device=device)
        counts_out = drafted.tolist()
        k = max(counts_out)
        if k == 0:
            return empty_draft(n, self.vocab_size, device)
        return RowsDraft(
            torch.stack(tokens, 1)[:, :k], torch.stack(probs, 1)[:, :k], counts_out,
            torch.stack(raws, 1)[:, :k] if self.keep_raw else None,
            torch.stack(verdicts, 1)[:, :k] if verdicts else None,
        )

    def next_distribution(self, contexts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(unwarped, warped) draft distributions after each row's context: one forward over the rows."""
        from .sampling import unwarped

        lengths = self.runner.lengths
        for b, context in enumerate(contexts):  # rows that drafted past their own stop hold extra tokens
            if lengths[b] >= len(context):
                self.runner.trim_row(b, len(context) - 1)
        feed, counts = pad_rows([context[lengths[b]:] for b, context in enumerate(contexts)])
        at = torch.tensor(counts, device=self.runner.device)[:, None] - 1
        logits = self.runner.forward_rows(feed, counts, logits_at=at).logits[:, -1]  # [rows, vocab]
        return unwarped(logits), warp_rows(logits, configs)

    def rewind(self, row: int, keep: int) -> None:
        # the last drafted token was never fed, so the row may already be shorter than `keep`
        self.runner.trim_row(row, min(keep, self.runner.lengths[row]))

    def move_row(self, src: int, dst: int) -> None:
        self.runner.cache.move_row(src, dst)

    def release(self, live: int) -> None:
        self.runner.cache.drop_rows(live)

    def observe(self, row, start, states) -> None: pass


def pad_rows(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    """Right-padded token rows (host) and their lengths: [rows, longest] int64, [rows]."""
    counts = [len(seq) for seq in sequences]
    out = torch.zeros(len(counts), max(counts, default=0), dtype=torch.long)
    for b, seq in enumerate(sequences):
        out[b, : counts[b]] = torch.as_tensor(list(seq), dtype=torch.long)
    return out, counts


CATCH_UP = 256  # prompt tokens a draft model is fed per step for a row admitted with a longer prompt
PREFILL_CHUNK = 128  # prompt tokens per row and prefill forward: bounds a forward's time (a request arriving
# meanwhile waits for it: 7,000-token prompt, 2-core EPYC, short request at 4.2x its time alone with 512-token
# chunks, 3.7x with 128) and costs ~10% on the long prompt (17.0 s -> 18.7 s; benchmarks/long_prompt.py)
PREFILL_TOKENS = 4096  # prompt tokens per prefill forward over several rows (each row gets at least 64)
PREFILL_SHARE = 1.0  # prompt tokens a step feeds beside decoding rows may cost this fraction of a decoding step
PREFILL_FIRST = 8  # prompt tokens per step beside decoding rows before their cost is measured
PREFILL_SHARED = 16  # prompt tokens per forward of an engine with nothing decoding while another engine decodes
DECODE_SAMPLE = 16  # one step in this many feeds no prompt tokens: it times a decoding step alone


def _prefill(runner: ModelRunner, row: int, tokens: Sequence[int], *, hidden: bool = False) -> list[torch.Tensor]:
    """Feed `tokens` to one row in chunks (one forward each); returns the last-layer states per chunk
    when `hidden`, else an empty tensor per chunk."""
    states, _ = prefill_rows(runner, row, [tokens], hidden=hidden)
    return states[0]


def prefill_rows(runner: ModelRunner, begin: int, prompts: Sequence[Sequence[int]], *, hidden: bool = False
                 ) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Feed prompts[i] to row `begin + i`, every row with tokens left in the same forward, chunk by chunk.

    `prompts` must be sorted longest first (the rows still feeding are then always a leading block).
    Returns per row its last-layer states per chunk (`hidden`; else empty tensors) and the forwards it
    took part in."""
    lengths = [len(p) for p in prompts]
    assert lengths == sorted(lengths, reverse=True), "prefill_rows needs prompts sorted longest first"
    states: list[list[torch.Tensor]] = [[] for _ in prompts]
    calls = [0] * len(prompts)
    start = [0] * len(prompts)
    while True:
        active = [i for i, n in enumerate(lengths) if start[i] < n]  # a leading block: sorted longest first
        if not active:
            break
        chunk = max(64, min(PREFILL_CHUNK, PREFILL_TOKENS // len(active)))
        pieces = [list(prompts[i][start[i]: start[i] + chunk]) for i in active]
        tokens, counts = pad_rows(pieces)
        out = runner.forward_rows(tokens, counts, begin=begin, logits_at=torch.zeros(len(active), 1, dtype=torch.long),
                                  hidden=hidden, prompt=True)
        for b, i in enumerate(active):
            states[i].append(out.hidden[b, : counts[b]] if hidden else tokens[b, :0])
            start[i] += counts[b]
            calls[i] += 1
    return states, calls


# ---------------------------------------------------------------- the engine

class Engine:
    """Continuous batching of one method over many requests. See the module docstring."""

    def __init__(
        self, target: ModelRunner, drafter: RowsDrafter, rule: TargetRule, *, gamma: int, tokenizer: Any = None,
        max_batch_size: int = 16, kv_budget_tokens: int | None = None, method: str = "", stream_text: bool = True,
        selector: VerifySelector | None = None, prefill_share: float | None = None, prefixes: Any = None,
    ) -> None:
        if max_batch_size < 1:
            raise DraftwiseError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        prefill_share = PREFILL_SHARE if prefill_share is None else prefill_share
        if not prefill_share > 0:
            raise DraftwiseError(f"prefill_share must be > 0, got {prefill_share!r}")
        self.target = target
        self.drafter = drafter
        self.rule = rule
        self.gamma = gamma
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.kv_budget_tokens = kv_budget_tokens  # None: no limit beyond the batch size
        self.method = method
        self.selector = selector or VerifyAll()
        if drafter.wants_features:
            target.feature_layers = tuple(drafter.feature_layers)  # EAGLE-3 reads several layers
        self.stream_text = stream_text  # False: text only at the end (and for stop strings), no per-step decoding
        self.waiting: list[_Row] = []
        self.live: list[_Row] = []  # row i of every cache is live[i]
        self.prefilling: list[_Row] = []  # row len(live) + j of the target's cache is prefilling[j]
        self.prefill_share = prefill_share
        self._decode_s: float | None = None  # moving averages: a decoding step's time,
        self._prompt_token_s: float | None = None  # and what one prompt token adds to it
        self._steps = 0
        self._credit = 0.0  # seconds of prompt feeding earned (see `_prompt_budget`)
        self.finished: dict[int, Result] = {}
        self._ids = itertools.count()
        self.prefixes = prefixes  # a prefix.PrefixStore: prompt prefixes' keys and values across requests
        self.others_decoding = False  # set by a server's worker: another engine has rows decoding

    # ---- interface ----

    def submit(self, request: Request) -> int:
        row = _Row(
            id=next(self._ids), request=request,
            generator=make_generator(request.seed, self.target.device),
            counters=RowCounters(gamma=self.gamma), detok=Detokenizer(self.tokenizer),
            sequence=list(request.prompt_ids), submitted=time.perf_counter(),
        )
        if request.grammar is not None:
            vocab = self.target.vocab_size or self.target.model.get_output_embeddings().weight.shape[0]
            row.grammar = compiler_for(self.tokenizer, vocab, request.eos_token_ids).state(
                request.grammar, self.target.device)
        self.waiting.append(row)
        return row.id

    def cancel(self, request_id: int) -> bool:
        """Stop a request now; its row is freed, other rows are untouched. False when unknown or done."""
        for i, row in enumerate(self.waiting):
            if row.id == request_id:
                self.waiting.pop(i)
                self._finish(row, "cancelled")
                return True
        for i, row in enumerate(self.live):
            if row.id == request_id:
                self._finish(row, "cancelled")
                self._free(i)
                return True
        for j, row in enumerate(self.prefilling):
            if row.id == request_id:
                self._finish(row, "cancelled")
                self._unprefill(j)
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.live or self.prefilling)

    @property
    def admitted(self) -> list[_Row]:
        """Requests holding a row: decoding, then prefilling."""
        return [*self.live, *self.prefilling]

    def result(self, request_id: int) -> Result | None:
        return self.finished.get(request_id)

    def results(self) -> dict[int, Result]:
        return dict(self.finished)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Admit what fits, then one draft -> verify -> accept -> rewind step over the live rows (with a share of
        the waiting prompts fed in the same target forward)."""
        self._admit()
        if not self.live and self.prefilling:  # nothing decoding here: prompts in wide chunks (short ones when
            # another engine of the server decodes: its steps wait for this one's)
            wide = PREFILL_SHARED if self.others_decoding else PREFILL_TOKENS
            self._feed_prompts(self._prompt_plan(wide, min(wide, PREFILL_CHUNK)))
        if not self.live:
            return []
        started = time.perf_counter()
        rows = self.live
        limits = [max(0, min(self.gamma, row.budget - 1)) for row in rows]
        limits = self.selector.limits(rows, limits)
        drafter_calls = self.drafter.calls

        draft = self.drafter.propose(rows, limits)  # draft
        proposed = draft.counts
        if draft.width:  # select: the prefix of each draft to verify
            chosen = self.selector.select(rows, draft)
            if list(chosen) != list(draft.counts):
                draft = draft.prefix(chosen)
        grammars = [b for b, row in enumerate(rows) if row.grammar is not None]
        if grammars:  # the grammar rows' paths follow their drafts, cut at a token the grammar refuses
            draft = self._grammar_drafts(rows, grammars, draft)
        k = draft.width
        counts = [1 + c for c in draft.counts]  # verify: the pending token and the drafts
        last = torch.tensor([row.sequence[-1] for row in rows], dtype=torch.long, device=draft.tokens.device)
        feed = torch.cat([last[:, None], draft.tokens], 1)  # [rows, 1 + k]
        plan = self._prompt_plan(self._prompt_budget(), PREFILL_CHUNK) if self.prefilling else []
        if plan:  # prompt chunks of the rows prefilling, in the same forward (rows after the live ones)
            pieces = [list(row.request.prompt_ids[row.fed: row.fed + n]) for row, n in zip(self.prefilling, plan)]
            chunks, chunk_counts = pad_rows(pieces)
            width = max(feed.shape[1], chunks.shape[1])
            feed = torch.cat([F.pad(feed, (0, width - feed.shape[1])),
                              F.pad(chunks.to(feed.device), (0, width - chunks.shape[1]))])
            at = torch.arange(k + 1, device=feed.device).expand(feed.shape[0], -1)
            verified = self.target.forward_rows(feed, counts + chunk_counts, logits_at=at,
                                                hidden=self.drafter.wants_features, prompt=sum(counts))
            self._fed(plan, verified.hidden[len(rows):] if self.drafter.wants_features else None)
            verified = RowsOutput(verified.logits[: len(rows)],
                                  verified.hidden[: len(rows)] if verified.hidden is not None else None)
        else:
            verified = self.target.forward_rows(feed, counts, hidden=self.drafter.wants_features)
        if self.drafter.wants_features:
            for b, row in enumerate(rows):
                self.drafter.observe(b, len(row.sequence) - 1, verified.hidden[b, : counts[b]])
        target_logits = self._processed(rows, draft, verified.logits)  # [rows, k + 1, vocab]
        if grammars:  # the target's distribution at every verified position, masked by the grammar there
            target_logits = self._grammar_masked(rows, grammars, draft, target_logits)
        target_probs = warp_rows(target_logits, [row.request.sampling for row in rows])

        drafted = draft.counts
        if self.rule.cuts_draft and k:  # MTAD: the rule keeps a prefix of each draft; the target's token follows it
            greedy = self._greedy(rows).to(target_probs.device)
            draft = draft.prefix(self.rule.prefix(self._step_distributions(draft, target_probs, target_logits,
                                                                           greedy), greedy))
            k = draft.width
        pi = self._pi(draft, target_probs, target_logits, rows) if k else target_probs[:, :0]  # accept
        bonus: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] = target_probs
        if self.rule.bonus_from_pi:  # Algorithm 4: the bonus comes from pi = T(q, p) after the last drafted token
            bonus = self._bonus_maker(rows, draft, target_probs, target_logits)

        outcome = speculative_sample_rows(draft.tokens, draft.probs, pi, bonus, draft.counts,
                                          [row.generator for row in rows],
                                          [row.request.sampling.greedy for row in rows])
        self.selector.observe(rows, draft, target_probs, target_logits, outcome.num_accepted)
        drafter_calls = self.drafter.calls - drafter_calls  # drafting forwards of this step, over every row
        drafted_host = draft.tokens.tolist() if k else [[] for _ in rows]
        verdicts_host = draft.verdicts.tolist() if draft.verdicts is not None else None

        events, done = [], []
        now = time.perf_counter()
        for b, row in enumerate(rows):
            accepted = outcome.num_accepted[b]
            committed = drafted_host[b][:accepted] + [outcome.next_tokens[b]]
            committed = cut_at_eos(committed, row.request.eos_token_ids)
            kept = self._commit(row, committed, now)  # may cut further, at a stop string
            if row.grammar is not None and not row.grammar.commit(kept) and row.finish_reason is None:
                row.finish_reason = "grammar"  # the grammar engine failed (a parser limit): the answer ends here
            if row.request.logprobs is not None:  # position j's logits came before committed token j
                row.logprobs += token_logprobs(verified.logits[b], kept, row.request.logprobs)
            # record: nothing past an EOS or a stop string counts as accepted
            row.counters.record(drafted[b], min(accepted, len(kept)))
            row.counters.target_tokens += counts[b]
            row.counters.proposed += proposed[b]
            row.counters.draft_calls += drafter_calls
            if verdicts_host is not None:
                row.counters.verifier_accepted += sum(verdicts_host[b][: draft.counts[b]])
            events.append(self._event(row, kept))
            # rewind: the row keeps everything but its newest token
            self.target.trim_row(b, len(row.sequence) - 1)
            self.drafter.rewind(b, len(row.sequence) - 1)
            if row.finish_reason is not None:
                done.append(b)
        for b in reversed(done):  # highest first: moving the last row never touches a pending index
            self._free(b)
        self._timed(time.perf_counter() - started, sum(plan))
        self._start_decoding()
        return events

    def run(self) -> dict[int, Result]:
        while self.has_work:
            self.step()
        return self.results()

    # ---- phases ----

    def _pi(self, draft: RowsDraft, target_probs: torch.Tensor, target_logits: torch.Tensor,
            rows: Sequence[_Row]) -> torch.Tensor:
        """pi = rule(draft, target) at the drafted positions: [rows, k, vocab], one rule call with per-row greedy
        flags."""
        return self.rule(self._step_distributions(draft, target_probs, target_logits, self._greedy(rows)))

    @staticmethod
    def _greedy(rows: Sequence[_Row]) -> torch.Tensor:
        return torch.tensor([row.request.sampling.greedy for row in rows])

    @staticmethod
    def _step_distributions(draft: RowsDraft, target_probs: torch.Tensor, target_logits: torch.Tensor,
                            greedy: torch.Tensor) -> StepDistributions:
        return StepDistributions(draft.tokens, draft.probs, target_probs, target_logits, draft.raw_probs,
                                 greedy.to(draft.tokens.device),
                                 draft.verdicts, draft.joint,
                                 torch.tensor(draft.counts, device=draft.tokens.device))

    def _grammar_drafts(self, rows: Sequence[_Row], grammars: list[int], draft: RowsDraft) -> RowsDraft:
        """Each grammar row's path becomes its draft, cut before the first token its grammar refuses (a lookup
        or suffix draft; a model's was drawn under the mask and is whole)."""
        host = draft.tokens.tolist() if draft.width else [[] for _ in rows]
        counts = list(draft.counts)
        for b in grammars:
            counts[b] = rows[b].grammar.follow(host[b][: counts[b]])
        return draft.prefix(counts) if counts != list(draft.counts) else draft

    def _grammar_masked(self, rows: Sequence[_Row], grammars: list[int], draft: RowsDraft,
                        logits: torch.Tensor) -> torch.Tensor:
        """logits [rows, k + 1, vocab] with each grammar row's masks at depths 0 .. its draft length."""
        logits = logits.clone()
        for b in grammars:
            n = draft.counts[b]
            logits[b, : n + 1] = mask_logits(logits[b, : n + 1], rows[b].grammar.masks(n))[0]
        return logits

    def _processed(self, rows: Sequence[_Row], draft: RowsDraft, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits after each request's repetition penalty and min_new_tokens: [rows, k + 1, vocab].

        Position j of row b follows the row's sequence plus its first j drafted tokens, so the penalty at
        j counts those drafts as already generated, exactly as one-token-at-a-time decoding would. The
        speculative sampler then targets the processed distribution, so lossless methods stay exact."""
        penalised = [b for b, row in enumerate(rows) if row.request.repetition_penalty != 1.0]
        short = [b for b, row in enumerate(rows)
                 if len(row.token_ids) < row.request.min_new_tokens and row.request.eos_token_ids]
        if not penalised and not short:
            return logits
        logits = logits.clone()
        width = logits.shape[1]
        for b in penalised:
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            seen[torch.tensor(rows[b].sequence, device=logits.device)] = True
            present = seen.expand(width, -1).clone()  # [k + 1, vocab]
            for j in range(1, width):
                if j - 1 < draft.counts[b]:
                    present[j:, draft.tokens[b, j - 1]] = True
            penalty = rows[b].request.repetition_penalty
            row = logits[b]
            logits[b] = torch.where(present, torch.where(row < 0, row * penalty, row / penalty), row)
        for b in short:
            request = rows[b].request
            eos = torch.tensor(sorted(request.eos_token_ids), device=logits.device)
            eos = eos[eos < logits.shape[-1]]
            missing = request.min_new_tokens - len(rows[b].token_ids)  # positions 0 .. missing - 1 lose EOS
            logits[b, :missing, eos] = float("-inf")
        return logits

    def _bonus_maker(self, rows: Sequence[_Row], draft: RowsDraft, target_probs: torch.Tensor,
                     target_logits: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The sampler calls this with the rows that need a bonus; the draft's extra forward runs only then."""
        def bonus(needed: torch.Tensor) -> torch.Tensor:
            if not bool(needed.any()):
                return target_probs
            return self._bonus_from_pi(rows, draft, target_probs, target_logits)
        return bonus

    def _bonus_from_pi(self, rows: Sequence[_Row], draft: RowsDraft, target_probs: torch.Tensor,
                       target_logits: torch.Tensor) -> torch.Tensor:
        """target_probs with row b's position counts[b] replaced by rule.bonus(q, p) there: [rows, k + 1, vocab]."""
        from .sampling import unwarped

        contexts = [row.sequence + draft.tokens[b, : draft.counts[b]].tolist() for b, row in enumerate(rows)]
        q_raw, q_warped = self.drafter.next_distribution(contexts, [row.request.sampling for row in rows])
        for b, row in enumerate(rows):  # the draft's distribution after its last token, under the grammar
            if row.grammar is not None:
                allowed = row.grammar.masks(draft.counts[b])[-1]
                q_raw[b], q_warped[b] = (_renormalised(q[b] * allowed) for q in (q_raw, q_warped))
        index = torch.arange(len(rows), device=target_probs.device)
        at = torch.tensor(draft.counts, device=target_probs.device)
        p_raw, p_warped = unwarped(target_logits[index, at]), target_probs[index, at]  # [rows, vocab]
        out = target_probs.clone()
        out[index, at] = self.rule.bonus(q_raw, q_warped, p_raw, p_warped, self._greedy(rows).to(out.device))
        return out

    def _commit(self, row: _Row, committed: list[int], now: float) -> list[int]:
        """Append the step's tokens (cut at a stop string) and decide whether the row ends; returns the kept tokens."""
        stop_hit = False
        if row.request.stop and self.tokenizer is not None:
            kept = []
            for token in committed:  # token by token, so the cut is exact
                kept.append(token)
                row.text += row.detok.push([token])
                cut = _find_stop(row.text, row.request.stop)
                if cut is not None:
                    row.text = row.text[:cut]
                    stop_hit = True
                    break
            committed = kept
        elif self.stream_text:
            row.text += row.detok.push(committed)
        row.sequence.extend(committed)
        row.token_ids.extend(committed)
        if row.first_token_at is None:
            row.first_token_at = now
        if stop_hit:
            row.finish_reason = "stop"
        elif committed and committed[-1] in row.request.eos_token_ids:
            row.finish_reason = "eos"
        elif row.budget <= 0:
            row.finish_reason = "length"
        return committed

    def _event(self, row: _Row, kept: list[int]) -> Event:
        """The step's event for a row, after its counters were recorded (a finished row's stats are final)."""
        if row.finish_reason is not None:
            self._finish(row, row.finish_reason)
            ready = len(row.text)
        else:
            ready = _safe_prefix(row.text, row.request.stop)
        piece = row.text[row.emitted:ready] if ready > row.emitted else ""
        row.emitted = max(row.emitted, ready)
        logprobs = row.logprobs[len(row.logprobs) - len(kept):] if row.request.logprobs is not None else None
        first = row.request.prompt_logprobs is not None and row.counters.steps == 1
        return Event(row.id, kept, piece, row.finish_reason is not None, row.finish_reason, logprobs,
                     row.prompt_logprobs if first else None)

    def _admit(self) -> None:
        """Take waiting requests while they fit; they prefill from the next forward on (see `step`)."""
        while self.waiting and len(self.live) + len(self.prefilling) < self.max_batch_size:
            candidate = self.waiting[0]
            held = self.admitted
            if self.kv_budget_tokens is not None and held:
                # the buffers are [rows allocated, capacity]: capacity follows the longest row (plus a draft
                # window), rows grow by doubling; admit only what keeps that within budget
                longest = max(len(r.request.prompt_ids) + r.request.max_new_tokens
                              for r in [*held, candidate]) + self.gamma + 1
                if self.target.cache.slots_after(len(held) + 1, longest) > self.kv_budget_tokens:
                    break
            row = self.waiting.pop(0)
            self.target.cache.reset_row(len(held))
            if self.prefixes is not None and row.request.prompt_logprobs is None:  # a stored prefix: no prefill
                wants = self.drafter.wants_features
                row.cached, features = self.prefixes.restore(row.request.prompt_ids[:-1], self.target.cache,
                                                             len(held), want_features=wants)
                row.fed = row.cached
                if features is not None:
                    row.prefill_states.append(features)
            row.counters.target_tokens += len(row.request.prompt_ids) - 1 - row.cached
            if row.request.prompt_logprobs is not None:
                self._prefill_scored(row, len(held))
            self.prefilling.append(row)
        self._start_decoding()

    def _prompt_budget(self) -> int:
        """Prompt tokens the next step feeds beside the decoding rows: what costs `prefill_share` of a step. Every
        `DECODE_SAMPLE`-th step (and before the first measure) feeds none, to time a decoding step alone."""
        self._steps += 1
        if self._decode_s is None or self._steps % DECODE_SAMPLE == 0:
            return 0
        if self._prompt_token_s is None:
            return PREFILL_FIRST
        # time credit: each step earns prefill_share of a decoding step; a forward needs a token for every
        # prefilling row, so below that the credit builds up over steps that feed none
        cost = max(self._prompt_token_s, 1e-9)
        self._credit = min(self._credit + self.prefill_share * self._decode_s, PREFILL_TOKENS * cost)
        budget = min(PREFILL_TOKENS, int(self._credit / cost))
        if budget < len(self.prefilling):
            return 0
        self._credit -= budget * cost
        return budget

    def _prompt_plan(self, budget: int, chunk: int) -> list[int]:
        """Tokens per prefilling row for one forward: at least one each (the forward covers them all), the rest
        to the rows with the fewest left first, so a short prompt is not held behind a long one; when some rows
        can finish in this forward, the others get one token each, so the finishing ones start decoding soon.
        [] when the budget is 0."""
        if budget <= 0:
            return []
        plan = [min(1, row.unfed) for row in self.prefilling]
        left = budget - sum(plan)
        for j in sorted(range(len(plan)), key=lambda j: self.prefilling[j].unfed):
            if left <= 0:
                break
            extra = min(min(self.prefilling[j].unfed, chunk) - plan[j], left)
            plan[j] += extra
            left -= extra
        finishing = [n == row.unfed for n, row in zip(plan, self.prefilling)]
        if any(finishing) and not all(finishing):
            plan = [n if done else 1 for n, done in zip(plan, finishing)]
        return plan

    def _feed_prompts(self, plan: list[int]) -> None:
        """One forward over the prefilling rows alone (nothing is decoding)."""
        pieces = [list(row.request.prompt_ids[row.fed: row.fed + n]) for row, n in zip(self.prefilling, plan)]
        tokens, counts = pad_rows(pieces)
        out = self.target.forward_rows(tokens, counts, begin=len(self.live),
                                       logits_at=torch.zeros(len(pieces), 1, dtype=torch.long),
                                       hidden=self.drafter.wants_features, prompt=True)
        self._fed(plan, out.hidden if self.drafter.wants_features else None)
        self._start_decoding()

    def _prefill_scored(self, row: _Row, index: int) -> None:
        """Prefill a prompt whose log-probabilities were asked for, alone and now (logits at every position:
        too wide to share a forward with decoding rows), in chunks; the row then waits to start decoding."""
        prompt = row.request.prompt_ids
        row.prompt_logprobs = [None]
        while row.unfed:
            n = min(row.unfed, PREFILL_CHUNK)
            out = self.target.forward_rows(torch.tensor([prompt[row.fed: row.fed + n]]), [n], begin=index,
                                           hidden=self.drafter.wants_features, prompt=True)
            row.prompt_logprobs += token_logprobs(out.logits[0], prompt[row.fed + 1: row.fed + n + 1],
                                                  row.request.prompt_logprobs)
            self._fed([n], out.hidden, rows=[row])

    def _fed(self, plan: list[int], hidden: torch.Tensor | None, rows: list[_Row] | None = None) -> None:
        for j, (row, n) in enumerate(zip(self.prefilling if rows is None else rows, plan)):
            row.fed += n
            row.counters.prefill_calls += 1
            if hidden is not None:
                row.prefill_states.append(hidden[j, :n])

    def _start_decoding(self) -> None:
        """Prefilled rows join the live ones (row len(live) of the cache), and the drafter hears of them (then
        `live[row].id` is the request's id, for a drafter that keeps something per request)."""
        while True:
            j = next((j for j, row in enumerate(self.prefilling) if row.unfed == 0), None)
            if j is None:
                return
            begin = len(self.live)
            if j:
                self.target.cache.swap_rows(begin, begin + j)
                self.prefilling[0], self.prefilling[j] = self.prefilling[j], self.prefilling[0]
            row = self.prefilling.pop(0)
            if self.prefixes is not None:  # its prompt's blocks, for the requests that share them
                wants = self.drafter.wants_features
                self.prefixes.insert(row.request.prompt_ids[:-1], self.target.cache, begin,
                                     torch.cat(row.prefill_states) if wants and row.prefill_states else None)
            self.live.append(row)
            self.drafter.admit(begin, row.request.prompt_ids)
            if row.prefill_states and self.drafter.wants_features:
                self.drafter.observe(begin, 0, torch.cat(row.prefill_states))
            row.prefill_states = []

    def _timed(self, seconds: float, prompt_tokens: int) -> None:
        """Moving averages of a decoding step and of what a prompt token adds to it (the prompt budget's basis)."""
        if prompt_tokens == 0:
            self._decode_s = seconds if self._decode_s is None else 0.8 * self._decode_s + 0.2 * seconds
        elif self._decode_s is not None:
            per_token = max(seconds - self._decode_s, 0.0) / prompt_tokens
            self._prompt_token_s = per_token if self._prompt_token_s is None else \
                0.8 * self._prompt_token_s + 0.2 * per_token

    def _unprefill(self, j: int) -> None:
        """Drop prefilling row j: the last prefilling row takes its place in the cache."""
        begin, last = len(self.live), len(self.prefilling) - 1
        if j != last:
            self.target.cache.move_row(begin + last, begin + j)
            self.prefilling[j] = self.prefilling[last]
        self.prefilling.pop()
        self.target.cache.drop_rows(begin + len(self.prefilling))

    def _free(self, index: int) -> None:
        last = len(self.live) - 1
        if index != last:
            self.target.cache.move_row(last, index)
            self.drafter.move_row(last, index)
            self.live[index] = self.live[last]
        self.live.pop()
        if self.prefilling:  # the prefilling rows follow the live ones: the last of them fills the hole
            self.target.cache.move_row(last + len(self.prefilling), last)
            self.prefilling.insert(0, self.prefilling.pop())
        self.target.cache.drop_rows(len(self.live) + len(self.prefilling))
        self.drafter.release(len(self.live))
        if not self.live and not self.prefilling:
            self.target.cache.shrink()  # idle: a long prompt's memory goes back
            if not self.waiting:
                release_heap()

    def _finish(self, row: _Row, reason: str) -> None:
        row.finish_reason = reason
        row.finished_at = time.perf_counter()
        if self.tokenizer is not None and reason != "stop":
            row.text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        c = row.counters
        stats = {
            "method": self.method,
            "new_tokens": len(row.token_ids),
            "target_calls": c.steps,
            "draft_calls": c.draft_calls,  # forwards shared by the batch: each row counts the ones it took part in
            "target_tokens": c.target_tokens,
            "steps": c.steps,
            "drafted": c.drafted,
            "accepted": c.accepted,
            "accepted_per_position": c.accepted_per_position,
            "drafted_per_position": c.drafted_per_position,
            "prompt_tokens": len(row.request.prompt_ids),
            "cached_tokens": row.cached,  # prompt positions restored from the prefix store, not prefilled
            "prefill_calls": c.prefill_calls,
            "verifier_accepted": c.verifier_accepted,
            "finish_reason": reason,
            "seed": row.generator.initial_seed(),
            "wall_time_s": row.finished_at - row.submitted,
            "time_to_first_token_s": (row.first_token_at - row.submitted) if row.first_token_at else None,
        }
        if self.selector.discards:
            stats["proposed"] = c.proposed  # drafted, before the select phase dropped some unverified
        self.finished[row.id] = Result(
            row.id, list(row.token_ids), row.text, reason, stats,
            list(row.logprobs) if row.request.logprobs is not None else None,
            list(row.prompt_logprobs) if row.request.prompt_logprobs is not None else None)


def _renormalised(probs: torch.Tensor) -> torch.Tensor:
    total = probs.sum(-1, keepdim=True)
    return torch.where(total > 0, probs / total.clamp_min(1e-30), probs)


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token takes in a model's cache (all layers)."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    fast = fast_model(model)  # the fast forward keeps fp32 keys and values on CPU, whatever the weights
    dtype = fast.cache_dtype if fast is not None else next(model.parameters()).dtype
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _safe_prefix(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` can be shown: not a trailing incomplete character, not a possible stop-string start."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for n in range(min(len(s) - 1, end), 0, -1):
            if text[end - n : end] == s[:n]:
                end -= n
                break
    return end
