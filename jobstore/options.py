"""Click options and the one error style that every specfleet command shares.

A command fails with one line on stderr, `<command>: error: <message>`, and an exit
code that says what kind of failure it was:

    0  done
    1  the request cannot be done as asked: an invalid job file or option value, an
       unknown batch, a model pair that does not load
    2  bad command-line usage (click's own message: `Error: ...`, after the usage line)
    3  Redis cannot be reached or refuses us (wrong password, TLS), or was lost and
       did not come back
    130 Ctrl-C while watching a batch (the batch goes on)

spec-worker adds 128 + N after a second stop signal N (its job went back to the queue).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import NoReturn

import click

from jobstore import config
from jobstore.errors import JobStoreError, RedisUnavailable

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REDIS = 3

REDIS_HELP = (
    "Redis URL [default: $SPEC_REDIS_URL, else $REDIS_URL, else " + config.DEFAULT_REDIS_URL + "]"
)


def fail(command: str, message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print `<command>: error: <message>` on stderr and exit with code."""
    click.echo(f"{command}: error: {message}", err=True)
    sys.exit(code)


def friendly_errors(command: str, *errors: type[Exception]) -> Callable:
    """Decorator: the errors a user can act on become one line on stderr and their exit
    code (jobstore's errors and `errors` exit 1; Redis unreachable or lost, 3)."""

    def wrap(func):
        @functools.wraps(func)
        def run(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except RedisUnavailable as exc:
                fail(command, str(exc), EXIT_REDIS)
            except (JobStoreError, *errors) as exc:
                fail(command, str(exc))
            except Exception as exc:
                if not _lost_redis(exc):
                    raise
                url = config.redact(config.redis_url(kwargs.get("redis_url")))
                fail(command, f"lost the connection to Redis at {url}: {exc}", EXIT_REDIS)

        return run

    return wrap


def _lost_redis(exc: Exception) -> bool:
    """Whether exc is redis-py's ConnectionError (redis is not imported for that: a
    command that never imported it cannot have lost a connection, and `--help` stays
    fast)."""
    redis = sys.modules.get("redis")
    return redis is not None and isinstance(exc, redis.exceptions.ConnectionError)


def redis_option(func: Callable) -> Callable:
    """--redis URL, passed as `redis_url` (None: the environment's, else the default)."""
    return click.option("--redis", "redis_url", metavar="URL", help=REDIS_HELP)(func)


def pair_options(func: Callable) -> Callable:
    """--target and --draft: the model pair a generating command loads."""
    func = click.option(
        "--draft",
        metavar="DIR_OR_ID",
        help="Draft model (default: the demo draft with the demo target).",
    )(func)
    return click.option(
        "--target", metavar="DIR_OR_ID", help="Target model (default: the bundled demo target)."
    )(func)
