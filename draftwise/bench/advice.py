"""Measured advice: which exact method `bench` found fastest on this machine, why, and the record the default
method follows.

`advise` reads a bench's results (and the verification costs it timed, `bench.verify.verify_costs`) and names the
fastest exact method with one line of why. `write_record` keeps that winner in `<cache>/advice/<key>.json`, one file
per (target, draft, machine signature, greedy or sampled), written atomically; `recorded_method` is what
`plan.default_method` asks: the recorded winner for this machine and this pair, or None (no record, a record of
another machine or pair, or a corrupt one, which is ignored with one warning line).

The machine signature is what decides which method wins: the CPU model, the instruction-set flags draftwise's
kernels use, the torch threads and the accelerator. A model's identity is its registry name with the file's known
SHA-256 (or the folder an entry resolves to), or a path with its size and modification time, so a record never
follows a name onto other weights.
"""

from __future__ import annotations

import datetime
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


def _regime(temperature: float) -> str:
    return "greedy" if not temperature else "sampled"


def _key(target: str, draft: str | None, machine: dict[str, Any], regime: str) -> dict[str, Any]:
    return {"target": target, "draft": draft, "machine": machine, "regime": regime}


def record_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return advice_dir() / f"{digest}.json"


# --------------------------------------------------------------------------- what a bench run says


def _candidates(results: dict[str, Any]) -> dict[str, float]:
    """Exact methods of a bench run that the default could run as measured: a plain method name (no label
    options, no --option for it), with the API's default gamma where it drafts a fixed number of tokens."""
    from draftwise.bench.labels import parse_label
    from draftwise.methods import METHODS

    config = results["config"]
    options = config.get("method_options") or {}
    out = {}
    for label, m in results["methods"].items():
        name, fixed = parse_label(label)
        spec = METHODS.get(name)
        if spec is None or not spec.exact or fixed or label in options or name in options:
            continue
        if spec.uses_gamma and config.get("gamma") != _default_gamma():
            continue
        speedup = m.get("speedup_vs_ar") if name != "ar" else 1.0
        if speedup is not None:
            out[label] = float(speedup)
    return out


def _default_gamma() -> int:
    import inspect

    from draftwise.api import generate

    return inspect.signature(generate).parameters["gamma"].default


def advise(results: dict[str, Any], costs: dict[str, Any] | None, machine: dict[str, Any]) -> dict[str, Any] | None:
    """{"method", "speedup_vs_ar", "line", "machine", ...}: the fastest exact method of the run and why, or None
    where the run had no `ar` to compare with."""
    if "ar" not in results.get("methods", {}):
        return None
    speeds = _candidates(results)
    if not speeds:
        return None
    # A method that committed no more than one token a target call did ar's work plus its drafting: faster than ar
    # only by noise, so it cannot win (its ratio is still shown). A tie goes to ar: nothing to pay.
    methods = results["methods"]
    can_win = {label: s for label, s in speeds.items()
               if label == "ar" or (methods[label].get("mean_accepted_length") or 0) > 1.0 + 1e-9}
    winner = max(can_win, key=lambda label: (can_win[label], label == "ar"))
    others = sorted(((s, label) for label, s in speeds.items() if label not in (winner, "ar")), reverse=True)
    head = (f"fastest exact method here: {winner}" + (f" ({speeds[winner]:.2f}x ar)" if winner != "ar" else ""))
    rest = [f"{label} {s:.2f}x" + (" (no draft accepted: noise)" if label not in can_win and s > 1 else "")
            for s, label in others]
    why = _why(winner, methods, costs, results["config"])
    line = head + ("; " + ", ".join(rest) if rest else "") + (f": {why}" if why else "")
    return {"method": winner, "speedup_vs_ar": speeds[winner], "speedups": speeds, "costs": costs, "line": line,
            "machine": machine}


def _why(winner: str, methods: dict[str, Any], costs: dict[str, Any] | None, config: dict[str, Any]) -> str:
    """Verification cost against what each speculative method gets per target call: a method drafting gamma
    tokens with a draft that costs d target tokens, verifying k = gamma + 1 at v times one token, committing L
    tokens a call, runs at about L / (v + gamma * d) of ar."""
    if not costs:
        return ""
    v, k = costs["verify_vs_k1"], costs["k"]
    parts = [f"a {k}-token verification costs {v:.2f}x one token on this machine"]
    if "draft_vs_target" in costs:
        parts.append(f"a draft token {costs['draft_vs_target']:.2f} of a target token")
    drafted = [(label, m) for label, m in methods.items() if label != "ar" and m.get("mean_accepted_length")]
    model_based = [(label, m) for label, m in drafted if label.split("/")[0] in ("sd", "hybrid")]
    if "draft_vs_target" in costs and model_based:
        label, m = model_based[0]
        gamma = config.get("gamma", 4)
        need = v + gamma * costs["draft_vs_target"]
        got, ran = m["mean_accepted_length"], m.get("speedup_vs_ar")
        rest = ", the gap is time outside these forwards" if ran is not None and ran < 0.95 * got / need else ""
        ran_text = f"; it ran {ran:.2f}x{rest}" if ran is not None else ""
        parts.append(f"so {label} breaks even at {need:.2f} tokens a target call and got {got:.2f} (the forwards "
                     f"alone predict {got / need:.2f}x{ran_text})")
    elif drafted:
        label, m = max(drafted, key=lambda lm: lm[1].get("speedup_vs_ar") or 0)
        parts.append(f"{label} commits {m['mean_accepted_length']:.2f} tokens a target call")
    return ", ".join(parts)


def pair_draft(results: dict[str, Any]) -> str | None:
    """The draft a run measured its draft methods with (sd's where it ran; None when no method used one)."""
    drafts = results["config"].get("drafts") or {}
    if drafts.get("sd"):
        return drafts["sd"]
    return next((d for d in drafts.values() if d), None)


def write_record(results: dict[str, Any], advice: dict[str, Any], *, command: str = "bench") -> Path | None:
    """Keep `advice`'s winner for this machine and the run's pair (atomically); None where the target has no
    identity (an in-memory model)."""
    from draftwise.atomic import write_json

    config = results["config"]
    target = model_identity(config["target"])
    draft_spec = pair_draft(results)
    draft = model_identity(draft_spec) if draft_spec else None
    if target is None or (draft_spec and draft is None):
        return None
    key = _key(target, draft, advice["machine"], _regime(config["temperature"]))
    path = record_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json({**key, "version": VERSION, "method": advice["method"], "speedup_vs_ar": advice["speedup_vs_ar"],
                "speedups": advice["speedups"], "costs": advice["costs"], "line": advice["line"],
                "command": command, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "prompts": len(config.get("prompts") or ()), "max_new_tokens": config.get("max_new_tokens"),
                "target_spec": str(config["target"]), "draft_spec": draft_spec}, path)
    return path


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
    key = _key(target_id, draft_id, machine_signature(device), _regime(temperature))
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
