"""Errors that reach users: each carries a one-line message and never a traceback."""


class EpdserveError(Exception):
    """Base of every user-facing error."""


class InvalidRequestError(EpdserveError, ValueError):
    """The request itself is wrong (empty prompt, too long, bad sampling parameters)."""


class ConfigError(EpdserveError, ValueError):
    """An engine or server option is invalid."""
