"""Method labels of the benchmarks: `NAME`, `NAME:RULE`, `NAME@ALPHA`, `NAME/OPTION=VALUE`, and the names that are
not draftwise methods (transformers' assisted decoding, the draft decoding alone)."""

from __future__ import annotations

from typing import Any

from draftwise.errors import DraftwiseError, did_you_mean
from draftwise.methods import MAX_GAMMA, METHODS

HF_METHODS = ("hf-assisted", "prompt-lookup-hf")
DRAFT_ONLY = "draft-only"  # the draft model decoding alone (`ar` with the draft as the model): quality's lower end


def parse_label(label: str) -> tuple[str, dict[str, Any]]:
    """A method label -> (method name, options it fixes).

    `NAME`, `NAME:RULE` (methods with a `rule` option: `cascade:token-v3`), either with
    `@ALPHA` (`lossy@0.3`, `cascade:opt@0.5`), and any with `/OPTION=VALUE` suffixes
    (`mtad/tau=0.3/num_beams=2`; a value cannot hold "/": give paths with --option), so one run can
    hold several variants. `/gamma=N` sets the draft length of a method that drafts gamma tokens (`sd/gamma=3`) in
    place of the run's --gamma.
    """
    name, *settings = label.split("/")
    options: dict[str, Any] = {}
    for setting in settings:
        key, eq, value = setting.partition("=")
        if not eq or not key or not value:
            raise DraftwiseError(f"method label {label!r}: {setting!r} is not OPTION=VALUE")
        if key in options:
            raise DraftwiseError(f"method label {label!r}: option {key!r} given twice")
        options[key] = value
    if "@" in name:
        if "alpha" in options:
            raise DraftwiseError(f"method label {label!r}: alpha given twice (@ and /alpha=)")
        name, _, alpha = name.rpartition("@")
        try:
            options["alpha"] = float(alpha)
        except ValueError:
            raise DraftwiseError(f"method label {label!r}: {alpha!r} after @ is not a number") from None
    if ":" in name:
        name, _, rule = name.partition(":")
        options["rule"] = rule
    if name in HF_METHODS or name == DRAFT_ONLY:
        if options:
            raise DraftwiseError(f"method label {label!r}: {name} takes no :rule, @alpha or /option")
        return name, options
    if name not in METHODS:
        valid = ", ".join(list(METHODS) + list(HF_METHODS) + [DRAFT_ONLY])
        hint = did_you_mean(name, list(METHODS) + list(HF_METHODS) + [DRAFT_ONLY])
        raise DraftwiseError(f"unknown method {name!r} in {label!r}{hint}; valid: {valid}")
    gamma = options.pop("gamma", None)
    known = {o.name for o in METHODS[name].options}
    for key in options:
        if key not in known:
            raise DraftwiseError(f"method label {label!r}: method {name!r} has no {key!r} option")
    if options:  # validate the values the label fixes; required options (a verifier path) come from --option
        resolved = METHODS[name].resolve_options(options)
        options = {key: resolved[key] for key in options}  # typed
        METHODS[name].make_rule(resolved)
    if gamma is not None:
        options["gamma"] = _label_gamma(label, name, gamma)
    return name, options


def _label_gamma(label: str, name: str, value: str) -> int:
    spec = METHODS[name]
    if not spec.uses_gamma:
        window = f"; its draft length is /{spec.run_option}=N" if spec.run_option else ""
        raise DraftwiseError(f"method label {label!r}: method {name!r} does not draft gamma tokens{window}")
    try:
        gamma = int(value)
    except ValueError:
        raise DraftwiseError(f"method label {label!r}: gamma {value!r} is not a whole number") from None
    if not 1 <= gamma <= MAX_GAMMA:
        raise DraftwiseError(f"method label {label!r}: gamma must be 1..{MAX_GAMMA}, got {gamma}")
    return gamma


def run_options(label: str, method_options: dict[str, dict[str, Any]], gamma: int) -> tuple[str, dict[str, Any]]:
    """A label's method and the keyword arguments `generate` takes for it: --option values for the method, then
    for the label, then what the label fixes; gamma is the run's unless the label sets its own."""
    name, fixed = parse_label(label)
    return name, {"gamma": gamma, **method_options.get(name, {}), **method_options.get(label, {}), **fixed}
