"""Feedback on long work, on stderr only: progress bars and "loading X (about N s)" lines, shown where stderr is a
terminal or where DRAFTWISE_PROGRESS=1 asks for them (DRAFTWISE_PROGRESS=0 silences them); never on stdout, so
JSON and piped answers stay clean.

A load's time is kept in `<cache>/load-times.json` (per model spec, format and device), so the next load of the same
model says how long it took last time; a model never loaded before is announced with its file size."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def wanted() -> bool:
    """Whether progress output is shown: DRAFTWISE_PROGRESS=1 / 0, else whether stderr is a terminal."""
    asked = os.environ.get("DRAFTWISE_PROGRESS", "")
    if asked in ("0", "1"):
        return asked == "1"
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def bar(**kwargs: Any):
    """A tqdm bar on stderr, shown only where `wanted`."""
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=not wanted(), **kwargs)


def say(message: str) -> None:
    """One line on stderr where `wanted`, above any bar on screen (tqdm moves the bar below it)."""
    if wanted():
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)


def _times_path() -> Path:
    from draftwise.models.cache import cache_root

    return cache_root() / "load-times.json"


def _read_times() -> dict[str, float]:
    import json

    try:
        data = json.loads(_times_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def _file_size(spec: Any) -> int | None:
    """The bytes a load reads: the registry's or the path's GGUF file, or a folder's weight files."""
    if not isinstance(spec, (str, os.PathLike)):
        return None
    from draftwise.models import registry

    name = os.fspath(spec)
    chunked = getattr(registry, "QWEN_FILES", {}).get(name)
    if chunked is not None:
        return chunked.size
    path = Path(name).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors")) or None
    return None


def timed_load(spec: Any, load: Callable[[], T], *, dtype: Any = None, device: Any = None, role: str = "") -> T:
    """`load()`, announced on stderr (where `wanted`) as "loading X (about N s, as last time)" or with the file's
    size the first time; the time it took is kept for the next announcement."""
    if not isinstance(spec, (str, os.PathLike)):
        return load()
    key = f"{os.fspath(spec)}|{dtype or 'auto'}|{device or 'cpu'}"
    last = _read_times().get(key)
    size = _file_size(spec)
    what = f"{role} {os.fspath(spec)}".strip()
    if last is not None:
        say(f"draftwise: loading {what} (about {last:.0f} s, as the last time)")
    else:
        bytes_note = f"{size / 2**30:.2f} GiB; " if size else ""
        say(f"draftwise: loading {what} ({bytes_note}no earlier load timed here)")
    start = time.perf_counter()
    result = load()
    _remember(key, time.perf_counter() - start)
    return result


def _remember(key: str, seconds: float) -> None:
    from draftwise.atomic import write_json

    times = _read_times()
    times[key] = round(seconds, 2)
    try:
        path = _times_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(times, path)
    except OSError:
        pass  # a read-only cache loses the estimate, never the load
