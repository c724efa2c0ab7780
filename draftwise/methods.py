"""The method registry: name -> (drafter kind, acceptance rule, options with defaults).

Every default is defined here once; the API, the CLI and `draftwise methods` read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .acceptance import ExactRule, LossyGreedyRule, LossyRule, TargetRule
from .errors import DraftwiseError


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    type: type
    help: str


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    drafter: str  # "none" | "model" | "ngram"
    make_rule: Callable[[dict[str, Any]], TargetRule]
    options: tuple[Option, ...] = ()
    uses_gamma: bool = True
    greedy_only: bool = False
    exact: bool = True
    reference: str = ""
    _defaults: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_defaults", {o.name: o.default for o in self.options})

    @property
    def needs_draft(self) -> bool:
        return self.drafter == "model"

    def resolve_options(self, given: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(given) - set(self._defaults))
        if unknown:
            valid = ", ".join(self._defaults) or "none"
            raise DraftwiseError(f"method {self.name!r} has no option {', '.join(map(repr, unknown))}; its options: {valid}")
        options = dict(self._defaults)
        for option in self.options:
            if option.name in given and given[option.name] is not None:
                value = given[option.name]
                try:
                    typed = option.type(value)
                except (TypeError, ValueError):
                    typed = None
                if typed is None or (isinstance(typed, float) and not math.isfinite(typed)):
                    raise DraftwiseError(
                        f"option {option.name!r} of method {self.name!r} must be a finite {option.type.__name__}, "
                        f"got {value!r}"
                    )
                options[option.name] = typed
        return options


def _positive_int(name: str, value: int) -> int:
    if value < 1:
        raise DraftwiseError(f"{name} must be >= 1, got {value}")
    return value


def _ngram_rule(options: dict[str, Any]) -> TargetRule:
    _positive_int("min_ngram", options["min_ngram"])
    if options["max_ngram"] < options["min_ngram"]:
        raise DraftwiseError(f"max_ngram ({options['max_ngram']}) must be >= min_ngram ({options['min_ngram']})")
    return ExactRule()


_ALPHA = Option("alpha", 0.1, float, "deviation allowed from the target (0 = exact)")

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "ar", "target-only autoregressive decoding: the baseline every speedup is measured against",
            drafter="none", make_rule=lambda o: ExactRule(), uses_gamma=False,
        ),
        Method(
            "sd", "speculative decoding with a draft model and gamma draft tokens (exact)",
            drafter="model", make_rule=lambda o: ExactRule(), reference="Leviathan et al. 2023",
        ),
        Method(
            "lossy", "lossy speculative sampling: accept with min(1, p/((1-alpha) q)), recover from norm(max(0, p/beta - q))",
            drafter="model", make_rule=lambda o: LossyRule(alpha=o["alpha"], beta=o["beta"]),
            options=(_ALPHA, Option("beta", 1.0, float, "residual scale, >= 1 - alpha (1 = Zhou et al.)")),
            exact=False, reference="Tran-Thien 2023; seed 003 §2, Lemma 2",
        ),
        Method(
            "lossy-greedy", "deterministic lossy variant for temperature 0: keep a draft token if p(v) >= (1-alpha) max p",
            drafter="model", make_rule=lambda o: LossyGreedyRule(alpha=o["alpha"]),
            options=(_ALPHA,), greedy_only=True, exact=False, reference="Leviathan et al. 2023 A.5; seed 003 §C.4",
        ),
        Method(
            "prompt-lookup", "n-gram drafting over the prompt and output so far, no draft model (exact)",
            drafter="ngram", make_rule=_ngram_rule,
            options=(
                Option("max_ngram", 3, int, "longest n-gram to match"),
                Option("min_ngram", 1, int, "shortest n-gram to match"),
            ),
            reference="Saxena 2023 (prompt lookup decoding)",
        ),
    )
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise DraftwiseError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}") from None
