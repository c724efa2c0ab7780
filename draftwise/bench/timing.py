"""How benchmark scripts time things (a forward, a kernel, a generation): cases interleaved round by round after
untimed warm-up rounds, each case's wall times kept, medians taken. A script calls `interleaved` instead of writing
its own loop."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping


def interleaved(cases: Mapping[str, Callable[[], Any]], *, rounds: int, warmup: int = 1,
                after: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Each case's wall seconds over `rounds` rounds; within a round the cases run one after another in their
    order, so a drift of the machine touches them alike. `warmup` rounds run first, untimed. `after(name)`, when
    given, runs after each call of a case, untimed (a rollback, say)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds!r}")
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(warmup + rounds):
        for name, case in cases.items():
            start = time.perf_counter()
            case()
            elapsed = time.perf_counter() - start
            if after is not None:
                after(name)
            if i >= warmup:
                seconds[name].append(elapsed)
    return seconds


def medians(seconds: Mapping[str, list[float]]) -> dict[str, float]:
    """The median of each case's times."""
    return {name: statistics.median(values) for name, values in seconds.items()}


def once(cases: Mapping[Any, Callable[[], Any]]) -> dict[Any, tuple[float, Any]]:
    """One round of `interleaved` that keeps what the cases return: each case's (wall seconds, result), the cases
    called in their order."""
    results: dict[Any, Any] = {}
    walls = interleaved({name: (lambda name=name: results.__setitem__(name, cases[name]())) for name in cases},
                        rounds=1, warmup=0)
    return {name: (walls[name][0], results[name]) for name in cases}


class CallTimer:
    """Wall time spent inside the wrapped methods (`wrap`: a class's method, replaced in place; a call nested in
    another wrapped call counted once), accumulated in `spent`."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.depth = 0

    def wrap(self, owner: type, name: str) -> None:
        fn = getattr(owner, name)
        timer = self

        def wrapper(*args, **kwargs):
            timer.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.depth -= 1
                if timer.depth == 0:
                    timer.spent += time.perf_counter() - start

        setattr(owner, name, wrapper)
