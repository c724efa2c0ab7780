"""Errors draftwise raises for bad input; each message names the problem and the fix."""

from __future__ import annotations

from typing import Iterable


class DraftwiseError(ValueError):
    """Bad input to draftwise (an option, a model pairing, a prompt)."""


class ModelNotAvailableError(DraftwiseError):
    """A model spec could not be resolved to weights on this machine."""


class DraftwiseWarning(UserWarning):
    """Something draftwise did differently from what was asked (a draft ignored, a budget cut); the CLI prints
    it as one line."""


def short(value: object, limit: int = 80) -> str:
    """A value for an error message, cut short: an error never echoes a whole input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest of `choices` to a mistyped `word`, or '' when none is close."""
    import difflib

    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.75)
    if not close and word.lower() != word:
        close = [c for c in choices if c.lower() == word.lower()][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""
