"""Connecting to Redis, with one clear error instead of a traceback."""

from __future__ import annotations

import logging

import redis
from redis import Redis

from producer import config

log = logging.getLogger(__name__)


class RedisUnavailable(Exception):
    """Redis cannot be reached or refused us; the message is safe to print."""


def connect(url: str | None = None, check: bool = True) -> Redis:
    """A client for `url` (or the configured URL), pinged once when `check`.

    Raises RedisUnavailable with the redacted URL and the reason.
    """
    url = config.redis_url(url)
    try:
        conn = Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30)
        if check:
            conn.ping()
    except (redis.exceptions.RedisError, ValueError, OSError) as exc:
        raise RedisUnavailable(
            f"cannot reach Redis at {config.redact(url)}: {_reason(exc)}"
        ) from exc
    return conn


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


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    # redis-py sometimes repeats the URL or host in its message: keep it short.
    return text.splitlines()[0][:200]
