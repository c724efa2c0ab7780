"""How long a model's load took last time, kept in `<cache>/load-times.json` (per model spec, format and device), so
the next load of the same model says so on stderr ("loading X (about N s, as the last time)"); a model never loaded
before is announced with its file size. Shown where `progress.wanted`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from draftwise.progress import say

T = TypeVar("T")


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
