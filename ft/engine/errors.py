"""Exceptions the engine raises for bad input. Each message names the problem."""


class FreeTokenError(Exception):
    """Base class of FreeToken's own errors."""


class CheckpointError(FreeTokenError, ValueError):
    """A checkpoint is malformed: a missing or unexpected tensor, a wrong shape, a bad file."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or quantization is not one FreeToken runs."""


class ConfigError(FreeTokenError, ValueError):
    """Engine options contradict each other or the memory budget."""


class RequestError(FreeTokenError, ValueError):
    """A request cannot be served as given (too long for the context, bad parameters)."""
