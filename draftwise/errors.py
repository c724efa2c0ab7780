"""Errors draftwise raises for bad input; each message names the problem and the fix."""


class DraftwiseError(ValueError):
    """Bad input to draftwise (an option, a model pairing, a prompt)."""


class ModelNotAvailableError(DraftwiseError):
    """A model spec could not be resolved to weights on this machine."""


class DraftwiseWarning(UserWarning):
    """Something draftwise did differently from what was asked (a draft ignored, a budget cut); the CLI prints
    it as one line."""
