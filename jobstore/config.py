"""Defaults for the producer and the worker, in one place, with their environment fallbacks.

Every value here has one line of documentation. Command-line options override these;
environment variables override the built-in defaults.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: Redis used when neither --redis, SPEC_REDIS_URL nor REDIS_URL is given.
DEFAULT_REDIS_URL = "redis://localhost:6379/0"

#: Prefix of every Redis key this project owns (RQ's own keys start with "rq:").
#: Tests set SPEC_KEY_PREFIX to keep runs apart on a shared server.
DEFAULT_KEY_PREFIX = "specfleet"

#: Model alias a line runs on when neither the line nor --model names one.
DEFAULT_MODEL = "demo"

#: The bundled demo pair (`target/`, `draft/`), served as DEFAULT_MODEL. Plain files: the
#: submit side reads the target's tokenizer and config from here without MLX.
DEMO_PAIR_DIR = Path(__file__).resolve().parent.parent / "engine" / "demo"

#: A job may run for BASE + PER_TOKEN * max_tokens + PER_PROMPT_CHAR * prompt chars
#: seconds before it is stopped: finite, and generous for a slow CPU.
JOB_TIMEOUT_BASE_S = 120
JOB_TIMEOUT_PER_TOKEN_S = 1.0
JOB_TIMEOUT_PER_PROMPT_CHAR_S = 0.01

#: How many times a job that raised, timed out or lost its worker is run again
#: before its line becomes an error line.
JOB_RETRIES = 2

#: A running job's worker refreshes its liveness every HEARTBEAT_INTERVAL_S; a job whose
#: liveness is older than HEARTBEAT_TTL_S is abandoned and may be picked up again.
HEARTBEAT_INTERVAL_S = 10
HEARTBEAT_TTL_S = 60

#: How long a failed RQ job (the queue's record, not the error line) is kept.
FAILURE_TTL_S = 7 * 24 * 3600

#: A worker's `P:worker:W` hash (lifetime counters, last seen) outlives its last
#: heartbeat by this long.
WORKER_STATS_TTL_S = 7 * 24 * 3600

#: Result lines expire this many seconds after the batch's last write; 0 keeps them
#: until `spec-collect --delete`.
RESULT_TTL_S = 0

#: A result or error line longer than this many bytes is not stored: an error line
#: saying so is stored instead, so one runaway request cannot fill Redis.
MAX_RESULT_BYTES = 1024 * 1024

#: A worker stores lines that finish in quick succession together, in one call (their
#: counters summed once): at most STORE_GROUP_LINES lines, none held longer than
#: STORE_GROUP_WAIT_S; a line that took longer than that to decode is stored at once.
STORE_GROUP_LINES = 32
STORE_GROUP_WAIT_S = 0.2

#: Largest line a reader unpacks from Redis (bounds its memory against damaged data;
#: far above any SPEC_MAX_RESULT_BYTES a worker would use).
MAX_STORED_LINE_BYTES = 64 * 1024 * 1024

#: Once connected, a command that loses Redis tries again after RECONNECT_BASE_S * 2^n
#: seconds, at most RECONNECT_CAP_S apart, for ever (a restart is ridden out; Ctrl-C
#: or SIGTERM stops). The first connection of a command is not retried: a wrong URL
#: fails at once.
RECONNECT_BASE_S = 0.25
RECONNECT_CAP_S = 30.0

#: A spec-submit holds its batch's submit lock for this long, renewed a third of the way
#: through, so a second submit of the same batch cannot enqueue the same lines again.
SUBMIT_LOCK_TTL_S = 30

#: How long a spec-submit waits for another submit of the same batch to finish before it
#: gives up with a one-line error.
SUBMIT_LOCK_WAIT_S = 30

#: Lines per Redis pipeline when enqueueing and collecting (bounds memory).
CHUNK_LINES = 500

#: Most rows one RQ job carries (a line is a row per choice: n rows). A job per line
#: costs Redis ~1 KB and ~70 commands of RQ bookkeeping; a job of many lines shares that
#: cost, and its lines stay idempotent one by one (jobstore.store), so a job that runs
#: again skips the lines it answered. A line of more choices than this is a job alone.
JOB_LINES_MAX = 64

#: spec-submit aims for at least this many jobs per batch (a small file keeps one line
#: per job, so a fleet's rows share it out); larger files get up to JOB_LINES_MAX lines
#: per job: lines per job = total lines // JOB_SPREAD, between 1 and JOB_LINES_MAX.
JOB_SPREAD = 256

#: A job-file line longer than this many bytes is an error, never read whole.
MAX_LINE_BYTES = 8 * 1024 * 1024

#: Largest request record a worker reads from Redis: a job-file line's cap and room for
#: what submit adds (model, job number, time limit). A larger one, written into Redis
#: by other means, becomes an `invalid_request` error line without being read.
MAX_RECORD_BYTES = MAX_LINE_BYTES + 4096

#: How often `spec-submit --wait` polls the batch status, in seconds.
WAIT_POLL_S = 1.0

#: spec-serve (the OpenAI Batch API): where uploaded files are kept, the port it listens
#: on, the largest upload and the largest JSON request body it accepts, in bytes.
SERVE_DATA_DIR = "spec-serve-data"
SERVE_PORT = 8000
SERVE_MAX_UPLOAD_BYTES = 512 * 1024 * 1024
SERVE_MAX_BODY_BYTES = 1024 * 1024
#: spec-serve's requests wait this long for Redis (to connect, and for each reply)
#: before they get a 503: a client must hear back within seconds.
SERVE_REDIS_TIMEOUT_S = 2.0

#: MiB each worker's prefix cache (engine.prefix: kept prompt prefixes, target and draft
#: together) may hold; unset (None): a tenth of the machine's memory, at most 8 GiB;
#: 0 turns the cache off. Environment: SPEC_PREFIX_CACHE_MB.
PREFIX_CACHE_MB: int | None = None

#: A worker checks at start-up, on ~32 greedy tokens of a fixed prompt, that its drafter's
#: drafts get accepted (engine.acceptance_check), and warns if almost none are; it never
#: stops the worker. Environment: SPEC_ACCEPTANCE_CHECK=0 skips it.
ACCEPTANCE_CHECK = True

#: Alias and batch ids are used in Redis keys and RQ job ids: keep them plain.
ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ALIAS_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def redis_url(explicit: str | None = None) -> str:
    """The Redis URL to use: the explicit one, else SPEC_REDIS_URL, else REDIS_URL,
    else DEFAULT_REDIS_URL."""
    return (
        explicit
        or os.environ.get("SPEC_REDIS_URL")
        or os.environ.get("REDIS_URL")
        or DEFAULT_REDIS_URL
    )


def key_prefix() -> str:
    """Prefix of this project's Redis keys (SPEC_KEY_PREFIX, default "specfleet")."""
    return os.environ.get("SPEC_KEY_PREFIX") or DEFAULT_KEY_PREFIX


def result_ttl_s() -> int:
    """Seconds result lines live (SPEC_RESULT_TTL_S); 0 means until deleted."""
    return int(os.environ.get("SPEC_RESULT_TTL_S") or RESULT_TTL_S)


def max_result_bytes() -> int:
    """Largest result or error line stored, in bytes (SPEC_MAX_RESULT_BYTES)."""
    return int(os.environ.get("SPEC_MAX_RESULT_BYTES") or MAX_RESULT_BYTES)


def submit_lock_wait_s() -> float:
    """Seconds spec-submit waits for another submit of its batch (SPEC_SUBMIT_LOCK_WAIT_S)."""
    return float(os.environ.get("SPEC_SUBMIT_LOCK_WAIT_S") or SUBMIT_LOCK_WAIT_S)


def job_lines(total_lines: int) -> int:
    """Rows per RQ job for a file of `total_lines` rows (a line counts its n choices;
    SPEC_JOB_LINES overrides the choice; it is still capped at JOB_LINES_MAX)."""
    forced = int(os.environ.get("SPEC_JOB_LINES") or 0)
    chosen = forced if forced > 0 else total_lines // JOB_SPREAD
    return max(1, min(JOB_LINES_MAX, chosen))


def prefix_cache_bytes() -> int | None:
    """Byte budget of a worker's prefix cache (SPEC_PREFIX_CACHE_MB, in MiB), or None to
    let the engine size it from the machine's memory."""
    raw = os.environ.get("SPEC_PREFIX_CACHE_MB")
    mb = PREFIX_CACHE_MB if raw in (None, "") else float(raw)
    if mb is None:
        return None
    if mb < 0:
        raise ValueError(f"SPEC_PREFIX_CACHE_MB: must be >= 0, got {raw}")
    return int(mb * (1 << 20))


def acceptance_check() -> bool:
    """Whether a worker checks its drafter's acceptance at start-up (SPEC_ACCEPTANCE_CHECK:
    0, false, no or off skips it)."""
    raw = (os.environ.get("SPEC_ACCEPTANCE_CHECK") or "").strip().lower()
    return ACCEPTANCE_CHECK if not raw else raw not in ("0", "false", "no", "off")


def reconnect_cap_s() -> float:
    """Longest wait between two reconnection attempts (SPEC_RECONNECT_CAP_S)."""
    return float(os.environ.get("SPEC_RECONNECT_CAP_S") or RECONNECT_CAP_S)


def heartbeat_interval_s() -> float:
    """Seconds between a running job's heartbeats (SPEC_HEARTBEAT_INTERVAL_S)."""
    return float(os.environ.get("SPEC_HEARTBEAT_INTERVAL_S") or HEARTBEAT_INTERVAL_S)


def heartbeat_ttl_s() -> int:
    """Seconds a heartbeat keeps a job alive (SPEC_HEARTBEAT_TTL_S)."""
    return int(os.environ.get("SPEC_HEARTBEAT_TTL_S") or HEARTBEAT_TTL_S)


def redact(url: str) -> str:
    """The URL with any password replaced by "***", safe to print or log.

    Everything between "://" and the last "@" is user info: its password part is
    hidden even when it holds characters a URL parser would misread ("#", "/", "?"),
    and so is a `password=` query argument.

    >>> redact("redis://:s3cret@host:6379/0")
    'redis://:***@host:6379/0'
    >>> redact("rediss://user:p#ss/w@host:6380/1?password=x&ssl_cert_reqs=none")
    'rediss://user:***@host:6380/1?password=***&ssl_cert_reqs=none'
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<unparseable URL>" if "@" in url else url
    userinfo, at, hostpart = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        # A user info without ":" may be a password written in the user's place.
        userinfo = f"{user}:***" if colon else "***"
        rest = f"{userinfo}@{hostpart}"
    return f"{scheme}://" + _PASSWORD_ARG.sub(r"\1***", rest)


_PASSWORD_ARG = re.compile(r"([?&][^=&#]*password=)[^&#]*", re.IGNORECASE)


def job_timeout_s(max_tokens: int, prompt_chars: int, rows: int = 1) -> int:
    """Seconds one line may run before its worker stops it; grows with the work asked
    for (`rows`: its choices, n, each up to max_tokens). Stored with the line's request
    at submit time."""
    return int(
        JOB_TIMEOUT_BASE_S
        + JOB_TIMEOUT_PER_TOKEN_S * max_tokens * rows
        + JOB_TIMEOUT_PER_PROMPT_CHAR_S * prompt_chars
    )


def serve_data_dir(explicit: str | None = None) -> Path:
    """spec-serve's data directory: the explicit one, else SPEC_SERVE_DATA_DIR, else
    SERVE_DATA_DIR (relative to the working directory)."""
    return Path(explicit or os.environ.get("SPEC_SERVE_DATA_DIR") or SERVE_DATA_DIR)


def serve_api_key() -> str | None:
    """The API key spec-serve requires (SPEC_API_KEY); None when unset or empty."""
    return os.environ.get("SPEC_API_KEY") or None


def serve_max_upload_bytes() -> int:
    """Largest file spec-serve accepts (SPEC_SERVE_MAX_UPLOAD_BYTES)."""
    return int(os.environ.get("SPEC_SERVE_MAX_UPLOAD_BYTES") or SERVE_MAX_UPLOAD_BYTES)
