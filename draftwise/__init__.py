"""draftwise: faster LLM decoding with draft, companion and verifier models."""

from __future__ import annotations

import importlib
from typing import Any

# The public names, imported on first use (PEP 562): `import draftwise.bench.seed_plots` or `draftwise.errors` does
# not load torch and the engine.
_EXPORTS = {
    "Generation": "draftwise.api", "StreamEvent": "draftwise.api", "batched_methods": "draftwise.api",
    "generate": "draftwise.api", "stream": "draftwise.api", "DraftwiseError": "draftwise.errors",
    "ModelNotAvailableError": "draftwise.errors", "METHODS": "draftwise.methods", "LoadedModel": "draftwise.models",
    "load_model": "draftwise.models", "SamplingConfig": "draftwise.engine.sampling",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'draftwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
