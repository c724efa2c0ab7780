"""Measured advice: which exact method `bench` found fastest on this machine, and why.

`advise` reads a bench's results (and the verification costs it timed, `bench.verify.verify_costs`) and names the
fastest exact method with one line of why. `write_record` keeps that winner for the default method to follow
(`advice_record`: the record's key, place and reading).
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from draftwise.advice_record import VERSION, model_identity, record_key, record_path, regime_of


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
    if set(speeds) <= {"ar"}:  # no method the default could run beside ar: no evidence either way (a run of
        return None            # `sd/gamma=3` alone must not record ar as this machine's choice)
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
    key = record_key(target, draft, advice["machine"], regime_of(config["temperature"]))
    path = record_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json({**key, "version": VERSION, "method": advice["method"], "speedup_vs_ar": advice["speedup_vs_ar"],
                "speedups": advice["speedups"], "costs": advice["costs"], "line": advice["line"],
                "command": command, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "prompts": len(config.get("prompts") or ()), "max_new_tokens": config.get("max_new_tokens"),
                "target_spec": str(config["target"]), "draft_spec": draft_spec}, path)
    return path
