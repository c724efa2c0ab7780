"""Feedback on long work, on stderr only: progress bars and "loading X (about N s)" lines, shown where stderr is a
terminal or where DRAFTWISE_PROGRESS=1 asks for them (DRAFTWISE_PROGRESS=0 silences them); never on stdout, so
JSON and piped answers stay clean. (A model's load is announced through `say` by `models.load_times.timed_load`.)"""

from __future__ import annotations

import os
import sys
from typing import Any


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
