"""Registry of the default models that `load_model` resolves by name, offline.

Entries are added by the default-models work (SmolLM2-135M and its trained drafts);
each resolves to a local Hugging Face directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

_RESOLVERS: dict[str, Callable[[], Path]] = {}


def register(name: str, resolver: Callable[[], Path]) -> None:
    _RESOLVERS[name] = resolver


def names() -> list[str]:
    return sorted(_RESOLVERS)


def resolve(name: str) -> Path:
    return _RESOLVERS[name]()
