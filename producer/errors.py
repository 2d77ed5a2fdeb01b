"""The errors of the commands that follow a batch (status, collect, retry, cancel), and
Redis's refusals turned into them: one line a user can act on, never a traceback."""

from __future__ import annotations

import functools


class BatchError(Exception):
    """A batch operation cannot be done as asked; the message says why."""


class SubmitError(Exception):
    """The file cannot be submitted as asked; the message says why."""


class CorruptBatch(BatchError):
    """The batch's state in Redis is damaged (a key of the wrong type, a counter that is
    not a number, a stored line that is not JSON); the message names the key and field."""


class OutputError(BatchError):
    """A collect output file cannot be written; nothing was changed on disk."""


class CorruptLines(CorruptBatch):
    """Collect wrote its files, but some stored lines were not valid JSON: each was
    written as an `internal_error` error line instead. `counts` are collect's counts."""

    def __init__(self, message: str, counts: dict[str, int]):
        super().__init__(message)
        self.counts = counts


def first_line(exc: Exception) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    return (str(exc) or type(exc).__name__).splitlines()[0]


def redis_refusals(func):
    """A command Redis refuses (a key of the wrong type, a script that meets damaged
    data, a full Redis) becomes one BatchError line, not a traceback."""

    @functools.wraps(func)
    def run(*args, **kwargs):
        from redis.exceptions import ResponseError  # imported by then: the command ran

        try:
            return func(*args, **kwargs)
        except ResponseError as exc:
            error = CorruptBatch if str(exc).startswith("WRONGTYPE") else BatchError
            raise error(f"Redis refused a command: {first_line(exc)}") from exc

    return run
