"""Connecting to Redis: one clear error when it cannot be reached at first, then a
client that rides out a restart.

`connect` pings once with a short retry, so a wrong URL or a server that is down is
reported at once. After that the client retries every command that loses its
connection (refused, reset, timed out, or Redis still loading its data after a
restart) for ever, with capped exponential back-off and one log line per attempt,
the URL redacted. Workers, `spec-submit --wait` and every other command therefore
carry on across a Redis restart instead of exiting.

Commands are retried as redis-py sends them again. The writes that matter are safe to
repeat: a line and its counters go in once per (batch, line key) whatever happens
(jobstore.store), and RQ's bookkeeping tolerates a repeated step.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from urllib.parse import urlsplit

import redis
from redis import Redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from jobstore import config
from jobstore.errors import RedisUnavailable

log = logging.getLogger("specfleet.redis")


class ReconnectingRetry(Retry):
    """redis-py's Retry, for ever by default, logging one line per failed attempt.

    Several threads (a worker's heartbeat and its main loop) share one instance, so
    the attempt count lives in the call, not in the object.
    """

    def __init__(self, url: str, base_s: float, cap_s: float, retries: int = -1):
        super().__init__(
            ExponentialBackoff(cap=cap_s, base=base_s),
            retries,
            (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, socket.timeout),
        )
        self.where = config.redact(url)
        self.base_s, self.cap_s = base_s, cap_s
        self._outage_lock = threading.Lock()
        self._down_since: float | None = None
        self._interrupted = threading.Event()

    def interrupt(self) -> None:
        """Stop retrying, now and from now on: a waiting command raises its last error
        at once (a process that was asked to stop must not wait for Redis for ever)."""
        self._interrupted.set()

    def __eq__(self, other):
        return self is other

    __hash__ = object.__hash__

    def __deepcopy__(self, memo):
        # redis-py copies the retry into each connection: share this one, so that
        # interrupt() reaches every connection of the client.
        return self

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        failures = 0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                if 0 <= self._retries < failures or self._interrupted.is_set():
                    raise
                wait = min(self.cap_s, self.base_s * 2**failures)
                self._note_failure(error, failures, wait)
                if self._interrupted.wait(wait):
                    raise
                continue
            if failures:
                self._note_recovery()
            return result

    def _note_failure(self, error: Exception, attempt: int, wait: float) -> None:
        with self._outage_lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
        log.warning(
            "Redis at %s: %s (attempt %d); retrying in %.1f s",
            self.where,
            _reason(error),
            attempt,
            wait,
        )

    def _note_recovery(self) -> None:
        with self._outage_lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            log.warning(
                "Redis at %s: reconnected after %.1f s", self.where, time.monotonic() - since
            )


def connect(
    url: str | None = None,
    check: bool = True,
    reconnect: bool = True,
    timeout_s: float | None = None,
) -> Redis:
    """A client for `url` (or the configured URL), pinged once when `check`.

    With `reconnect` (the default), once the first ping succeeds every later command
    that loses Redis is retried for ever with capped exponential back-off (see the
    module docstring). With `timeout_s` (spec-serve's requests: someone waits on them),
    connecting and each reply may take that long, and a lost connection is tried again
    once, at once, a timeout not at all. Raises RedisUnavailable with the redacted URL
    and the reason.
    """
    url = config.redis_url(url)
    retry = Retry(NoBackoff(), 1)
    if timeout_s is not None:
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
    try:
        _check_database(url)
        conn = Redis.from_url(
            url,
            socket_connect_timeout=5 if timeout_s is None else timeout_s,
            socket_timeout=timeout_s,
            socket_keepalive=True,
            health_check_interval=30,
            retry=retry,
        )
        if check:
            conn.ping()
    except (redis.exceptions.RedisError, ValueError, OSError) as exc:
        raise RedisUnavailable(
            f"cannot reach Redis at {config.redact(url)}: {_reason(exc)}"
        ) from exc
    if reconnect:
        conn.set_retry(ReconnectingRetry(url, config.RECONNECT_BASE_S, config.reconnect_cap_s()))
    return conn


def _check_database(url: str) -> None:
    """Raises ValueError when the URL's database (its path) is not a number: redis-py
    would quietly use database 0 for `redis://host/abc`."""
    path = urlsplit(url).path.strip("/")
    if path and not path.isdigit():
        raise ValueError(
            f"the database in the URL must be a number (redis://host:6379/0), got {path!r}"
        )


def warn_if_evicting(conn: Redis) -> str | None:
    """A warning when Redis may evict keys (queued jobs and results would be lost);
    None when the policy is noeviction or cannot be read (managed Redis)."""
    try:
        policy = conn.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.exceptions.RedisError:
        return None
    if policy and policy != "noeviction":
        return (
            f"Redis maxmemory-policy is {policy}: under memory pressure it may evict queued "
            "jobs and results; set it to noeviction"
        )
    return None


#: What Redis or redis-py say when a password is needed and none was given.
_NO_PASSWORD = ("NOAUTH", "Authentication required", "HELLO must be called with the client")


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if any(s in text for s in _NO_PASSWORD):
        return "this Redis requires a password: put it in the URL, redis://:PASSWORD@host:port/0"
    # redis-py sometimes repeats the URL or host in its message: keep it short.
    return text.splitlines()[0][:200]
