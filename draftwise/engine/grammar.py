"""Structured output: a grammar that every committed token obeys, under speculation too.

A request's grammar (a JSON schema, `json_object`, a regular expression or a Lark grammar) is compiled
by llguidance (the grammar engine vLLM and SGLang use) into a matcher over the target's tokenizer. Each
row keeps one `GrammarState`: the matcher at the row's committed text plus a *speculative path*, the
drafted tokens it has consumed this step. Masks are computed once per depth and cached along the path:

- the drafter masks its logits at every drafted position (`mask()`, then `push(token)`), so a model's
  draft never leaves the grammar; a lookup or suffix draft is cut at its first token the grammar refuses;
- the engine masks the target's logits at every verified position (`masks(k)`: depth 0 .. k), so the
  speculative sampler targets the *masked* target distribution and a lossless method is exact towards it;
- after acceptance the committed tokens become the matcher's state (`commit`), the rest of the path is
  rolled back.

A token is consumed only after the cached mask allowed it, so the matcher never enters its error state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from draftwise.errors import DraftwiseError, short

KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_GRAMMAR_CHARS = 64 * 1024  # a grammar or schema larger than this is refused before compiling


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match: `kind` in KINDS and its source (a schema as JSON text)."""

    kind: str
    source: str = ""

    def describe(self) -> str:
        return self.kind if self.kind == "json_object" else f"{self.kind} ({len(self.source)} characters)"


def grammar_from(value: Any = None, *, response_format: Any = None) -> Grammar | None:
    """A Grammar from the API's `grammar=` (a Grammar, {"regex": ...}, {"json_schema": ...}, {"lark": ...},
    {"json_object": true}) or OpenAI's `response_format`; None for neither. DraftwiseError on bad input."""
    if value is not None and response_format is not None:
        raise DraftwiseError("give grammar= or response_format=, not both")
    if response_format is not None:
        return _response_format(response_format)
    if value is None or isinstance(value, Grammar):
        return _checked(value) if value is not None else None
    if not isinstance(value, dict) or len(value) != 1:
        raise DraftwiseError("grammar must be one of {'json_schema': {...}}, {'json_object': True}, {'regex': '...'}, "
                             f"{{'lark': '...'}}; got {short(value)}")
    (kind, source), = value.items()
    if kind == "json_object":
        if source is not True:
            raise DraftwiseError(f"grammar {{'json_object': ...}} takes True, got {short(source)}")
        return Grammar("json_object")
    if kind == "json_schema":
        return _checked(Grammar("json_schema", _schema_text(source)))
    if kind in ("regex", "lark"):
        if not isinstance(source, str) or not source:
            raise DraftwiseError(f"grammar {{'{kind}': ...}} takes a non-empty string, got {short(source)}")
        return _checked(Grammar(kind, source))
    raise DraftwiseError(f"unknown grammar kind {short(kind)}: use one of {', '.join(KINDS)}")


def _response_format(value: Any) -> Grammar | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise DraftwiseError("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}, got "
                             f"{short(value)}")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise DraftwiseError(f"response_format has unknown field(s): {', '.join(sorted(map(str, extra)))[:200]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind != "json_schema":
        raise DraftwiseError(f"response_format type must be text, json_object or json_schema, got {short(kind)}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise DraftwiseError("response_format json_schema must be {'name': ..., 'schema': {...}}, got "
                             f"{short(spec)}")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise DraftwiseError(f"response_format json_schema has unknown field(s): {', '.join(sorted(unknown))[:200]}")
    return _checked(Grammar("json_schema", _schema_text(spec["schema"])))


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise DraftwiseError(f"the JSON schema is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise DraftwiseError(f"a JSON schema must be an object, got {short(schema)}")
    return json.dumps(schema, sort_keys=True)


def _checked(grammar: Grammar) -> Grammar:
    """Refuse a grammar llguidance cannot compile, with its own message, before any model runs."""
    if grammar.kind not in KINDS:
        raise DraftwiseError(f"unknown grammar kind {grammar.kind!r}: use one of {', '.join(KINDS)}")
    if len(grammar.source) > MAX_GRAMMAR_CHARS:
        raise DraftwiseError(f"the grammar is {len(grammar.source)} characters, over the limit of {MAX_GRAMMAR_CHARS}")
    llg = _llguidance()
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(_llg_grammar(grammar))
    if failed:
        raise DraftwiseError(f"the {grammar.kind} grammar does not compile: {' '.join(messages[0].split())[:300]}")
    return grammar


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise DraftwiseError("structured output needs the llguidance package: pip install llguidance") from None
    return llguidance


@lru_cache(maxsize=64)
def _llg_grammar(grammar: Grammar) -> str:
    matcher = _llguidance().LLMatcher
    if grammar.kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"})
    if grammar.kind == "json_schema":
        try:
            return matcher.grammar_from_json_schema(grammar.source)
        except ValueError as error:
            raise DraftwiseError(f"the JSON schema is not usable: {error}") from None
    if grammar.kind == "regex":
        return matcher.grammar_from_regex(grammar.source)
    return matcher.grammar_from_lark(grammar.source)


class GrammarCompiler:
    """The target tokenizer wrapped for llguidance, once per tokenizer (about a second for a large
    vocabulary); makes a `GrammarState` per request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        llg = _llguidance()
        import llguidance.hf

        if tokenizer is None or not getattr(tokenizer, "is_fast", False):
            raise DraftwiseError("structured output needs the target's fast (Rust) tokenizer; this target has "
                                 f"{'none' if tokenizer is None else type(tokenizer).__name__}")
        eos = sorted(eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        if not eos:
            raise DraftwiseError("structured output needs an end-of-sequence token to end a complete answer, and "
                                 "this target has none")
        self.llg = llg
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)),
                                                      eos_token=eos[0])
        self.eos = eos

    def state(self, grammar: Grammar, device: torch.device) -> "GrammarState":
        matcher = self.llg.LLMatcher(self.tokenizer, _llg_grammar(grammar), log_level=0)
        if matcher.is_error():
            raise DraftwiseError(f"the {grammar.kind} grammar does not compile: "
                                 f"{' '.join(matcher.get_error().split())[:300]}")
        return GrammarState(matcher, self.vocab_size, self.eos, device)


_COMPILERS: "dict[int, tuple[Any, GrammarCompiler]]" = {}


def compiler_for(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
    """One compiler per (tokenizer, vocabulary, EOS): the tokenizer's wrapping is the expensive part."""
    key = (id(tokenizer), vocab_size, tuple(sorted(eos_token_ids)))
    found = _COMPILERS.get(hash(key))
    if found is None or found[0] is not tokenizer:
        found = (tokenizer, GrammarCompiler(tokenizer, vocab_size, eos_token_ids))
        _COMPILERS[hash(key)] = found
    return found[1]


class GrammarState:
    """One request's matcher: its committed state plus a speculative path of drafted tokens (see the module
    docstring). Masks are bool [vocab] tensors on `device`, True where a token is allowed."""

    def __init__(self, matcher: Any, vocab_size: int, eos: Sequence[int], device: torch.device) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = list(eos)
        self.device = device
        self.path: list[int] = []  # drafted tokens the matcher consumed past the committed state
        self._masks: list[torch.Tensor] = []  # _masks[i]: the mask after path[:i]
        self.masks_computed = 0  # llguidance mask computations (for tests and profiling)
        self.error: str | None = None  # the matcher failed (a parser limit): the answer ends there

    def mask(self) -> torch.Tensor:
        """The allowed next tokens at the end of the path: [vocab] bool."""
        depth = len(self.path)
        if len(self._masks) <= depth:
            raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            bits = np.unpackbits(raw, bitorder="little", count=min(self.vocab_size, raw.size * 8)).view(np.bool_)
            if bits.size < self.vocab_size:
                bits = np.concatenate([bits, np.zeros(self.vocab_size - bits.size, dtype=np.bool_)])
            self.masks_computed += 1
            self._masks.append(torch.from_numpy(bits).to(self.device))
        return self._masks[depth]

    def allows(self, token: int) -> bool:
        return 0 <= token < self.vocab_size and bool(self.mask()[token])

    def push(self, token: int) -> bool:
        """Consume a drafted token onto the path if the grammar allows it (else nothing changes)."""
        if self.matcher.is_stopped() or not self.allows(token):
            return False
        if not self.matcher.consume_token(int(token)):  # allowed by the mask, but past a parser limit
            self.error = " ".join(self.matcher.get_error().split())[:300]
            return False
        self.path.append(int(token))
        return True

    def follow(self, tokens: Sequence[int]) -> int:
        """Make the path `tokens` (sharing what it can with the current path); returns how many of them the
        grammar allows in a row (the path ends there)."""
        tokens = [int(t) for t in tokens]
        common = 0
        while common < min(len(tokens), len(self.path)) and tokens[common] == self.path[common]:
            common += 1
        self._rollback(len(self.path) - common)
        for token in tokens[common:]:
            if not self.push(token):
                break
        return len(self.path)

    def masks(self, depth: int) -> torch.Tensor:
        """Masks after path[:i] for i = 0 .. depth (depth <= len(path)): [depth + 1, vocab] bool. Those before
        the path's end were computed when its tokens were pushed."""
        assert depth <= len(self.path), (depth, len(self.path))
        if depth == len(self.path):
            self.mask()
        return torch.stack(self._masks[: depth + 1])

    def commit(self, tokens: Sequence[int]) -> bool:
        """The step's committed tokens become the matcher's state; the rest of the path is dropped. False when
        the matcher could not take them all (it failed: `error`); it then stays failed."""
        n = self.follow(tokens)
        if n != len(tokens):
            self.error = self.error or f"token {list(tokens)[n]} at {n} is outside the grammar"
            return False
        self._masks = self._masks[n:]
        self.path = []
        return True

    def rewind(self) -> None:
        """Drop the speculative path (the drafts were not verified)."""
        self._rollback(len(self.path))

    @property
    def done(self) -> bool:
        """The grammar allows nothing more (an end-of-sequence token at most)."""
        return self.matcher.is_stopped()

    def _rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            del self.path[len(self.path) - n:]
            del self._masks[len(self.path) + 1:]


def mask_logits(logits: torch.Tensor, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., vocab] with -inf where masks [..., vocab] is False; a position the mask leaves empty keeps
    its logits. Returns (logits, empty [...] bool)."""
    empty = ~masks.any(-1)
    out = torch.where(masks, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    if bool(empty.any()):
        out[empty] = logits[empty]
    return out, empty


def mask_rows(rows: Sequence[Any], logits: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafting step: each grammar row's logits [rows, vocab] masked at the end of its path; a row whose
    grammar allows nothing more stops drafting. Returns (logits, active)."""
    if all(getattr(row, "grammar", None) is None for row in rows):  # the usual step: no host copy
        return logits, active
    drafting = active.tolist()
    members = [b for b, row in enumerate(rows) if drafting[b] and row.grammar is not None]
    if not members:
        return logits, active
    masks = torch.stack([rows[b].grammar.mask() for b in members])  # [members, vocab]
    if len(members) == len(rows):
        logits, empty = mask_logits(logits, masks)
        return logits, active & ~empty
    index = torch.tensor(members, device=logits.device)
    masked, empty = mask_logits(logits[index], masks)
    logits = logits.clone()
    logits[index] = masked
    if bool(empty.any()):
        active = active.clone()
        active[index[empty]] = False
    return logits, active


def push_rows(rows: Sequence[Any], token: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """After a drafting step: each drafting grammar row's token goes onto its path (it was drawn from the masked
    distribution, so the grammar takes it); returns `active` without rows whose token it refused."""
    states = [getattr(row, "grammar", None) for row in rows]
    if not any(s is not None for s in states):
        return active
    tokens, drafting = token.tolist(), active.tolist()
    refused = [state is not None and drafting[b] and not state.push(tokens[b]) for b, state in enumerate(states)]
    if any(refused):
        return active & ~torch.tensor(refused, device=active.device)
    return active
