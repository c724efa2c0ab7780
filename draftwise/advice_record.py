"""The method advice's record: which exact method `draftwise bench` measured fastest for a pair on a machine, kept in
`<cache>/advice/<key>.json` (one file per target, draft, machine signature, greedy or sampled), and what
`plan.default_method` reads from it (`recorded_method`). A bench writes it (`bench.advice.write_record`).

The machine signature is what decides which method wins: the CPU model, the instruction-set flags draftwise's
kernels use, the torch threads and the accelerator. A model's identity is its registry name with the file's known
SHA-256 (or the folder an entry resolves to), or a path with its size and modification time, so a record never
follows a name onto other weights. A record of another machine or pair is not ours; a corrupt one is ignored with
one warning line.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from draftwise.errors import DraftwiseWarning

VERSION = 1
# The flags that change which kernels run (models/csrc dispatch on them) and so the cost of a verification.
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
         "amx_int8", "amx_bf16")


class AdviceNotice(DraftwiseWarning):
    """The default method follows a bench's record (the CLI prints it as one line, not as a warning)."""


def advice_dir() -> Path:
    from draftwise.models.cache import cache_root

    return cache_root() / "advice"


def machine_signature(device: Any = "cpu", threads: int | None = None) -> dict[str, Any]:
    """CPU model, the flags in FLAGS it has, torch threads, and the accelerator's name (or 'cpu')."""
    import torch

    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        import platform

        model = platform.processor() or platform.machine()
    from draftwise.models.loading import resolve_device

    try:
        device = resolve_device(device)
    except Exception:  # noqa: BLE001 - a bad device is load_model's error to give; no record matches it
        device = torch.device("cpu")
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"cpu": model, "flags": [f for f in FLAGS if f in flags],
            "threads": threads if threads else torch.get_num_threads(), "accelerator": accelerator}


_KNOWN_SHA256: dict[str, str] = {}


def _registry_sha256(name: str) -> str | None:
    from draftwise.models import registry

    if not _KNOWN_SHA256:
        _KNOWN_SHA256[registry.SMOLLM2] = registry.SMOLLM2_SHA256
        _KNOWN_SHA256.update({n: f.sha256 for n, f in registry.QWEN_FILES.items()})
    return _KNOWN_SHA256.get(name)


def model_identity(spec: Any) -> str | None:
    """A registry name with its file's SHA-256 (or the folder its entry resolves to), a path with its size and
    mtime, a loaded registry model by its name; None where the weights cannot be named (an in-memory model)."""
    from draftwise.models import registry

    if spec is None:
        return None
    name = getattr(spec, "name", None) if not isinstance(spec, (str, os.PathLike)) else os.fspath(spec)
    if not isinstance(name, str):
        return None
    entry = registry.entry(name)
    if entry is not None:
        if entry.gguf is not None and _registry_sha256(name):
            return f"{name}@sha256:{_registry_sha256(name)}"
        if entry.cached() != "ready":
            return None
        try:
            return f"{name}@{entry.resolve()}"
        except Exception:  # noqa: BLE001 - an entry that cannot resolve has no identity (and so no advice)
            return None
    if not isinstance(spec, (str, os.PathLike)):
        return None
    path = Path(name).expanduser()
    if not path.exists():
        return None
    stat = path.stat()
    return f"{path.resolve()}@{stat.st_size}:{stat.st_mtime_ns}" if path.is_file() else str(path.resolve())


def regime_of(temperature: float) -> str:
    return "greedy" if not temperature else "sampled"


def record_key(target: str, draft: str | None, machine: dict[str, Any], regime: str) -> dict[str, Any]:
    return {"target": target, "draft": draft, "machine": machine, "regime": regime}


def record_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return advice_dir() / f"{digest}.json"


# --------------------------------------------------------------------------- what the default method reads

_announced: set[str] = set()


def recorded_method(target: Any, draft: Any, temperature: float, *, device: Any = "cpu") -> str | None:
    """The exact method a bench recorded as fastest for this pair (target, draft: the request's draft or the
    registry's) on this machine, with one line the first time a process follows it; None without such a record.
    DRAFTWISE_ADVICE=0 turns records off."""
    if os.environ.get("DRAFTWISE_ADVICE", "1") == "0":
        return None
    target_id = model_identity(target)
    if target_id is None:
        return None
    draft_id = model_identity(draft) if draft is not None else None
    if draft is not None and draft_id is None:
        return None
    key = record_key(target_id, draft_id, machine_signature(device), regime_of(temperature))
    path = record_path(key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as error:
        return _ignored(path, f"cannot read it ({error.strerror or error})")
    try:
        record = json.loads(text)
    except ValueError as error:
        return _ignored(path, f"not valid JSON ({error})")
    if not isinstance(record, dict):
        return _ignored(path, "not a JSON object")
    if any(record.get(k) != v for k, v in key.items()):
        return None  # another machine's or pair's record under this name (a copied cache): not ours
    from draftwise.methods import METHODS

    method = record.get("method")
    if not isinstance(method, str) or method not in METHODS:
        return _ignored(path, f"its method {method!r} is not a draftwise method")
    if not METHODS[method].exact:
        return _ignored(path, f"its method {method!r} is not exact (only an exact method may be the default)")
    if str(path) not in _announced:
        _announced.add(str(path))
        date = str(record.get("date", "?"))[:10]
        warnings.warn(f"using {method!r}, the fastest exact method measured on this machine for this pair "
                      f"({record.get('command', 'bench')}, {date}; {path})", AdviceNotice, stacklevel=4)
    return method


def _ignored(path: Path, why: str) -> None:
    warnings.warn(f"ignoring the method advice in {path}: {why} (`draftwise bench` writes it again)",
                  DraftwiseWarning, stacklevel=4)
    return None
