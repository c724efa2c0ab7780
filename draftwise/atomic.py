"""Atomic file writes (every layer's one helper: text, JSON, torch checkpoints): a temporary file beside the target, renamed over it only once it is whole.

An interrupted write (a crash, a full disk, a killed job) never leaves a half-written file, and a failed
one leaves the old file as it was. The file gets the permissions an ordinary `open` would give it
(mkstemp makes temporary files private).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path in `path`'s folder: write it inside the block; on success it replaces `path`, on
    an exception it is removed. `suffix` keeps an extension for writers that read it (matplotlib)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """`Path.write_text`, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(obj: Any, path: str | os.PathLike) -> None:
    """JSON with an indent of 2 and a final newline, atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save`, atomically: an interruption never leaves half a checkpoint."""
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
