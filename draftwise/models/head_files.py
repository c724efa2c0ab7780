"""The files that make a directory an EAGLE draft head rather than a model: EAGLE-1's eagle.json, EAGLE-3's
eagle3.json, or an EAGLE-3 checkpoint in vLLM's / SGLang's layout (a config.json whose architectures name
`LlamaForCausalLMEagle3`). Named here, below heads/, so that loading a model can refuse a head in one line without
importing heads/ (which reads and writes these files)."""

from __future__ import annotations

import json
from pathlib import Path

EAGLE_CONFIG = "eagle.json"
EAGLE3_CONFIG = "eagle3.json"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def is_eagle3_dir(path: str | Path) -> bool:
    return (Path(path) / EAGLE3_CONFIG).is_file()


def is_eagle3_checkpoint(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return EAGLE3_ARCHITECTURE in (json.loads(config.read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return False


def is_eagle_dir(path: str | Path) -> bool:
    """A directory holding a draft head: EAGLE-1 (eagle.json) or EAGLE-3 (eagle3.json)."""
    return (Path(path) / EAGLE_CONFIG).is_file() or is_eagle3_dir(path) or is_eagle3_checkpoint(path)
