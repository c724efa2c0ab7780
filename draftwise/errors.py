"""Errors draftwise raises for bad input; each message names the problem and the fix."""


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
